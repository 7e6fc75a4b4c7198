"""The model's generation_config.json at the ingress: a request field that is absent or null
takes the model's default, a field the request sets keeps its value (no Ray: the ingress's
``load_frontend`` and the protocol's ``sampling_params`` are called as the ingress calls them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_body
from worker.config import EngineConfig
from worker.loader import load_frontend
from worker.testing import make_tiny_model

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64}


@pytest.fixture(scope="module")
def model_with_generation_config(tmp_path_factory) -> str:
    folder = make_tiny_model(tmp_path_factory.mktemp("gen") / "tiny", "llama", seed=11)
    (Path(folder) / "generation_config.json").write_text(json.dumps(DEFAULTS))
    return folder


def chat(body: dict) -> ChatCompletionRequest:
    return parse_body(
        ChatCompletionRequest,
        json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode(),
    )


def test_load_frontend_reads_the_models_defaults(model_with_generation_config):
    tok, defaults = load_frontend(EngineConfig(model=model_with_generation_config))
    assert tok.encode("hello")
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    _, none = load_frontend(
        EngineConfig(model=model_with_generation_config, generation_config="vllm")
    )
    assert none == {}


def test_unset_or_null_fields_take_the_models_default(model_with_generation_config):
    _, defaults = load_frontend(EngineConfig(model=model_with_generation_config))
    params = chat({"temperature": None}).sampling_params(32, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.9, 20, 0.0)
    params = chat({"temperature": 0.0, "top_k": 5}).sampling_params(32, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (
        0.0,
        0.9,
        5,
    )  # the request wins where it speaks
    completion = parse_body(CompletionRequest, json.dumps({"prompt": "hi", "top_p": 0.5}).encode())
    params = completion.sampling_params(16, defaults)
    assert (params.temperature, params.top_p) == (0.6, 0.5)
    assert chat({}).sampling_params(32).temperature == 1.0  # no defaults: ours
