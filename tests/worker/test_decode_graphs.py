"""Decode steps over padded static buffers (``worker/decode_graphs.py``), checked on the CPU.

CUDA graphs replay exactly the padded forward pass these tests run eagerly, so what they
check holds on a GPU too: in deterministic mode each real row's logits are bitwise those of
the unpadded step, and padding rows never write the KV cache.
"""

from __future__ import annotations

import pytest
import torch

from worker.config import EngineConfig
from worker.decode_graphs import DecodeGraphs, decode_buckets, is_plain_decode
from worker.engine import LLMEngine
from worker.parallel.step_message import StepInputs, inputs_of
from worker.sampling_params import SamplingParams


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert decode_buckets(1) == [1]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert decode_buckets(200)[-3:] == [160, 192, 200]
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def test_only_plain_decode_steps_fit():
    decode = StepInputs([5, 6], [10, 3], [1, 1], [[0], [1]], [0, 1])
    assert is_plain_decode(decode)
    prefill = StepInputs([5, 6, 7], [0, 3], [2, 1], [[0], [1]], [1, 2])
    assert not is_plain_decode(prefill)
    prompt_rows = StepInputs([5, 6], [10, 3], [1, 1], [[0], [1]], [0, 1, 0])
    assert not is_plain_decode(prompt_rows)
    assert not is_plain_decode(StepInputs([], [], [], [], []))


def _decoding_engine(model: str, prompt_lengths: list[int]) -> LLMEngine:
    """An engine whose every request is past its prompt, so its next step is a plain decode."""
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cpu",
            dtype="float32",
            deterministic=True,
            block_size=8,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=256,
        )
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, n in enumerate(prompt_lengths):
        engine.add_request(f"r{i}", [100 + (7 * i + j) % 900 for j in range(n)], params)
    for _ in range(3):
        engine.step()  # prefill, then two decodes: KV of several blocks in every sequence
    return engine


@pytest.mark.parametrize("prompt_lengths", [[5, 20, 37], [3, 9, 17, 30, 41]])
def test_padded_step_gives_each_row_the_bits_of_the_unpadded_one(tiny_models, prompt_lengths):
    engine = _decoding_engine(tiny_models["llama"], prompt_lengths)
    runner = engine.runner
    batch = engine.scheduler.schedule()
    inputs, _ = inputs_of(batch)
    assert is_plain_decode(inputs) and len(inputs.counts) == len(prompt_lengths)

    kv_before = runner.kv.clone()
    unpadded = runner.run_inputs(inputs).clone()
    kv_unpadded = runner.kv.clone()
    assert not torch.equal(kv_before, kv_unpadded)  # the step wrote each sequence's new slot

    runner.kv.copy_(kv_before)
    graphs = DecodeGraphs(
        lambda ids, positions, meta, rows: runner.model.forward(
            ids, positions, runner.kv_caches, meta, rows
        ),
        max_num_seqs=8,
        max_blocks_per_seq=runner.max_blocks_per_seq,
        block_size=runner.block_size,
        device=runner.device,
        capture=False,
    )
    assert graphs.bucket_for(len(prompt_lengths)) > len(prompt_lengths)  # padding rows run
    padded = graphs.run(inputs)
    assert padded.shape == unpadded.shape
    assert torch.equal(padded, unpadded)
    assert torch.equal(runner.kv, kv_unpadded)  # padding wrote nothing


def test_a_smaller_step_after_a_larger_one_reads_no_stale_rows(tiny_models):
    """The static buffers keep the last step's rows past the current batch; a later, smaller
    step must not see them (each step rewrites its padding)."""
    engine = _decoding_engine(tiny_models["llama"], [3, 9, 17, 30, 41])
    runner = engine.runner
    graphs = DecodeGraphs(
        lambda ids, positions, meta, rows: runner.model.forward(
            ids, positions, runner.kv_caches, meta, rows
        ),
        max_num_seqs=8,
        max_blocks_per_seq=runner.max_blocks_per_seq,
        block_size=runner.block_size,
        device=runner.device,
        capture=False,
    )
    inputs, _ = inputs_of(engine.scheduler.schedule())
    kv_before = runner.kv.clone()
    graphs.run(inputs)  # five rows
    runner.kv.copy_(kv_before)
    three = StepInputs(
        inputs.token_ids[:3], inputs.starts[:3], [1, 1, 1], inputs.tables[:3], [0, 1, 2]
    )
    expected = runner.run_inputs(three).clone()
    kv_expected = runner.kv.clone()
    runner.kv.copy_(kv_before)
    assert graphs.bucket_for(3) == 4  # row 3 held a real sequence in the step before
    assert torch.equal(graphs.run(three), expected)
    assert torch.equal(runner.kv, kv_expected)


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(
            lambda *a: None,
            max_num_seqs=4,
            max_blocks_per_seq=4,
            block_size=16,
            device=torch.device("cpu"),
            capture=True,
        )


def test_cpu_runner_runs_eagerly(tiny_models):
    engine = _decoding_engine(tiny_models["llama"], [5])
    assert engine.runner.decode_graphs is None
    assert EngineConfig(model="x", enforce_eager=True).enforce_eager


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _greedy_outputs(model: str, enforce_eager: bool) -> dict[str, list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cuda",
            dtype="bfloat16",
            deterministic=True,
            block_size=16,
            num_kv_blocks=256,
            max_num_seqs=8,
            enforce_eager=enforce_eager,
        )
    )
    assert (engine.runner.decode_graphs is None) == enforce_eager
    for i, n in enumerate([5, 20, 37, 3, 50, 9]):
        params = SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True)
        engine.add_request(f"r{i}", [100 + (7 * i + j) % 900 for j in range(n)], params)
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
    return tokens


@cuda_only
def test_graph_replays_give_the_tokens_of_eager_steps_on_cuda(tiny_models):
    """Requests finish at different steps, so the batch walks down through the buckets."""
    assert _greedy_outputs(tiny_models["llama"], False) == _greedy_outputs(
        tiny_models["llama"], True
    )


@cuda_only
def test_graph_replay_logits_are_the_eager_bits_on_cuda(tiny_models):
    engine = LLMEngine(
        EngineConfig(
            model=tiny_models["llama"],
            device="cuda",
            dtype="bfloat16",
            deterministic=True,
            block_size=8,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=256,
        )
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, n in enumerate([3, 9, 17, 30, 41]):
        engine.add_request(f"r{i}", [100 + (7 * i + j) % 900 for j in range(n)], params)
    for _ in range(3):
        engine.step()
    runner = engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.captured
    inputs, _ = inputs_of(engine.scheduler.schedule())
    kv_before = runner.kv.clone()
    replayed = runner.run_inputs(inputs).clone()
    kv_replayed = runner.kv.clone()
    runner.kv.copy_(kv_before)
    runner.decode_graphs = None
    try:
        eager = runner.run_inputs(inputs)
    finally:
        runner.decode_graphs = graphs
    assert torch.equal(replayed, eager)
    assert torch.equal(runner.kv, kv_replayed)
