"""Tensor-parallel ranks 1..N-1 of a Serve replica, as Ray actors in the replica's placement group.

The replica (rank 0) runs in bundle 0 of a ``STRICT_PACK`` placement group of N bundles
(``cluster/app.py`` asks Serve for it; the Helm chart does the same through
``placement_group_bundles``). ``RayWorkerLauncher`` starts one ``TensorParallelWorker`` per
other bundle, each asking for exactly its bundle's resources, so the ranks share a node
and gloo/NCCL talk over the node's own address (``ray.util.get_node_ip_address``).

Each actor runs ``worker.parallel.workers.run_worker`` as one long call; that call's
``ObjectRef`` resolving (the loop returned, raised, or the actor died) is how the launcher
knows a rank has ended, without a ping the busy worker could not answer. The actors are
owned by the replica, so Ray ends them when the replica's actor dies; ``stop`` kills them
explicitly on a normal shutdown. Actor names carry the replica id (unique per replica):
``prefixserve-tp-<replica id>-rank<r>``.
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from worker.parallel.workers import WorkerSpec, run_worker

log = logging.getLogger("ray.serve")

WORKER_NAME_PREFIX = "prefixserve-tp-"


@ray.remote(max_restarts=0)
class TensorParallelWorker:
    """One rank's shard; ``run`` returns when rank 0 says stop or its connection closes."""

    def run(self, spec: WorkerSpec, rank: int) -> None:
        logging.basicConfig(level=logging.INFO)
        run_worker(spec, rank, local=False)


def worker_name(replica_id: str, rank: int) -> str:
    return f"{WORKER_NAME_PREFIX}{replica_id}-rank{rank}"


class RayWorkerLauncher:
    """``worker.parallel.workers.WorkerLauncher`` over Ray actors in the current placement group."""

    def __init__(self) -> None:
        self._placement_group = get_current_placement_group()
        self._actors: dict[int, ray.actor.ActorHandle] = {}
        self._runs: dict[int, ray.ObjectRef] = {}

    def host(self) -> str:
        return ray.util.get_node_ip_address()

    def start(self, spec: WorkerSpec) -> None:
        group = self._placement_group
        if group is None:
            raise ValueError(
                f"tensor_parallel_size={spec.world_size} needs the replica to run in a "
                "placement group "
                "of that many bundles (placement_group_bundles in the deployment's options)"
            )
        bundles = group.bundle_specs
        if len(bundles) < spec.world_size:
            raise ValueError(
                f"tensor_parallel_size={spec.world_size} needs {spec.world_size} "
                "placement-group bundles; "
                f"the replica's group has {len(bundles)}"
            )
        for rank in range(1, spec.world_size):
            bundle = bundles[rank]
            actor = TensorParallelWorker.options(
                name=worker_name(spec.replica_id, rank),
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
            ).remote()
            self._actors[rank] = actor
            self._runs[rank] = actor.run.remote(spec, rank)

    def dead_ranks(self) -> list[int]:
        if not self._runs:
            return []
        ended, _ = ray.wait(
            list(self._runs.values()), num_returns=len(self._runs), timeout=0, fetch_local=False
        )
        ended_set = set(ended)
        return [rank for rank, ref in self._runs.items() if ref in ended_set]

    def stop(self, timeout_s: float) -> None:
        if self._runs:
            ray.wait(
                list(self._runs.values()),
                num_returns=len(self._runs),
                timeout=timeout_s,
                fetch_local=False,
            )
        for actor in self._actors.values():
            ray.kill(actor, no_restart=True)
