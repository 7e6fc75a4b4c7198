"""KV pulls in the live request path, without Ray: the request router decides, the
order travels in the call's keywords, the chosen replica pulls and runs the request as a hit.

Three replicas over real tiny engines (threads of this process, as in
``test_replica_kv_pull.py``); the request router is ``PrefixAwareRequestRouter`` itself,
driven with Serve's own ``PendingRequest`` and stand-ins for ``RunningReplica``; the prefix
index is an ``EmbeddedIndex`` fed by the holder's real ``ReplicaKVPublisher``. The peer handle
stands in for ``serve_compat.peer_replica`` (checked live in ``test_kv_pull_serve.py``).
"""

from __future__ import annotations

import asyncio
import random

from ray.serve.request_router import PendingRequest

from cluster.kv_publisher import ReplicaKVPublisher
from cluster.kv_pull import ReplicaKVPuller
from cluster.request_router import PrefixAwareRequestRouter
from router.embedded_index import EmbeddedIndex
from router.protocol import hash_blocks
from tests.cluster.helpers import PARAMS, PeerHandle, pending, replica, request_router, running
from worker.config import EngineConfig
from worker.outputs import OutputDelta

BLOCK_SIZE = 16
NUM_PROMPT_TOKENS = 100  # 6 full blocks (96 tokens) and 4 more
# The holder looks busy (5 s of queued prefill), so the router prefers an idle replica that
# pulls the prefix (96 tokens at this rate: 13 ms) over waiting for it.
BUSY = {"num_running": 4, "num_queued_prefill_tokens": 5000, "prefill_tokens_per_s": 1000.0}
PULL_RATE = 7237.0  # bench/kv_pull.py on this CPU


class CountingPeer(PeerHandle):
    def __init__(self, replica_, calls: list):
        super().__init__(replica_)
        inner = self.export_prefix

        class Counted:
            async def remote(self, *args):
                calls.append(args)
                return await inner.remote(*args)

        self.export_prefix = Counted()


class HangingPeer:
    def __init__(self):
        class Hang:
            async def remote(self, *args):
                await asyncio.sleep(30)

        self.export_prefix = Hang()


def with_puller(r, peers: dict, timeout_s: float = 5.0):
    """``r`` with the puller ``EngineReplica.__init__`` makes; peers resolved from ``peers``
    (a missing one raises, as ``ray.get_actor`` does for a replica that is gone)."""

    def resolve(peer_id):
        if peer_id not in peers:
            raise ValueError(f"Failed to look up actor with name {peer_id!r}")
        return peers[peer_id]

    r.kv_puller = ReplicaKVPuller(
        r.replica_id, BLOCK_SIZE, r.pull_prefix, resolve, r.metrics, timeout_s
    )
    return r


def pulling_router(model_id: str, index: EmbeddedIndex) -> PrefixAwareRequestRouter:
    config = {"kv_pull_tokens_per_s": PULL_RATE, "block_size": BLOCK_SIZE}
    return request_router(config, index, model_id)


async def run(r, pending_request: PendingRequest) -> tuple[int, list[int], list]:
    """(cached tokens, token ids, logprobs) of one call, made as Serve would make it."""
    messages = [m async for m in r.generate(*pending_request.args, **pending_request.kwargs)]
    assert all(isinstance(m, OutputDelta) for m in messages), messages
    choices = [c for m in messages for c in m.choices]
    return (
        messages[-1].num_cached_tokens,
        [t for c in choices for t in c.new_token_ids],
        [lp for c in choices for lp in c.new_logprobs or ()],
    )


