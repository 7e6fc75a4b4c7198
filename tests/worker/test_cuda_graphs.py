"""Steps over padded static buffers (``worker/cuda_graphs.py``), checked on the CPU.

CUDA graphs replay exactly the padded forward pass these tests run eagerly, so what they
check holds on a GPU too: in deterministic mode each real row's logits are bitwise those of
the unpadded step, and padding never writes the KV cache. Mixed steps (zero-token sequence
slots) are checked with the Triton kernels in ``tests/kernels/test_step_graphs_on_triton.py``;
the CUDA-only tests at the end compare graph replays with eager steps on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.worker.helpers import check_every_step_against_eager, staggered_run
from worker.config import EngineConfig
from worker.cuda_graphs import (
    Shape,
    StepGraphs,
    decode_buckets,
    is_plain_decode,
    token_buckets,
)
from worker.engine import LLMEngine
from worker.parallel.step_message import StepInputs, inputs_of
from worker.sampling_params import SamplingParams


def test_buckets_cover_every_size_up_to_the_limits():
    assert decode_buckets(1) == [1]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert decode_buckets(200)[-3:] == [160, 192, 200]
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert token_buckets(100) == [16, 32, 64, 100]
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        token_buckets(0)


def test_only_plain_decode_steps_are_decodes():
    decode = StepInputs([5, 6], [10, 3], [1, 1], [[0], [1]], [0, 1])
    assert is_plain_decode(decode)
    prefill = StepInputs([5, 6, 7], [0, 3], [2, 1], [[0], [1]], [1, 2])
    assert not is_plain_decode(prefill)
    prompt_rows = StepInputs([5, 6], [10, 3], [1, 1], [[0], [1]], [0, 1, 0])
    assert not is_plain_decode(prompt_rows)
    assert not is_plain_decode(StepInputs([], [], [], [], []))


def _graphs_for(runner, *, mixed: bool = False, max_num_batched_tokens: int = 256) -> StepGraphs:
    return StepGraphs(
        lambda ids, positions, meta, rows: runner.model.forward(
            ids, positions, runner.kv_caches, meta, rows
        ),
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_blocks_per_seq=runner.max_blocks_per_seq,
        block_size=runner.block_size,
        vocab_size=runner.model.lm_head.shape[0],
        device=runner.device,
        capture=False,
        mixed=mixed,
    )


def test_steps_are_placed_in_the_smallest_bucket_that_holds_them(tiny_models):
    engine = _decoding_engine(tiny_models["llama"], [5])
    graphs = _graphs_for(engine.runner, mixed=True, max_num_batched_tokens=100)
    decode = StepInputs([5, 6, 7], [10, 3, 4], [1, 1, 1], [[0], [1], [2]], [0, 1, 2])
    assert graphs.shape_for(decode) == Shape(decode=True, tokens=4, seqs=4, rows=4)
    mixed = StepInputs([5] * 20, [0, 3], [19, 1], [[0, 1], [2]], [18, 19])
    assert graphs.shape_for(mixed) == Shape(decode=False, tokens=32, seqs=8, rows=8)
    decode_only = _graphs_for(engine.runner, mixed=False)
    assert decode_only.shape_for(mixed) is None


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
def test_padded_decode_gives_each_row_the_bits_of_the_unpadded_one(tiny_models, prompt_lengths):
    engine = _decoding_engine(tiny_models["llama"], prompt_lengths)
    runner = engine.runner
    inputs, _ = inputs_of(engine.scheduler.schedule())
    assert is_plain_decode(inputs) and len(inputs.counts) == len(prompt_lengths)

    kv_before = runner.kv.clone()
    unpadded = runner.run_inputs(inputs).clone()
    kv_unpadded = runner.kv.clone()
    assert not torch.equal(kv_before, kv_unpadded)  # the step wrote each sequence's new slot

    runner.kv.copy_(kv_before)
    graphs = _graphs_for(runner)
    shape = graphs.shape_for(inputs)
    assert shape.decode and shape.seqs > len(prompt_lengths)  # padding rows run
    padded = graphs.run(inputs, shape)
    assert padded.shape == unpadded.shape
    assert torch.equal(padded, unpadded)
    assert torch.equal(runner.kv, kv_unpadded)  # padding wrote nothing


def test_a_smaller_step_after_a_larger_one_reads_no_stale_rows(tiny_models):
    """The static buffers keep the last step's rows past the current batch; a later, smaller
    step must not see them (each step rewrites its padding)."""
    engine = _decoding_engine(tiny_models["llama"], [3, 9, 17, 30, 41])
    runner = engine.runner
    graphs = _graphs_for(runner)
    inputs, _ = inputs_of(engine.scheduler.schedule())
    kv_before = runner.kv.clone()
    graphs.run(inputs, graphs.shape_for(inputs))  # five rows
    runner.kv.copy_(kv_before)
    three = StepInputs(
        inputs.token_ids[:3], inputs.starts[:3], [1, 1, 1], inputs.tables[:3], [0, 1, 2]
    )
    expected = runner.run_inputs(three).clone()
    kv_expected = runner.kv.clone()
    runner.kv.copy_(kv_before)
    shape = graphs.shape_for(three)
    assert shape.seqs == 4  # row 3 held a real sequence in the step before
    assert torch.equal(graphs.run(three, shape), expected)
    assert torch.equal(runner.kv, kv_expected)


def _small_graphs(block_size: int, capture: bool) -> StepGraphs:
    """Graphs over 4 sequence slots and 64 tokens on the CPU, whose forward pass returns
    zeros: for what the step writes into the buffers, not what a model makes of it."""
    return StepGraphs(
        lambda ids, positions, meta, rows: torch.zeros(len(rows), 4),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_blocks_per_seq=4,
        block_size=block_size,
        vocab_size=4,
        device=torch.device("cpu"),
        capture=capture,
    )


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        _small_graphs(16, capture=True)


def test_cpu_runner_runs_eagerly(tiny_models):
    engine = _decoding_engine(tiny_models["llama"], [5])
    assert engine.runner.step_graphs is None
    assert EngineConfig(model="x", enforce_eager=True).enforce_eager


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _greedy_outputs(model: str, enforce_eager: bool) -> dict[str, list[int]]:
    """Requests arrive over several steps and finish at different ones, so the steps walk
    through mixed buckets (a prefill beside decodes) and down the decode buckets."""
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cuda",
            dtype="bfloat16",
            deterministic=True,
            block_size=16,
            num_kv_blocks=256,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            enforce_eager=enforce_eager,
        )
    )
    assert (engine.runner.step_graphs is None) == enforce_eager
    return staggered_run(engine, [5, 20, 37, 3, 50, 9, 70])


@cuda_only
def test_graph_replays_give_the_tokens_of_eager_steps_on_cuda(tiny_models):
    assert _greedy_outputs(tiny_models["llama"], False) == _greedy_outputs(
        tiny_models["llama"], True
    )


def test_every_decode_of_a_run_gives_eager_bits(tiny_models):
    """A whole run with staggered arrivals and finishes: each padded decode step against
    the unpadded one (prefill steps run eagerly with ``mixed=False``)."""
    engine = _decoding_engine(tiny_models["llama"], [])
    shapes = check_every_step_against_eager(engine.runner, _graphs_for(engine.runner))
    staggered_run(engine, [5, 20, 37, 3, 50, 9])
    assert any(s is not None and s.decode and s.seqs > 1 for s in shapes)


@cuda_only
def test_graph_replay_logits_are_the_eager_bits_on_cuda(tiny_models):
    engine = LLMEngine(
        EngineConfig(
            model=tiny_models["llama"],
            device="cuda",
            dtype="bfloat16",
            deterministic=True,
            block_size=8,
            num_kv_blocks=128,
            max_num_seqs=8,
            max_num_batched_tokens=64,
        )
    )
    graphs = engine.runner.step_graphs
    assert graphs is not None and graphs.captured
    shapes = check_every_step_against_eager(engine.runner, graphs)
    staggered_run(engine, [5, 20, 37, 3, 50, 9, 70])
    assert any(s is not None and not s.decode for s in shapes)
    assert any(s is not None and s.decode for s in shapes)


def test_a_mixed_step_writes_each_input_and_its_padding():
    """What a prefill chunk beside a decode puts in the static buffers, value by value: ids,
    positions and KV slots per token from each sequence's table, lengths, query starts and
    the sampled rows; padding tokens at slot -1, padding sequences of no tokens."""
    graphs = _small_graphs(4, capture=False)
    # Sequence 0 prefills tokens 2..6 over blocks 7 and 3; sequence 1 decodes position 5.
    inputs = StepInputs([11, 12, 13, 14, 15, 21], [2, 5], [5, 1], [[7, 3], [9, 8]], [4, 5])
    shape = graphs.shape_for(inputs)
    assert shape == Shape(decode=False, tokens=16, seqs=4, rows=4)
    graphs.run(inputs, shape)
    pad = 16 - 6
    assert graphs.input_ids[:16].tolist() == [11, 12, 13, 14, 15, 21] + [0] * pad
    assert graphs.positions[:16].tolist() == [2, 3, 4, 5, 6, 5] + [0] * pad
    assert graphs.slot_mapping[:16].tolist() == [30, 31, 12, 13, 14, 33] + [-1] * pad
    assert graphs.seq_lens[:4].tolist() == [7, 6, 0, 0]
    assert graphs.query_start_loc.tolist() == [0, 5, 6, 6, 6]
    assert graphs.logits_indices[:4].tolist() == [4, 5, 0, 0]
    assert graphs.block_tables[:2, :2].tolist() == [[7, 3], [9, 8]]
    # A decode step after it: one token per sequence, padded to its bucket with length-1 rows.
    decode = StepInputs([16, 22], [7, 6], [1, 1], [[7, 3], [9, 8]], [0, 1])
    shape = graphs.shape_for(decode)
    assert shape == Shape(decode=True, tokens=2, seqs=2, rows=2)
    graphs.run(decode, shape)
    assert graphs.input_ids[:2].tolist() == [16, 22]
    assert graphs.positions[:2].tolist() == [7, 6]
    assert graphs.slot_mapping[:2].tolist() == [15, 34]
    assert graphs.seq_lens[:2].tolist() == [8, 7]


def test_a_decode_fed_from_the_last_sample_gives_the_bits_of_known_ids(tiny_models):
    """Rows whose token is still in flight take it from the step before's sampled ids on
    the device (``async_scheduling``): the step's logits and KV are those of the known ids."""
    engine = _decoding_engine(tiny_models["llama"], [5, 20, 37])
    runner = engine.runner
    inputs, _ = inputs_of(engine.scheduler.schedule())
    graphs = _graphs_for(runner)
    kv_before = runner.kv.clone()
    expected = graphs.run(inputs, graphs.shape_for(inputs)).clone()
    kv_expected = runner.kv.clone()
    runner.kv.copy_(kv_before)
    ids = inputs.token_ids
    fed = dataclasses.replace(
        inputs,
        token_ids=[0, ids[1], 0],
        fed_rows=[0, 2],
        fed_src=[2, 0],
        fed_ids=torch.tensor([ids[2], 999, ids[0]]),
    )
    assert torch.equal(graphs.run(fed, graphs.shape_for(fed)), expected)
    assert torch.equal(runner.kv, kv_expected)
