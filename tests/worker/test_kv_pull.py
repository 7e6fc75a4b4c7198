"""KV pulled from a peer (engine side): a prefix exported by one engine and imported
by another serves hits there, bitwise equal to a local hit and to a cold compute; payloads that
do not fit are refused before anything changes; a full pool imports what fits, never corrupts.

Tiny random-weight models, two or three engines in one process, no Ray.
"""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from router.protocol import EventKind, Tier, hash_blocks
from tests.worker.helpers import run as run_to_end
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kv_transfer import KV_LAYOUT, KVPayload, KVPayloadMismatchError
from worker.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def tiny(tiny_models, **kw) -> LLMEngine:
    base = dict(
        model=tiny_models["llama"], max_num_batched_tokens=256, num_kv_blocks=64, device="cpu"
    )  # float32: the byte counts below assume it
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def run(engine: LLMEngine, prompts: dict) -> dict:
    return run_to_end(engine, prompts, check_invariants=True)


def export(engine: LLMEngine, prompt: list[int], cache_salt: str | None = None) -> KVPayload | None:
    return engine.export_prefix(
        hash_blocks(prompt, engine.block_size, engine.model_id, cache_salt), prompt, cache_salt
    )


def same_output(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert [lp.logprob for lp in a.outputs[0].logprobs] == [
        lp.logprob for lp in b.outputs[0].logprobs
    ]


def prompt_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 40000) for _ in range(n)]


def test_pulled_prefix_is_bitwise_equal_to_local_hit_and_cold(tiny_models, test_seed):
    rng = random.Random(test_seed)
    prompt = prompt_of(rng, 100)  # 6 full blocks before the last token
    a, b = tiny(tiny_models), tiny(tiny_models)
    first = run(a, {"a0": (prompt, PARAMS)})["a0"]
    local_hit = run(a, {"a1": (prompt, PARAMS)})["a1"]
    assert local_hit.num_cached_tokens == 96
    a.drain_kv_events()
    payload = export(a, prompt)
    assert payload.num_blocks == 6 and payload.layout == KV_LAYOUT
    assert payload.kv.device.type == "cpu" and payload.kv_bytes == payload.kv.numel() * 4
    assert a.drain_kv_events() == [], "an export changes nothing in the exporter's cache"
    payload = pickle.loads(pickle.dumps(payload))  # what Ray's object store or an actor reply does
    assert b.import_prefix(payload) == 6
    b.pool.check_invariants()
    stored = [
        h
        for batch in b.drain_kv_events()
        for e in batch.events
        if e.kind == EventKind.STORED and e.tier == Tier.DEVICE
        for h in e.hashes
    ]
    assert stored == list(payload.block_hashes), "imported blocks are announced like computed ones"
    assert b.import_prefix(payload) == 0, "blocks held already are not copied again"
    pulled = run(b, {"b0": (prompt, PARAMS)})["b0"]
    assert pulled.num_cached_tokens == 96
    assert b.scheduler.counters.prefix_cache_hits_tokens == 96
    cold = run(tiny(tiny_models, enable_prefix_caching=False), {"c0": (prompt, PARAMS)})["c0"]
    for other in (local_hit, pulled, cold):
        same_output(other, first)
    longer = prompt + prompt_of(rng, 40)  # shares the pulled blocks, then goes on
    same_output(run(b, {"b1": (longer, PARAMS)})["b1"], run(a, {"a2": (longer, PARAMS)})["a2"])


def test_export_reads_both_tiers_and_stops_at_the_first_miss(tiny_models, test_seed):
    rng = random.Random(test_seed)
    prompt = prompt_of(rng, 100)
    per_block = (
        2 * 2 * 2 * 16 * 32 * 4
    )  # K/V x layers x kv heads x block x head_dim x fp32 (tiny llama)
    a = tiny(tiny_models, num_kv_blocks=12, host_kv_cache_bytes=64 * per_block)
    first = run(a, {"a0": (prompt, PARAMS)})["a0"]
    run(a, {f"f{i}": (prompt_of(rng, 120), SamplingParams(max_tokens=1)) for i in range(3)})
    assert a.pool.host.counters.blocks_saved > 0, (
        "the filler was meant to push the prompt to the host tier"
    )
    payload = export(a, prompt)
    assert payload.num_blocks == 6
    b = tiny(tiny_models)
    assert b.import_prefix(payload) == 6
    pulled = run(b, {"b0": (prompt, PARAMS)})["b0"]
    assert pulled.num_cached_tokens == 96
    same_output(pulled, first)
    other = prompt[:40] + [t + 1 for t in prompt[40:]]  # agrees on blocks 0-1 only
    assert export(a, other).num_blocks == 2
    assert export(a, prompt_of(rng, 64)) is None
    assert export(a, prompt, cache_salt="tenant-b") is None, "another salt is another chain"


