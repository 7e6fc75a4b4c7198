"""LoRA adapters in the cluster, without Ray: the ingress's catalog of adapter names, the
load/unload fan-out and its status codes, a replica's sync with the runtime record, and
replica objects over real tiny engines (adapter requests, runtime load/unload answers, a KV
pull of an adapter's prefix, the ``lora_requests_info`` labels). The Serve path end to end is
``tests/cluster/tiny/test_lora_http.py``."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.engine_client import EngineClient
from cluster.errors import APIError
from cluster.lora_adapters import (
    CATALOG_TTL_S,
    AdapterCatalog,
    ReplicaAdapterSync,
    call_every_replica,
    desired_adapters,
    first_refusal,
    load_everywhere,
    refusal_error,
    replica_result,
    unanswered_note,
    unload_everywhere,
)
from cluster.metrics_render import render_prometheus
from router.protocol import adapter_namespace, hash_blocks
from tests.cluster.helpers import PARAMS, PeerHandle, replica
from worker.config import EngineConfig
from worker.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory) -> dict[str, str]:
    """A tiny llama and two adapters of it (``sql`` and ``chat``, different weights)."""
    from worker.testing import make_tiny_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "base", "llama", seed=3)
    return {
        "model": model,
        "sql": make_tiny_adapter(model, root / "sql", rank=8, seed=1),
        "chat": make_tiny_adapter(model, root / "chat", rank=4, seed=2),
        "root": str(root),
    }


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_desired_adapters_apply_runtime_changes_to_the_modules():
    modules = (("a", "/a"), ("b", "/b"))
    assert desired_adapters(modules, {}) == {"a": "/a", "b": "/b"}
    assert desired_adapters(modules, {"b": None, "c": "/c", "a": "/a2"}) == {"a": "/a2", "c": "/c"}


def test_the_catalog_finds_an_adapter_loaded_elsewhere_and_misses_share_one_read():
    record = {"epoch": "e", "version": 0, "adapters": {}}
    reads = []
    clock = _Clock()
    release = asyncio.Event()

    async def read():
        reads.append(clock.now_s)
        await release.wait()
        return record

    async def main():
        catalog = AdapterCatalog((("sql", "/sql"),), read, enabled=True, clock=clock)
        release.set()
        assert await catalog.lookup("sql") == "/sql"
        await asyncio.sleep(0)  # a never-read copy refreshes in the background
        assert len(reads) == 1
        record["adapters"] = {"new": "/new"}  # another ingress loaded one
        assert await catalog.lookup("new") == "/new"  # a miss re-reads the record
        assert len(reads) == 2
        release.clear()  # a flood of unknown names while a read is in flight: that one read
        misses = [asyncio.ensure_future(catalog.lookup("nope")) for _ in range(5)]
        await asyncio.sleep(0)
        release.set()
        assert await asyncio.gather(*misses) == [None] * 5
        assert len(reads) == 3
        record["adapters"] = {"new": "/new", "sql": None}  # and unloaded one
        assert await catalog.lookup("sql") == "/sql"  # a fresh copy answers without a read
        assert len(reads) == 3
        clock.now_s += CATALOG_TTL_S
        assert await catalog.lookup("sql") == "/sql"  # the stale copy still answers...
        await asyncio.sleep(0)
        assert len(reads) == 4 and "sql" not in catalog.adapters  # ...and is refreshed

        off = AdapterCatalog((), read, enabled=False, clock=clock)
        assert await off.lookup("new") is None and len(reads) == 4

        async def unreachable():
            raise TimeoutError("index actor")

        kept = AdapterCatalog((("sql", "/sql"),), unreachable, enabled=True, clock=clock)
        await kept.refresh()
        assert kept.adapters == {"sql": "/sql"}  # the last copy serves

    asyncio.run(main())


class _Replica:
    def __init__(self, answer):
        self.answer = answer
        self.calls = []

        outer = self

        class _Method:
            def __init__(self, name):
                self.name = name

            async def remote(self, *args):
                outer.calls.append((self.name, args))
                if isinstance(outer.answer, Exception):
                    raise outer.answer
                return outer.answer

        self.load_lora_adapter = _Method("load")
        self.unload_lora_adapter = _Method("unload")


def test_fan_out_reports_each_replica_and_picks_the_refusal_the_client_can_act_on():
    replicas = {
        "r1": _Replica(replica_result("r1")),
        "r2": _Replica(replica_result("r2", 409, "adapter 'a' has 1 request(s) in flight")),
        "r3": _Replica(ConnectionError("gone")),
        "r4": _Replica(replica_result("r4", 409, "adapter 'a' has 2 request(s) in flight")),
    }
    results = asyncio.run(
        call_every_replica(
            {rid: (lambda r=r: r) for rid, r in replicas.items()}, "unload_lora_adapter", "a"
        )
    )
    assert results["r1"]["status"] == 200 and results["r3"]["status"] == 503
    assert "gone" in results["r3"]["message"]
    assert all(r.calls == [("unload", ("a",))] for r in replicas.values())
    refusal = first_refusal(results)
    assert refusal["replica_id"] == "r2"
    error = refusal_error(refusal, results, "unloading LoRA adapter 'a'", "lora_name")
    assert error.status == 409 and error.code == "lora_adapter_in_use"
    assert "replica r2 (and 1 more)" in error.message and "in flight" in error.message
    assert "r3" in unanswered_note(results)

    bad = {"r1": replica_result("r1", 400, "LoRA adapter /x: no adapter_config.json")}
    error = refusal_error(first_refusal(bad), bad, "loading LoRA adapter 'a'", "lora_path")
    assert (error.status, error.param) == (400, "lora_path")
    assert error.body()["error"]["message"].endswith("no adapter_config.json")
    gone = {"r1": replica_result("r1", 404, "no LoRA adapter named 'a'")}
    assert first_refusal(gone, ignore=(404,)) is None
    assert refusal_error(first_refusal(gone), gone, "unloading", "lora_name").status == 404
    assert first_refusal({"r3": results["r3"]}) is None  # no answer is not a refusal


class _Record:
    """The index actor's record, in memory (``AdapterRecord``'s read and write)."""

    def __init__(self) -> None:
        self.state = {"epoch": "e", "version": 0, "adapters": {}}
        self.down = False

    async def read(self) -> dict:
        return self.state

    async def write(self, name, path) -> dict:
        if self.down:
            raise TimeoutError("index actor")
        adapters = {**self.state["adapters"], name: path}
        self.state = {"epoch": "e", "version": self.state["version"] + 1, "adapters": adapters}
        return self.state


def test_load_and_unload_are_all_or_nothing_over_the_replicas():
    record = _Record()
    catalog = AdapterCatalog((("sql", "/sql"),), record.read, enabled=True)
    ok = {rid: _Replica(replica_result(rid)) for rid in ("r1", "r2")}
    fleet = dict(ok)

    async def replicas():
        return {rid: (lambda r=r: r) for rid, r in fleet.items()}

    async def load(name, path="/new"):
        return await load_everywhere(catalog, record, replicas, name, path, {"base"})

    async def unload(name):
        return await unload_everywhere(catalog, record, replicas, name)

    async def status(call) -> int:
        try:
            await call
        except APIError as exc:
            return exc.status
        return 200

    async def main():
        assert "added successfully" in await load("new")
        assert catalog.adapters == {"sql": "/sql", "new": "/new"}
        assert record.state["adapters"] == {"new": "/new"}
        assert all(r.calls == [("load", ("new", "/new"))] for r in ok.values())
        assert await status(load("new")) == 400  # already served
        assert await status(load("base")) == 400  # the base model's name
        assert await status(load(" ")) == 400

        fleet["r3"] = _Replica(replica_result("r3", 400, "LoRA adapter /bad: no adapter_config"))
        with pytest.raises(APIError) as info:
            await load("bad", "/bad")
        assert info.value.status == 400 and "replica r3" in info.value.message
        assert all(r.calls[-1] == ("unload", ("bad",)) for r in ok.values())  # undone
        assert "bad" not in catalog.adapters and "bad" not in record.state["adapters"]

        fleet["r3"] = _Replica(replica_result("r3", 409, "1 request(s) in flight"))
        assert await status(unload("sql")) == 409
        assert all(r.calls[-1] == ("load", ("sql", "/sql")) for r in ok.values())  # reloaded
        assert "sql" in catalog.adapters
        fleet["r3"] = _Replica(replica_result("r3", 404, "no LoRA adapter named 'sql'"))
        assert "removed successfully" in await unload("sql")  # gone there already is fine
        assert "sql" not in catalog.adapters and record.state["adapters"]["sql"] is None
        assert await status(unload("sql")) == 404

        fleet["r3"] = _Replica(ConnectionError("gone"))
        assert "r3" in await load("late")  # a replica that does not answer: its sync catches up
        record.down = True
        assert await status(load("unrecorded")) == 503
        fleet.clear()
        fleet["r3"] = _Replica(ConnectionError("gone"))
        record.down = False
        assert await status(load("nobody")) == 503

    asyncio.run(main())


def test_a_replica_sync_loads_the_record_and_unloads_only_what_it_unloads():
    engine = {"sql": "/sql", "pending": "/pending"}  # "pending": a load not recorded yet
    busy = {"old"}
    record = {"epoch": "e", "version": 1, "adapters": {"new": "/new", "gone": None}}
    reads = []

    async def read():
        reads.append(1)
        return record

    async def adapters():
        return dict(engine)

    async def load(name, path):
        if path == "/bad":
            raise ValueError(f"LoRA adapter {path}: no adapter_config.json")
        engine[name] = path

    async def unload(name):
        if name in busy:
            raise ValueError(f"LoRA adapter {name!r} has 1 request(s) in flight; retry later")
        del engine[name]

    async def main():
        sync = ReplicaAdapterSync("r", (("sql", "/sql"), ("gone", "/gone")), read, adapters,
                                  load, unload)  # fmt: skip
        assert await sync.sync()
        assert engine == {"sql": "/sql", "pending": "/pending", "new": "/new"}
        assert await sync.sync() and engine["new"] == "/new"  # same version: nothing to do
        engine["old"] = "/old"
        record.update(version=2, adapters={**record["adapters"], "old": None, "x": "/bad"})
        assert not await sync.sync()  # "old" is in use: retried next time
        busy.clear()
        assert await sync.sync()  # the bad folder is logged once, not retried
        assert "old" not in engine and "x" not in engine

        async def unreachable():
            raise TimeoutError("index actor")

        cut_off = ReplicaAdapterSync("r", (), unreachable, adapters, load, unload)
        assert not await cut_off.sync()

    asyncio.run(main())


def test_an_adapter_request_hashes_in_the_adapters_namespace_and_names_it_to_the_replica():
    seen = {}

    class _Call:
        """A handle stream of one output."""

        def __init__(self):
            self.sent = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            from tests.cluster.helpers import delta

            if self.sent:
                raise StopAsyncIteration
            self.sent = True
            return delta(new_ids=[7], request_id="r")

        def cancel(self):
            pass

    class _Method:
        def remote(self, request_id, prompt_ids, params, **kwargs):
            seen.update(kwargs)
            return _Call()

    class _Handle:
        generate = _Method()

    client = EngineClient(_Handle(), block_size=4, cache_namespace="m")
    prompt = list(range(10))
    asyncio.run(client._open("r", prompt, SamplingParams(max_tokens=3), "salt", lora_name="sql"))
    assert seen["lora_name"] == "sql"
    assert seen["block_hashes"] == hash_blocks(prompt, 4, adapter_namespace("m", "sql"), "salt")
    assert seen["block_hashes"] != hash_blocks(prompt, 4, "m", "salt")
    asyncio.run(client._open("r", prompt, SamplingParams(max_tokens=3), "salt"))
    assert seen["lora_name"] is None
    assert seen["block_hashes"] == hash_blocks(prompt, 4, "m", "salt")


def _tokens(messages) -> list[int]:
    return [t for m in messages for c in m.choices for t in c.new_token_ids]


def test_replicas_run_adapters_answer_runtime_changes_and_pull_an_adapters_kv(
    lora_model, test_seed
):
    from worker.llm import LLM

    prompt = [random.Random(test_seed).randrange(5, 900) for _ in range(40)]
    config = EngineConfig(
        model=lora_model["model"], num_kv_blocks=64, lora_modules={"sql": lora_model["sql"]}
    )
    llm = LLM(lora_model["model"], lora_modules={"sql": lora_model["sql"]})
    on_adapter = llm.generate([prompt], PARAMS, lora_name="sql")[0].outputs[0]
    on_base = llm.generate([prompt], PARAMS)[0].outputs[0]
    offline, offline_base = on_adapter.token_ids, on_base.token_ids
    # The adapter changes the model: its logprobs always, its greedy tokens for most prompts
    # (the tiny model may fall into the same loop either way).
    assert [p.logprob for p in on_adapter.logprobs] != [p.logprob for p in on_base.logprobs]
    a, b = replica(config, "a"), replica(config, "b")
    a.model_name = b.model_name = "base"

    async def main():
        on_sql = _tokens([m async for m in a.generate("a0", prompt, PARAMS, lora_name="sql")])
        assert on_sql == list(offline)
        assert _tokens([m async for m in a.generate("a1", prompt, PARAMS)]) == list(offline_base)
        (unknown,) = [m async for m in a.generate("a2", prompt, PARAMS, lora_name="nope")]
        assert unknown.kind.name == "UNKNOWN_MODEL" and unknown.api_error().status == 404

        # Runtime changes: the replica answers with a status, never raises.
        assert (await a.load_lora_adapter("chat", lora_model["chat"]))["status"] == 200
        bad = await a.load_lora_adapter("bad", lora_model["root"])
        assert bad["status"] == 400 and "adapter_config.json" in bad["message"]
        assert (await a.unload_lora_adapter("nope"))["status"] == 404
        stream = a.generate("a3", prompt, SamplingParams(max_tokens=50, ignore_eos=True),
                            lora_name="chat")  # fmt: skip
        await stream.__anext__()  # running on "chat"
        busy = await a.unload_lora_adapter("chat")
        assert busy["status"] == 409 and "in flight" in busy["message"]

        snapshot = a.metrics_snapshot()
        info = snapshot["info"]["lora_requests_info"]
        assert info == {
            "running_lora_adapters": "chat",
            "waiting_lora_adapters": "",
            "max_lora": "8",
        }
        text = render_prometheus({"a": snapshot}, None, prefix="vllm:").decode()
        assert 'running_lora_adapters="chat"' in text and "vllm:lora_requests_info{" in text
        await stream.aclose()
        assert (await a.unload_lora_adapter("chat"))["status"] == 200
        assert await a.engine.lora_adapters() == {"sql": lora_model["sql"]}

        # The adapter's KV travels under its namespace: b pulls a's blocks and hits them.
        hashes = hash_blocks(prompt, 16, adapter_namespace(a.engine.cache_namespace, "sql"), None)
        pulled = await b.pull_prefix(PeerHandle(a), hashes, prompt, lora_name="sql")
        assert pulled["imported_blocks"] == 2 and pulled["error"] is None
        messages = [m async for m in b.generate("b0", prompt, PARAMS, lora_name="sql")]
        assert messages[-1].num_cached_tokens == 32 and _tokens(messages) == list(offline)
        for r in (a, b):
            await r.engine.shutdown(1.0)

    asyncio.run(main())