def test_routed_to_a_replica_without_the_prefix_it_pulls_once_and_answers_as_a_hit(
    tiny_models, test_seed
):
    rng = random.Random(test_seed)
    prompt = [rng.randrange(5, 40000) for _ in range(NUM_PROMPT_TOKENS)]
    config = EngineConfig(model=tiny_models["llama"], num_kv_blocks=64)
    a, b, c = (replica(config, name) for name in "abc")
    exports: list = []
    with_puller(a, {})
    with_puller(b, {"a": CountingPeer(a, exports)})
    with_puller(c, {"hangs": HangingPeer()}, timeout_s=0.5)
    hashes = hash_blocks(prompt, BLOCK_SIZE, a.engine.model_id, None)
    index = EmbeddedIndex()
    publisher = ReplicaKVPublisher(a.engine.drain_kv_events, index, "a", 10.0, 1.0)
    index.heartbeat("b", 0)
    router = pulling_router(a.engine.model_id, index)
    candidates = [running("a", **BUSY), running("b")]

    async def main():
        # The reference: "a" computes the prefix itself (a cold run), then holds it.
        cold = await run(a, pending("a0", prompt, hashes))
        assert cold[0] == 0 and len(cold[1]) == PARAMS.max_tokens
        await asyncio.sleep(0.1)  # the engine's stored events
        publisher.drain_once()
        publisher.publisher.run_once()

        # Two requests for the prefix, routed one after the other, run at once on "b".
        first, second = pending("b0", prompt, hashes), pending("b1", prompt, hashes)
        ranks = await router.choose_replicas(candidates, first)
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b"], ["a"]]
        assert first.kwargs["kv_pull"] == {"replica_id": "b", "peer_id": "a", "num_blocks": 6}
        ranks = await router.choose_replicas(candidates, second)
        assert ranks[0][0].replica_id.unique_id == "b"
        assert "kv_pull" not in second.kwargs  # "b" holds it now, speculatively
        pulled = await asyncio.gather(run(b, first), run(b, second))
        assert len(exports) == 1, "one pull for both requests"
        for out in pulled:
            assert out[0] == 96, "pulled tokens are reported as cached"
            assert out[1:] == cold[1:], "token ids and logprobs bitwise equal to a computed prefix"
        assert b.metrics.counters == {
            "kv_pulls": 1,
            "kv_pull_failures": 0,
            "kv_pull_blocks": 6,
            "kv_pull_tokens": 96,
            "kv_pull_bytes": 96 * 2 * 2 * 2 * 32 * 4,
        }
        assert sum(b.metrics.histograms["kv_pull_seconds"].counts) == 1
        # The same order again (another ingress decided before the index learned of the
        # import): the pull just finished answers it, no second export.
        again = pending("b2", prompt, hashes)
        again.kwargs["kv_pull"] = first.kwargs["kv_pull"]
        assert (await run(b, again))[1:] == cold[1:] and len(exports) == 1

        # Failed pulls fall back to prefilling: a peer that is gone, one that never answers,
        # and an order meant for another replica (ignored).
        for rid, order in (
            ("c0", {"replica_id": "c", "peer_id": "gone", "num_blocks": 6}),
            ("c1", {"replica_id": "c", "peer_id": "hangs", "num_blocks": 6}),
            ("c2", {"replica_id": "b", "peer_id": "a", "num_blocks": 6}),
        ):
            call = pending(rid, prompt, hashes)
            call.kwargs["kv_pull"] = order
            cached, tokens, logprobs = await run(c, call)
            assert (tokens, logprobs) == cold[1:], f"{rid}: it still succeeds, same tokens"
            assert cached == (0 if rid == "c0" else 96)  # c0 computed it; then "c" holds it
        assert c.metrics.counters["kv_pulls"] == 2 and c.metrics.counters["kv_pull_failures"] == 2
        assert c.metrics.counters["kv_pull_blocks"] == 0
        for r in (a, b, c):
            await r.engine.shutdown(1.0)

    asyncio.run(main())


def test_a_request_waits_for_its_pulls_import_to_be_queued_not_answered(tiny_models, test_seed):
    """The engine takes commands in order: once the import is queued, a request added after it
    finds the blocks, so admission does not wait for the import's answer (a step later on a
    busy replica). Here the answer is held back until the request has finished."""
    rng = random.Random(test_seed)
    prompt = [rng.randrange(5, 40000) for _ in range(NUM_PROMPT_TOKENS)]
    config = EngineConfig(model=tiny_models["llama"], num_kv_blocks=64)
    a, b = replica(config, "a"), replica(config, "b")
    with_puller(a, {})
    with_puller(b, {"a": PeerHandle(a)})
    hashes = hash_blocks(prompt, BLOCK_SIZE, a.engine.model_id, None)

    async def main():
        cold = await run(a, pending("a0", prompt, hashes))
        answer_released = asyncio.Event()
        submit_import = b.engine.submit_import

        def answer_late(payload):
            queued = submit_import(payload)

            async def late():
                imported = await queued
                await answer_released.wait()
                return imported

            return asyncio.ensure_future(late())

        b.engine.submit_import = answer_late
        call = pending("b0", prompt, hashes)
        call.kwargs["kv_pull"] = {"replica_id": "b", "peer_id": "a", "num_blocks": 6}
        pulled = await asyncio.wait_for(run(b, call), 30)
        assert pulled == (96, *cold[1:]), "a hit on the pulled blocks, bitwise a cold run's output"
        assert b.metrics.counters["kv_pulls"] == 0, "the pull is counted when it finishes"
        answer_released.set()
        for _ in range(100):
            if b.metrics.counters.get("kv_pulls"):
                break
            await asyncio.sleep(0.05)
        assert (b.metrics.counters["kv_pulls"], b.metrics.counters["kv_pull_blocks"]) == (1, 6)
        for r in (a, b):
            await r.engine.shutdown(1.0)

    asyncio.run(main())


def test_kv_pull_flag_turns_pulls_on_at_the_given_rate():
    from cluster.cli import build_parser
    from cluster.cli_options import args_from_namespace
    from cluster.config import configs_from_args

    def router_config(*argv):
        namespace = build_parser().parse_args(["serve", "--model", "/m", *argv])
        return configs_from_args(args_from_namespace(namespace))[2]

    assert router_config().kv_pull_tokens_per_s is None  # off by default
    assert router_config("--kv-pull-tokens-per-s", "7237").kv_pull_tokens_per_s == 7237.0