def test_salted_prefix_keeps_its_salt(tiny_models, test_seed):
    prompt = prompt_of(random.Random(test_seed), 70)
    a, b = tiny(tiny_models), tiny(tiny_models)
    a.add_request("a0", prompt, PARAMS, cache_salt="tenant-a")
    first = run(a, {})["a0"]
    payload = export(a, prompt, cache_salt="tenant-a")
    assert b.import_prefix(payload) == 4
    b.add_request("unsalted", prompt, PARAMS)
    assert run(b, {})["unsalted"].num_cached_tokens == 0, (
        "a salted import serves only its own tenant"
    )
    b.add_request("salted", prompt, PARAMS, cache_salt="tenant-a")
    pulled = run(b, {})["salted"]
    assert pulled.num_cached_tokens == 64
    same_output(pulled, first)


def test_payload_that_does_not_fit_is_refused_before_any_change(tiny_models, test_seed):
    prompt = prompt_of(random.Random(test_seed), 70)
    a = tiny(tiny_models)
    run(a, {"a0": (prompt, PARAMS)})
    payload = export(a, prompt)
    b = tiny(tiny_models)
    flipped = list(payload.token_ids)
    flipped[20] += 1
    bad = {
        "model_id": dataclasses.replace(payload, model_id="someone-else"),
        "block_size": dataclasses.replace(payload, block_size=32),
        "dtype": dataclasses.replace(payload, dtype="bfloat16"),
        "layout": dataclasses.replace(
            payload, layout="blocks,layers,kv,kv_heads,block_size,head_dim"
        ),
        "kv": dataclasses.replace(payload, kv=payload.kv[:, :1]),
        "token_ids": dataclasses.replace(payload, token_ids=tuple(flipped)),
        "cache_salt": dataclasses.replace(payload, cache_salt="tenant-b"),
    }
    for field, payload_bad in bad.items():
        want = (
            "token_ids" if field == "cache_salt" else field
        )  # a salt that is not the chain's: tokens do not hash
        with pytest.raises(KVPayloadMismatchError, match=f"payload.{want}"):
            b.import_prefix(payload_bad)
    with pytest.raises(KVPayloadMismatchError, match="payload.dtype"):
        tiny(tiny_models, dtype="bfloat16").import_prefix(payload)
    with pytest.raises(KVPayloadMismatchError, match="payload.block_size"):
        tiny(tiny_models, block_size=32).import_prefix(payload)
    with pytest.raises(KVPayloadMismatchError, match="KVPayload"):
        b.import_prefix({"kv": payload.kv})
    assert b.pool.cached_hashes() == [] and b.drain_kv_events() == []
    b.pool.check_invariants()
    assert b.import_prefix(payload) == 4  # the good one still goes in


@pytest.mark.parametrize("num_kv_blocks,expect_imported", [(6, 0), (8, 2)])
def test_import_into_a_full_pool_takes_what_fits_and_corrupts_nothing(
    tiny_models, test_seed, num_kv_blocks, expect_imported
):
    rng = random.Random(test_seed)
    prompt, busy = prompt_of(rng, 100), prompt_of(rng, 95)
    a = tiny(tiny_models)
    first = run(a, {"a0": (prompt, PARAMS)})["a0"]
    payload = export(a, prompt)
    busy_params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
    b = tiny(tiny_models, num_kv_blocks=num_kv_blocks)
    b.add_request("busy", busy, busy_params)
    b.step()  # the busy request's prefill holds 6 blocks now
    assert b.pool.num_free_blocks == num_kv_blocks - 6
    assert b.import_prefix(payload) == expect_imported
    b.pool.check_invariants()
    busy_out = run(b, {})["busy"]
    same_output(busy_out, run(tiny(tiny_models), {"x": (busy, busy_params)})["x"])
    if expect_imported:
        pulled = run(b, {"b0": (prompt, PARAMS)})["b0"]
        assert pulled.num_cached_tokens == expect_imported * b.block_size
        same_output(pulled, first)


