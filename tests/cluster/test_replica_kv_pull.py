"""``EngineReplica.pull_prefix``/``export_prefix``, without Ray: two replica objects
over real engines (each in a thread of this process), the peer reached through a stand-in for
a Ray handle (``export_prefix.remote(...)`` is awaitable, as a ``DeploymentResponse`` or an
``ObjectRef`` is). The payload is pickled on the way, as Ray would."""

from __future__ import annotations

import asyncio
import pickle
import random

from router.protocol import hash_blocks
from tests.cluster.helpers import PARAMS, PeerHandle, Remote, replica
from worker.config import EngineConfig


class GonePeer:
    def __init__(self):
        async def fail(*args):
            raise ConnectionError("peer replica is gone")

        self.export_prefix = Remote(fail)


def test_a_replica_pulls_a_prefix_from_its_peer(tiny_models, test_seed):
    prompt = [random.Random(test_seed).randrange(5, 40000) for _ in range(100)]
    config = EngineConfig(model=tiny_models["llama"], num_kv_blocks=64)
    a, b = replica(config, "a"), replica(config, "b")

    async def last(r, rid):
        """(cached tokens, token ids, logprobs) of the streamed messages, which carry deltas."""
        messages = [m async for m in r.generate(rid, prompt, PARAMS)]
        choices = [c for m in messages for c in m.choices]
        return (
            messages[-1].num_cached_tokens,
            [t for c in choices for t in c.new_token_ids],
            [lp for c in choices for lp in c.new_logprobs or ()],
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


def test_a_peer_on_the_same_node_gets_the_kv_through_shared_memory(
    tiny_models, test_seed, tmp_path, monkeypatch
):
    """Same Ray node: the reply carries a ``SharedKV`` name, not the bytes, and the importer
    removes the file. Another node (or an unknown one) gets the bytes."""
    import cluster.replica as replica_module
    from worker.kv_transfer import SHARED_KV_PREFIX, SharedKV

    monkeypatch.setattr(replica_module, "default_shared_dir", lambda: str(tmp_path))
    prompt = [random.Random(test_seed).randrange(5, 40000) for _ in range(100)]
    config = EngineConfig(model=tiny_models["llama"], num_kv_blocks=64)
    a, b, c = (replica(config, name) for name in "abc")
    a.node_id = b.node_id = "node-1"
    c.node_id = "node-2"
    replies: list = []

    class Recording(PeerHandle):
        def __init__(self, replica_):
            super().__init__(replica_)
            inner = self.export_prefix

            class Remote:
                async def remote(self, *args):
                    reply = await inner.remote(*args)
                    replies.append(reply)
                    return reply

            self.export_prefix = Remote()

    async def main():
        [m async for m in a.generate("a0", prompt, PARAMS)]
        hashes = hash_blocks(prompt, 16, a.engine.model_id, None)
        for puller in (b, c):
            pulled = await puller.pull_prefix(Recording(a), hashes, prompt)
            assert (pulled["imported_blocks"], pulled["error"]) == (6, None)
            assert pulled["payload_bytes"] == 96 * 2 * 2 * 2 * 32 * 4
        same_node, other_node = replies
        assert isinstance(same_node.kv, SharedKV) and not isinstance(other_node.kv, SharedKV)
        assert len(pickle.dumps(same_node)) < 8192, "the reply is the name, not 49 KB of K/V"
        assert not list(tmp_path.glob(f"{SHARED_KV_PREFIX}*")), "the importer removed the file"
        outputs = []
        for r in (b, c):
            messages = [m async for m in r.generate(f"{r.replica_id}1", prompt, PARAMS)]
            assert messages[-1].num_cached_tokens == 96
            outputs.append([t for m in messages for o in m.choices for t in o.new_token_ids])
        assert outputs[0] == outputs[1]
        for r in (a, b, c):
            await r.engine.shutdown(1.0)

    asyncio.run(main())
