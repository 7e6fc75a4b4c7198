"""echo and prompt logprobs on /v1/completions, through every hop but Ray: a real engine on a
tiny random model, its output deltas (what the engine process, the replica and the ingress
pass on untouched) and the ResponseBuilder; the numbers against transformers' own
log-softmax, the shape against OpenAI's legacy completions (what lm-eval-harness's
local-completions reads)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.openai_protocol import CompletionRequest, parse_body
from cluster.responses import ResponseBuilder
from worker.config import EngineConfig
from worker.engine import LLMEngine

PROMPT = "The quick brown fox jumps over the lazy dog"
NUM_TOP = 2


@pytest.fixture(scope="module")
def served(tiny_models):
    """The output deltas of one echo request (n=2), the prompt ids and transformers'
    logprobs."""
    path = tiny_models["llama"]
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=128, block_size=8))
    ids = engine.tokenizer.encode(PROMPT)
    body = parse_body(
        CompletionRequest,
        json.dumps(
            {
                "prompt": PROMPT,
                "echo": True,
                "logprobs": NUM_TOP,
                "max_tokens": 3,
                "temperature": 0,
                "n": 2,
                "prompt_logprobs": 1,
            }
        ).encode(),
    )
    engine.add_request("cmpl-1", ids, body.sampling_params(3))
    items = []
    while engine.has_unfinished():  # pickled, as they cross the engine socket and Ray
        items += [pickle.loads(pickle.dumps(delta)) for delta in engine.step_deltas()]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return body, items, ids, ref, engine.tokenizer


def make_builder(body, ids, tokenizer) -> ResponseBuilder:
    return ResponseBuilder(
        chat=False,
        request_id="cmpl-1",
        model="m",
        n=body.n,
        num_prompts=1,
        want_logprobs=True,
        token_to_str=tokenizer.token_to_str,
        echo_prompts=[(PROMPT, ids)],
        num_top_logprobs=NUM_TOP,
        want_prompt_logprobs=True,
    )


def test_prompt_logprobs_are_sent_once(served):
    _, items, ids, _, _ = served
    sent = [item.prompt_logprobs for item in items if item.prompt_logprobs is not None]
    assert len(sent) == 1 and len(sent[0]) == len(ids) and sent[0][0] is None


def test_echo_response_has_openai_shape_and_transformers_numbers(served):
    body, items, ids, ref, tokenizer = served
    builder = make_builder(body, ids, tokenizer)
    for item in items:
        builder.add(0, item)
    response = builder.full_response()
    assert [c["index"] for c in response["choices"]] == [0, 1]
    for choice in response["choices"]:
        logprobs = choice["logprobs"]
        assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
        assert len(logprobs["tokens"]) == len(ids) + 3
        assert logprobs["tokens"][: len(ids)] == [tokenizer.token_to_str(t) for t in ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        for pos in range(1, len(ids)):
            expected = float(ref[pos - 1, ids[pos]])
            assert logprobs["token_logprobs"][pos] == pytest.approx(expected, abs=2e-4)
            top = logprobs["top_logprobs"][pos]
            # The prompt token itself and the top NUM_TOP: what lm-eval's greedy check compares.
            assert tokenizer.token_to_str(ids[pos]) in top and len(top) <= NUM_TOP + 1
            assert max(top.values()) == pytest.approx(float(ref[pos - 1].max()), abs=2e-4)
        # lm-eval's loglikelihood of a continuation: the sum over its tokens.
        continuation = sum(logprobs["token_logprobs"][3 : len(ids)])
        assert continuation == pytest.approx(
            float(sum(ref[p - 1, ids[p]] for p in range(3, len(ids)))), abs=1e-3
        )
    # Greedy: the first generated token's logprob is that of the prompt's last position.
    first = response["choices"][0]["logprobs"]["token_logprobs"][len(ids)]
    assert first == pytest.approx(float(ref[-1].max()), abs=2e-4)
    # vLLM's prompt_logprobs: token id -> logprob, rank, decoded token.
    vllm = response["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None
    entry = vllm[1][str(ids[1])]
    assert entry["logprob"] == pytest.approx(float(ref[0, ids[1]]), abs=2e-4)
    assert entry["decoded_token"] == tokenizer.token_to_str(ids[1]) and entry["rank"] >= 1


def test_streamed_echo_leads_each_choice_once(served):
    body, items, ids, _, tokenizer = served
    whole = make_builder(body, ids, tokenizer)
    for item in items:
        whole.add(0, item)
    expected = {c["index"]: c for c in whole.full_response()["choices"]}
    streamed = make_builder(body, ids, tokenizer)
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    for item in items:
        for event in streamed.stream_events(0, item):
            choice = json.loads(event.removeprefix("data: "))["choices"][0]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            tokens.setdefault(choice["index"], []).extend(
                (choice["logprobs"] or {}).get("tokens", [])
            )
    for index, choice in expected.items():
        assert texts[index] == choice["text"]
        assert tokens[index] == choice["logprobs"]["tokens"]