def test_pull_between_async_engines_across_the_process_boundary(tiny_models, test_seed):
    """The commands through the engine loop: A in a child process, B in a thread; a payload
    crosses the socket both ways, a refusal comes back as the exception and B goes on serving."""
    import asyncio

    from worker.async_engine import AsyncEngine
    from worker.outputs import accumulate

    prompt = prompt_of(random.Random(test_seed), 100)
    config = EngineConfig(model=tiny_models["llama"], num_kv_blocks=64)
    a, b = AsyncEngine(config, "a", spawn=True), AsyncEngine(config, "b", spawn=False)

    async def generate(engine, rid):
        return accumulate([o async for o in engine.generate(rid, prompt, PARAMS)], prompt)

    async def main():
        first = await generate(a, "a0")
        hashes = hash_blocks(prompt, 16, a.model_id, None)
        payload = await a.export_prefix(hashes, prompt)
        assert payload.num_blocks == 6
        with pytest.raises(KVPayloadMismatchError, match="payload.model_id"):
            await b.import_prefix(dataclasses.replace(payload, model_id="someone-else"))
        assert await b.import_prefix(payload) == 6
        pulled = await generate(b, "b0")
        assert pulled.num_cached_tokens == 96
        same_output(pulled, first)
        stored = [
            h
            for batch in b.drain_kv_events()
            for e in batch.events
            if e.kind == EventKind.STORED and e.tier == Tier.DEVICE
            for h in e.hashes
        ]
        assert stored[:6] == hashes, "the import's events reach the replica's publisher"
        assert await a.import_prefix(await b.export_prefix(hashes, prompt)) == 0  # A holds them all
        assert await a.export_prefix(hashes, [t + 1 for t in prompt]) is None
        # An import queued, not awaited: a request added after it finds the blocks.
        c = AsyncEngine(config, "c", spawn=True)
        imported = c.submit_import(payload)
        assert (await generate(c, "c0")).num_cached_tokens == 96
        assert await imported == 6
        for engine in (a, b, c):
            await engine.shutdown(1.0)

    asyncio.run(main())


# -- the export a holder answers while its engine steps ------------------------------------------
def test_export_while_stepping_copies_only_blocks_not_evicted_during_the_copy(
    tiny_models, test_seed, monkeypatch
):
    """``export_device_prefix`` takes no reference: a block evicted (and so free to be
    rewritten) while it was being copied is cut from the payload, with every block after it."""
    import worker.kv_transfer as kv_transfer

    rng = random.Random(test_seed)
    prompt = prompt_of(rng, 100)
    a = tiny(tiny_models, num_kv_blocks=12)
    run(a, {"a0": (prompt, PARAMS)})
    hashes = hash_blocks(prompt, a.block_size, a.model_id, None)
    reference = export(a, prompt)
    free_before, collisions = a.pool.num_free_blocks, a.pool.num_collisions

    quiet = a.export_device_prefix(hashes, prompt)
    assert quiet.block_hashes == reference.block_hashes and quiet.kv.equal(reference.kv)
    assert (a.pool.num_free_blocks, a.pool.num_collisions) == (free_before, collisions)
    a.pool.check_invariants()

    gather = kv_transfer.gather_device_blocks

    def gather_then_step(runner, block_ids):
        copied = gather(runner, block_ids)
        # meanwhile the engine's step allocates: the free queue is in eviction order, and the
        # prompt's blocks (freed tail first) go from its last block back to its first
        a.pool.free(a.pool.allocate(a.pool.num_free_blocks - 4))
        return copied

    monkeypatch.setattr(kv_transfer, "gather_device_blocks", gather_then_step)
    cut = a.export_device_prefix(hashes, prompt)
    monkeypatch.undo()
    held = len(a.pool.find_cached_prefix(hashes, prompt))
    assert 0 < cut.num_blocks == held < reference.num_blocks
    assert cut.kv.equal(reference.kv[:held]), "what is kept is what the blocks held"
    assert a.export_device_prefix(hashes, [t + 1 for t in prompt]) is None


