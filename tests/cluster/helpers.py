"""Helpers of the cluster tests that run without Ray: replica objects over real engines, a
stand-in for a peer replica's handle, the request router as Serve builds it, and what Serve
hands that router (a pending call, a running replica)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest

from cluster.inflight_board import InflightBoard, LocalBoardClient
from cluster.kv_pull import SimulatedLink
from cluster.metrics_snapshots import ReplicaMetrics
from cluster.replica import EngineReplica
from cluster.request_router import PrefixAwareRequestRouter
from cluster.router_context import RouterContext
from router.config import RouterConfig
from router.index import PrefixIndex
from router.load import LoadTracker
from router.routing import Router
from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.outputs import ChoiceDelta, FinishReason, OutputDelta
from worker.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def delta(
    index: int = 0,
    new_text: str = "",
    new_ids: list[int] | None = None,
    finish: str | None = None,
    text: str | None = None,
    logprobs: list | None = None,
    cached: int = 0,
    *,
    seq: int = 0,
    request_id: str = "x",
    num_prompt_tokens: int = 5,
) -> OutputDelta:
    """A replica output of one choice, as ``EngineReplica.generate`` streams it; ``finish``
    ends the choice and the request."""
    choice = ChoiceDelta(
        index,
        list(new_ids or []),
        new_text,
        logprobs,
        None if finish is None else FinishReason(finish),
        None,
        text,
    )
    return OutputDelta(
        request_id,
        num_prompt_tokens,
        cached,
        [choice],
        finished=finish is not None,
        seq=seq,
        replica_id="r0",
    )


class Remote:
    def __init__(self, fn):
        self._fn = fn

    async def remote(self, *args):
        return pickle.loads(pickle.dumps(await self._fn(*args)))


class PeerHandle:
    """What ``pull_prefix`` needs of a handle: ``export_prefix.remote(...)``, awaitable."""

    def __init__(self, replica):
        self.export_prefix = Remote(replica.export_prefix)


def replica(config: EngineConfig, replica_id: str):
    self = object.__new__(EngineReplica.func_or_class)
    self.engine = AsyncEngine(config, replica_id, spawn=False)
    self._kv_link = SimulatedLink.for_engine(config)
    self.replica_id, self.metrics, self._in_flight, self.stream_interval = (
        replica_id,
        ReplicaMetrics(),
        set(),
        1,
    )
    return self


def running(unique_id: str, **stats) -> SimpleNamespace:
    """What the request router reads of a Serve ``RunningReplica``."""
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id), routing_stats=stats)


def pending(request_id: str, prompt: list[int], hashes: list[bytes]) -> PendingRequest:
    """The ingress's ``generate.remote(...)`` call as Serve hands it to the router."""
    return PendingRequest(
        args=[request_id, prompt, PARAMS],
        kwargs={"cache_salt": None, "block_hashes": hashes},
        metadata=RequestMetadata(request_id=request_id, internal_request_id=request_id),
    )


def request_router(
    router_config: dict,
    index: PrefixIndex,
    model_id: str = "",
    load: LoadTracker | None = None,
    board: InflightBoard | None = None,
    board_client=None,
) -> PrefixAwareRequestRouter:
    """``PrefixAwareRequestRouter`` constructed and initialized as Serve does, over ``index``
    (speculative entries written at once, so a test sees them), with a tracker of its own
    (``load``, or a fresh one) and, with ``board``, a client of that in-flight board (or
    ``board_client`` itself)."""
    request_router_ = PrefixAwareRequestRouter(
        deployment_id=DeploymentID(name="EngineReplica", app_name="test-app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
    )
    load = load if load is not None else LoadTracker()
    config = RouterConfig(**router_config)
    request_router_.initialize_state(
        router_config,
        context=RouterContext(load, model_id or None),
        router=Router(config, model_id, index=index, speculate_in_background=False),
        board=board_client
        if board is None
        else LocalBoardClient(board, load.snapshot, load.tracker_id),
    )
    return request_router_
