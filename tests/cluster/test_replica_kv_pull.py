"""``EngineReplica.pull_prefix``/``export_prefix`` (issue 19), without Ray: two replica objects
over real engines (each in a thread of this process), the peer reached through a stand-in for
a Ray handle (``export_prefix.remote(...)`` is awaitable, as a ``DeploymentResponse`` or an
``ObjectRef`` is). The payload is pickled on the way, as Ray would."""

from __future__ import annotations

import asyncio
import pickle
import random

from cluster.metrics import ReplicaMetrics
from cluster.replica import EngineReplica
from router.protocol import hash_blocks
from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


class Remote:
    def __init__(self, fn):
        self._fn = fn

    async def remote(self, *args):
        return pickle.loads(pickle.dumps(await self._fn(*args)))


class PeerHandle:
    """What ``pull_prefix`` needs of a handle: ``export_prefix.remote(...)``, awaitable."""

    def __init__(self, replica):
        self.export_prefix = Remote(replica.export_prefix)


class GonePeer:
    def __init__(self):
        async def fail(*args):
            raise ConnectionError("peer replica is gone")

        self.export_prefix = Remote(fail)


def replica(config: EngineConfig, replica_id: str):
    self = object.__new__(EngineReplica.func_or_class)
    self.engine = AsyncEngine(config, replica_id, spawn=False)
    self.replica_id, self.metrics, self._in_flight, self.stream_interval = (
        replica_id,
        ReplicaMetrics(),
        set(),
        1,
    )
    return self


def test_a_replica_pulls_a_prefix_from_its_peer(tiny_models, test_seed):
    prompt = [random.Random(test_seed).randrange(5, 40000) for _ in range(100)]
    config = EngineConfig(model=tiny_models["llama"], num_kv_blocks=64)
    a, b = replica(config, "a"), replica(config, "b")

    async def last(r, rid):
        """(cached tokens, token ids, logprobs) of the streamed messages, which carry deltas."""
        messages = [m async for m in r.generate(rid, prompt, PARAMS)]
        choices = [c for m in messages for c in m["outputs"]]
        return (
            messages[-1]["num_cached_tokens"],
            [t for c in choices for t in c["new_token_ids"]],
            [lp for c in choices for lp in c["logprobs"] or ()],
        )

    async def main():
        first = await last(a, "a0")
        hashes = hash_blocks(prompt, 16, a.engine.model_id, None)
        gone = await b.pull_prefix(GonePeer(), hashes, prompt)
        assert gone["imported_blocks"] == 0 and "peer replica is gone" in gone["error"]
        nothing = await b.pull_prefix(PeerHandle(a), hashes, [t + 1 for t in prompt])
        assert nothing["imported_blocks"] == 0 and nothing["error"] is None
        pulled = await b.pull_prefix(PeerHandle(a), hashes, prompt)
        assert (
            pulled["imported_blocks"] == 6
            and pulled["pulled_tokens"] == 96
            and pulled["error"] is None
        )
        assert (
            pulled["payload_bytes"] == 96 * 2 * 2 * 2 * 32 * 4
        )  # tokens x K/V x layers x kv heads x head_dim x fp32
        second = await last(b, "b0")
        assert second[0] == 96 and first[0] == 0
        assert second[1:] == first[1:] and len(first[1]) == 6, "tokens and logprobs bitwise equal"
        for r in (a, b):
            await r.engine.shutdown(1.0)

    asyncio.run(main())