def test_a_busy_engine_process_answers_an_export_without_waiting_for_its_step(
    tiny_models, test_seed
):
    """The engine process's calls thread answers a peer's export itself, with nothing stepping
    the engine (the loop is not even running here); an engine with a host tier (read between
    steps only) refuses to answer there (its ``ProcessCore`` sends exports to the loop)."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    from worker.engine_commands import Call
    from worker.engine_process import answer_calls

    rng = random.Random(test_seed)
    prompt = prompt_of(rng, 100)

    def serve(engine):
        parent_sock, child_sock = socket.socketpair()
        parent, child = Connection(parent_sock.detach()), Connection(child_sock.detach())
        thread = threading.Thread(target=answer_calls, args=(child, engine, child.send))
        thread.daemon = True
        thread.start()
        return parent, thread

    a = tiny(tiny_models)
    run(a, {"a0": (prompt, PARAMS)})
    hashes = hash_blocks(prompt, a.block_size, a.model_id, None)
    parent, thread = serve(a)
    parent.send(Call(7, "export_prefix", (hashes, prompt, None)))
    assert parent.poll(30), "the export was not answered while nothing steps the engine"
    kind, (call_id, payload) = parent.recv()
    assert (kind, call_id) == ("reply", 7)
    assert payload.kv.equal(export(a, prompt).kv)
    parent.close()
    thread.join(30)
    assert not thread.is_alive(), "the thread ends when the socket closes"

    per_block = 2 * 2 * 2 * 16 * 32 * 4
    h = tiny(tiny_models, num_kv_blocks=12, host_kv_cache_bytes=64 * per_block)
    run(h, {"h0": (prompt, PARAMS)})
    parent, _ = serve(h)
    parent.send(Call(9, "export_prefix", (hashes, prompt, None)))
    assert parent.poll(30)
    kind, (call_id, answer) = parent.recv()
    assert (kind, call_id) == ("reply", 9) and isinstance(answer, ValueError)
    parent.close()


def test_a_shared_memory_payload_is_read_once_and_falls_back_to_bytes(
    tiny_models, test_seed, tmp_path
):
    """``shared_dir``: the K/V go in a file there (both exports); the import maps and removes it,
    a second import of the same payload is refused, and a directory that cannot hold the file
    means a payload with the bytes."""
    from worker.kv_transfer import SHARED_KV_PREFIX, SharedKV

    rng = random.Random(test_seed)
    prompt = prompt_of(rng, 100)
    a = tiny(tiny_models)
    first = run(a, {"a0": (prompt, PARAMS)})["a0"]
    hashes = hash_blocks(prompt, a.block_size, a.model_id, None)
    reference = export(a, prompt)
    for exporter in (a.export_prefix, a.export_device_prefix):
        shared = exporter(hashes, prompt, None, str(tmp_path))
        assert isinstance(shared.kv, SharedKV) and shared.kv_bytes == reference.kv_bytes
        assert len(list(tmp_path.glob(f"{SHARED_KV_PREFIX}*"))) == 1
        shared = pickle.loads(pickle.dumps(shared))
        b = tiny(tiny_models)
        assert b.import_prefix(shared) == 6
        assert not list(tmp_path.glob(f"{SHARED_KV_PREFIX}*")), "read once, then removed"
        with pytest.raises(KVPayloadMismatchError, match="payload.kv: .* unreadable"):
            tiny(tiny_models).import_prefix(shared)
        same_output(run(b, {"b0": (prompt, PARAMS)})["b0"], first)
    fallback = a.export_device_prefix(hashes, prompt, None, str(tmp_path / "missing"))
    assert fallback.kv.equal(reference.kv)


def test_a_shared_memory_file_nobody_imports_is_removed_after_its_ttl(tmp_path):
    """The exporting process removes its file after ``ttl_s`` (the importer timed out or
    died); one the importer already removed is no error, and files expire in deadline order
    whatever order they were written in."""
    import os
    import time

    import torch

    from worker.kv_transfer import write_shared

    late = write_shared(torch.ones(4, 8), str(tmp_path), ttl_s=30.0)
    soon = write_shared(torch.ones(4, 8), str(tmp_path), ttl_s=0.1)
    read = write_shared(torch.arange(32.0).view(4, 8), str(tmp_path), ttl_s=0.1)
    assert torch.equal(read.load(), torch.arange(32.0).view(4, 8))  # removes the file
    assert os.path.exists(soon.path) and os.path.exists(late.path)
    deadline = time.monotonic() + 5.0
    while os.path.exists(soon.path):
        assert time.monotonic() < deadline, "the expired file was never removed"
        time.sleep(0.02)
    assert os.path.exists(late.path)
    os.unlink(late.path)
