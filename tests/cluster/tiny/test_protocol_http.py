"""What OpenAI clients and evaluation harnesses send, against the shared tiny cluster: nulls,
echo with logprobs (lm-eval-harness's loglikelihood request), logit_bias, prompt_logprobs,
and errors whose code is a string or null."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog."


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)


def test_nulls_mean_defaults_and_unknown_fields_are_ignored(tiny_server):
    body = {
        "model": tiny_server.model,
        "messages": [{"role": "user", "content": "hi", "refusal": None}],
        "n": None,
        "stream": None,
        "logprobs": None,
        "top_logprobs": None,
        "temperature": None,
        "stop": None,
        "max_tokens": 3.0,
        "some_new_openai_field": {"x": 1},
    }
    response = post(tiny_server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    echo = post(
        tiny_server,
        "/v1/completions",
        {
            "model": tiny_server.model,
            "prompt": "a",
            "echo": None,
            "logprobs": None,
            "max_tokens": 2,
        },
    )
    assert echo.status_code == 200 and echo.json()["choices"][0]["logprobs"] is None


def test_loglikelihood_request_of_lm_eval(tiny_server, client):
    ids = post(tiny_server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    # lm-eval's local-completions: token ids, echo, logprobs 1, one token, greedy.
    outs = [
        client.completions.create(
            model=tiny_server.model,
            prompt=prompt,
            echo=True,
            logprobs=1,
            max_tokens=1,
            temperature=0,
            seed=1234,
        )
        for prompt in (ids, ids[:5])
    ]
    first, second = (out.choices[0] for out in outs)
    assert first.text.startswith(PROMPT)
    for choice, prompt_ids in ((first, ids), (second, ids[:5])):
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt_ids) + 1
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for logprob, top in zip(
            logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
        ):
            assert logprob <= 0.0 and max(top.values()) >= logprob
    # The same prompt twice gives the same numbers (prompt logprobs ignore the prefix cache).
    assert first.logprobs.token_logprobs[1:5] == second.logprobs.token_logprobs[1:5]
    assert [out.usage.prompt_tokens_details.cached_tokens for out in outs] == [0, 0]


def test_logit_bias_and_prompt_logprobs(tiny_server, client):
    token = post(tiny_server, "/tokenize", {"prompt": " fox"}).json()["tokens"][0]
    out = client.completions.create(
        model=tiny_server.model,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logit_bias={str(token): 100},
    )
    assert out.choices[0].text == " fox" * 3
    vllm = post(
        tiny_server,
        "/v1/completions",
        {"model": tiny_server.model, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2},
    ).json()
    prompt_logprobs = vllm["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    assert all(len(entry) in (2, 3) for entry in prompt_logprobs[1:])


def test_errors_name_the_field_with_a_string_or_null_code(tiny_server):
    for body, param in (
        ({"logit_bias": {"fox": 1}}, "logit_bias"),
        ({"logit_bias": {"10000000": 1}}, "logit_bias"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
        ({"n": 1.5}, "n"),
    ):
        response = post(
            tiny_server, "/v1/completions", {"model": tiny_server.model, "prompt": "a", **body}
        )
        error = response.json()["error"]
        assert response.status_code == 400, body
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert (
            error["code"] is None
            or isinstance(error["code"], str)
            and error["code"] != "Bad Request"
        )
    chat = post(
        tiny_server,
        "/v1/chat/completions",
        {
            "model": tiny_server.model,
            "logprobs": True,
            "top_logprobs": 99,
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"
    assert chat.json()["error"]["message"].startswith("top_logprobs")
