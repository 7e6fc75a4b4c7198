"""``EngineReplica.pull_prefix``/``export_prefix``, without Ray: two replica objects
over real engines (each in a thread of this process), the peer reached through a stand-in for
a Ray handle (``export_prefix.remote(...)`` is awaitable, as a ``DeploymentResponse`` or an
``ObjectRef`` is). The payload is pickled on the way, as Ray would."""

from __future__ import annotations

import asyncio
import pickle
import random
import subprocess
import sys

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
        assert same_node.kv_bytes == 96 * 2 * 2 * 2 * 32 * 4
        check = (
            "import pickle, sys; payload = pickle.loads(sys.stdin.buffer.read()); "
            f"assert payload.kv_bytes == {same_node.kv_bytes}, payload.kv_bytes; "
            "assert 'torch' not in sys.modules, 'a replica passing the name imported torch'"
        )
        passed_on = subprocess.run(
            [sys.executable, "-c", check], input=pickle.dumps(same_node), capture_output=True
        )
        assert passed_on.returncode == 0, passed_on.stderr.decode()[-400:]
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


def test_the_simulated_link_takes_transfers_one_at_a_time():
    from cluster.kv_pull import SimulatedLink

    link = SimulatedLink(lambda num_tokens: num_tokens / 1000.0)

    async def main():
        loop = asyncio.get_running_loop()
        start_s = loop.time()
        waits = await asyncio.gather(link.carry(100), link.carry(50))
        return waits, loop.time() - start_s

    (first_s, second_s), took_s = asyncio.run(main())
    assert abs(first_s - 0.1) < 0.01 and abs(second_s - 0.15) < 0.01, "the second waits its turn"
    assert 0.14 < took_s < 0.5


def test_a_simulated_engine_pull_waits_the_profiles_transfer_time(tiny_models, tmp_path):
    """The simulated engine's payload is a few bytes; the pulling replica waits what the
    profile's ``kv_transfer_bytes_per_s`` makes of the real KV (96 tokens: 0.3 s here), and
    the request after it is a local hit."""
    import dataclasses
    import json
    import time

    from worker.sim_model import load_profile

    profile = dataclasses.asdict(load_profile("cpu"))
    profile.pop("name")
    profile["kv_transfer_bytes_per_s"] = 96 * profile["kv_bytes_per_token"] / 0.3
    path = tmp_path / "slow_network.json"
    path.write_text(json.dumps(profile))
    prompt = list(range(1000, 1100))
    config = EngineConfig(
        model=tiny_models["llama"], engine="sim", sim_profile=str(path), num_kv_blocks=64
    )
    a, b = replica(config, "a"), replica(config, "b")

    async def main():
        [m async for m in a.generate("a0", prompt, PARAMS)]
        hashes = hash_blocks(prompt, 16, a.engine.model_id, None)
        start_s = time.monotonic()
        pulled = await b.pull_prefix(PeerHandle(a), hashes, prompt)
        took_s = time.monotonic() - start_s
        assert (pulled["imported_blocks"], pulled["pulled_tokens"], pulled["error"]) == (
            6,
            96,
            None,
        )
        assert took_s >= 0.3 and pulled["export_s"] >= 0.3
        messages = [m async for m in b.generate("b0", prompt, PARAMS)]
        assert messages[-1].num_cached_tokens == 96
        for r in (a, b):
            await r.engine.shutdown(1.0)

    asyncio.run(main())
