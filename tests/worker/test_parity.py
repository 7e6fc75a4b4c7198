"""Our model code against transformers: same greedy tokens, same fp32 logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.worker.helpers import PROMPTS, engine_prompt_logits, hf_greedy
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams

NUM_NEW_TOKENS = 32


def _check_model(path: str, deterministic: bool, prompts=PROMPTS, max_new=NUM_NEW_TOKENS):
    engine = LLMEngine(
        EngineConfig(
            model=path,
            num_kv_blocks=1024,
            deterministic=deterministic,
            max_num_batched_tokens=2048,
            device="cpu",  # float32 beside transformers' float32 (CUDA: tests/kernels)
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [engine.tokenizer.encode(p) for p in prompts]
    for i, p in enumerate(ids):
        engine.add_request(
            f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
        )
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    mismatches = [(i, done[f"r{i}"], hf_greedy(hf, p, max_new)) for i, p in enumerate(ids)]
    mismatches = [m for m in mismatches if m[1] != m[2]]
    assert not mismatches, (
        f"{len(mismatches)} prompts differ from transformers, first: {mismatches[0]}"
    )
    for p in ids[:5]:
        ours = engine_prompt_logits(engine, p)
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float()
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"logits differ by {rel:.2e} (relative to the largest logit)"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "llama3-scaled"])
def test_tiny_models_match_transformers(tiny_models, arch):
    _check_model(tiny_models[arch], deterministic=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fast_mode_matches_transformers(tiny_models, arch):
    _check_model(tiny_models[arch], deterministic=False)


@pytest.mark.slow
def test_bundled_smollm2_matches_transformers(smollm2_path):
    _check_model(smollm2_path, deterministic=True)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'
    )
    with pytest.raises(
        ValueError,
        match="unsupported model architecture.*GPT2LMHeadModel.*supported: LlamaForCausalLM",
    ):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=8))
