"""The engine with the Triton kernel backend (the CUDA path), run here under the interpreter.

On a GPU the same test runs on CUDA (``cuda`` marked variant). It checks the wiring of
``kernels/ops.py`` end to end: greedy tokens equal transformers' on a tiny random model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.kernels.conftest import DEVICE
from tests.worker.helpers import hf_greedy
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams
from worker.testing import make_tiny_model

SMALL_VOCAB = 512
"""The interpreter runs every program of the LM-head matmul in numpy: a small vocabulary
keeps this end-to-end test to seconds."""


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_transformers(tmp_path, smollm2_path, arch):
    path = make_tiny_model(tmp_path / arch, arch, vocab_size=SMALL_VOCAB)
    engine = LLMEngine(
        EngineConfig(model=path, num_kv_blocks=64, kernel_backend="triton", device=DEVICE)
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 17, 300, 400, 12, 9, 77, 1, 3, 5, 8, 13, 21, 34, 55, 89, 144], [42, 43]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    for i, p in enumerate(prompts):
        assert done[str(i)] == hf_greedy(hf, p, 4)
