"""The simulated KV formats of ``bench/kv_quant_variants.py``: the simulation reproduces the
real int8 cache, and each candidate's numerics do what its description says."""

from __future__ import annotations

import pytest
import torch

from bench.kv_quant_variants import (
    VARIANTS,
    asymmetric_int8,
    grouped_int8,
    k_channel_constants,
    per_row_int8,
    simulate,
    variant,
)
from worker.llm import LLM
from worker.sampling_params import SamplingParams

PROMPTS = [[5, 9, 200, 31, 7] * 9, [100 + i for i in range(40)], [17, 3, 3, 3, 250, 8]]


def tiny_llm(tiny_models, kv_cache_dtype: str) -> LLM:
    return LLM(
        tiny_models["llama"],
        device="cpu",
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=64,
    )


def greedy(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def test_simulated_int8_gives_the_real_int8_cache_tokens_and_logprobs(tiny_models):
    real = tiny_llm(tiny_models, "int8")
    expected = greedy(real)
    real.shutdown()
    full = tiny_llm(tiny_models, "auto")
    plain = greedy(full)
    simulate(full, variant("int8-sim"))
    got = greedy(full)
    full.shutdown()
    for (tokens, lps), (want_tokens, want_lps) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, rel=1e-5)  # float32 sums in another order
    assert got != plain  # the simulation did change what attention reads


def test_a_group_as_wide_as_the_row_is_the_per_row_format():
    x = torch.randn(7, 3, 64) * torch.linspace(0.01, 4.0, 64)
    assert torch.equal(grouped_int8(64)(x), per_row_int8(x))


def test_smaller_groups_cut_the_error_of_a_row_with_an_outlier_channel():
    x = torch.randn(64, 2, 64)
    x[..., 5] *= 40.0  # one loud channel sets a whole row's scale
    err = {g: (grouped_int8(g)(x) - x).abs().mean().item() for g in (64, 32, 16)}
    assert err[16] < err[32] < err[64]


def test_asymmetric_rows_are_within_one_step_of_the_value():
    x = torch.rand(50, 2, 64) * 3.0 + 1.0  # all positive: half the symmetric levels unused
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 255.0
    assert ((asymmetric_int8(x) - x).abs() <= step * 1.01).all()
    assert (asymmetric_int8(x) - x).abs().mean() < (per_row_int8(x) - x).abs().mean()


def test_k_constants_are_one_positive_vector_per_layer_and_head(tiny_models):
    llm = tiny_llm(tiny_models, "auto")
    constants = k_channel_constants(llm, PROMPTS[1])
    spec = llm.engine.runner.model.spec
    assert len(constants) == spec.num_layers
    for c in constants.values():
        assert c.shape == (spec.num_kv_heads, spec.head_dim) and (c > 0).all()
    llm.shutdown()


def test_every_variant_reports_its_blocks_against_float32():
    ratios = {name: v.blocks_ratio_to_float32(64) for name, v in VARIANTS.items()}
    assert ratios["int8-sim"] == ratios["int8-ksmooth"] == pytest.approx(512 / 132)
    assert ratios["int8-g16"] == pytest.approx(512 / 144)
    assert ratios["k16-v8"] == pytest.approx(512 / 194)
    with pytest.raises(ValueError, match="variant must be one of"):
        variant("int4")
