"""KV pulled from a peer across cache layouts: the Triton backend's cache is block-major, the
CPU one head-major, and ``worker/kv_transfer.py``'s payload is one layout for both. Here (the
Triton interpreter on CPU, as this folder's conftest sets up) a head-major engine's export is
imported into a block-major engine and exported back unchanged, bit for bit."""

from __future__ import annotations

import random

from router.protocol import hash_blocks
from tests.kernels.conftest import DEVICE
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams


def test_payload_round_trips_through_a_block_major_cache(tiny_models, test_seed):
    prompt = [random.Random(test_seed).randrange(5, 40000) for _ in range(70)]
    hashes = hash_blocks(prompt, 16, "llama", None)
    cpu = LLMEngine(
        EngineConfig(
            model=tiny_models["llama"], model_id="llama", num_kv_blocks=32, kernel_backend="torch"
        )
    )
    cpu.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=1))
    while cpu.has_unfinished():
        cpu.step()
    payload = cpu.export_prefix(hashes, prompt)
    assert payload.num_blocks == 4
    triton = LLMEngine(
        EngineConfig(
            model=tiny_models["llama"],
            model_id="llama",
            num_kv_blocks=32,
            kernel_backend="triton",
            device=DEVICE,
        )
    )
    assert cpu.runner.ops.head_major_cache and not triton.runner.ops.head_major_cache
    assert triton.import_prefix(payload) == 4
    triton.pool.check_invariants()
    again = triton.export_prefix(hashes, prompt)
    assert again.block_hashes == payload.block_hashes and again.token_ids == payload.token_ids
    assert again.kv.equal(payload.kv)
    back = LLMEngine(
        EngineConfig(
            model=tiny_models["llama"], model_id="llama", num_kv_blocks=32, kernel_backend="torch"
        )
    )
    assert back.import_prefix(again) == 4
    assert back.export_prefix(hashes, prompt).kv.equal(payload.kv)
