"""Request parsing and validation: every bad body is a 400 (or 404/413) naming the field."""

from __future__ import annotations

import json
import logging

import pytest

from cluster import errors
from cluster.errors import APIError
from cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    ignored_field_counts,
    parse_body,
    resolve_max_tokens,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def params_of(raw: bytes, model_cls=ChatCompletionRequest):
    return parse_body(model_cls, raw).sampling_params()


def test_chat_fields_map_onto_sampling_params():
    params = params_of(
        chat(
            temperature=0,
            top_p=0.5,
            top_k=5,
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            n=2,
            stop="END",
            seed=7,
            ignore_eos=True,
            min_tokens=2,
            max_tokens=9,
            logprobs=True,
            top_logprobs=3,
        )
    )
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 0.5, 5, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5,
        -0.5,
        1.2,
    )
    assert (params.n, params.stop, params.seed, params.ignore_eos) == (2, ["END"], 7, True)
    assert (params.min_tokens, params.max_tokens, params.logprobs) == (2, 9, 3)


def test_max_completion_tokens_wins_and_chat_logprobs_default_to_zero_alternatives():
    params = params_of(chat(max_tokens=5, max_completion_tokens=7, logprobs=True))
    assert params.max_tokens == 7
    assert params.logprobs == 0
    assert params_of(chat()).logprobs is None


def test_completion_prompts_accept_string_ids_and_batches():
    def prompts(prompt):
        return parse_body(CompletionRequest, json.dumps({"prompt": prompt}).encode()).prompts()

    assert prompts("hello") == ["hello"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(APIError) as info:
        prompts("")
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert (
        params_of(json.dumps({"prompt": "x", "logprobs": 2}).encode(), CompletionRequest).logprobs
        == 2
    )


BAD_CHAT_BODIES = [
    (b'{"model": "m", "messages": [', None, "Malformed JSON"),
    (
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        None,
        "Malformed JSON",
    ),
    (b"[1, 2]", None, "JSON object"),
    (chat(temperature="hot"), "temperature", "number"),
    (chat(n="2"), "n", "integer"),
    (chat(stream="yes"), "stream", "boolean"),
    (chat(stop=[1, 2]), "stop", "string"),
    (json.dumps({"model": "m"}).encode(), "messages", "Field required"),
    (chat(messages=[]), "messages", "non-empty"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages", "role"),
    (chat(max_tokens=0), "max_tokens", ">= 1"),
    (chat(max_tokens=-3), "max_tokens", ">= 1"),
    (chat(max_completion_tokens=0), "max_completion_tokens", ">= 1"),
    (chat(temperature=-0.5), "temperature", "[0, 100]"),
    (chat(top_p=0), "top_p", "(0, 1]"),
    (chat(top_p=1.5), "top_p", "(0, 1]"),
    (chat(n=17), "n", "[1, 16]"),
    (chat(stop=[f"s{i}" for i in range(17)]), "stop", "at most 16"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
    (chat(top_logprobs=2), "top_logprobs", "requires logprobs"),
    (chat(tools="all of them"), "tools", "valid"),
    (chat(logit_bias={"one": 5.0}), "logit_bias", "token ids"),
    (chat(logit_bias={"1": 101}), "logit_bias", "[-100, 100]"),
    (chat(n=1.5), "n", "integer"),
    (chat(prompt_logprobs=21), "prompt_logprobs", "[0, 20]"),
    (chat(messages=[{"role": None, "content": "x"}]), "messages", "role"),
    (chat(stream_options={"include_usage": True}), "stream_options", "stream"),
    (chat(cache_salt=""), "cache_salt", "non-empty"),
    (
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                    ],
                }
            ]
        ),
        "messages",
        "content part 1 is of type 'image_url': the served model takes text only",
    ),
]


@pytest.mark.parametrize(("raw", "param", "fragment"), BAD_CHAT_BODIES)
def test_bad_chat_bodies_are_400_naming_the_field(raw, param, fragment):
    with pytest.raises(APIError) as info:
        params_of(raw)
    body = info.value.body()["error"]
    assert info.value.status == 400
    assert body["param"] == param
    assert fragment in body["message"]
    assert body["type"] == "invalid_request_error"


def test_completion_logprobs_beyond_20_is_400():
    with pytest.raises(APIError) as info:
        params_of(json.dumps({"prompt": "x", "logprobs": 21}).encode(), CompletionRequest)
    assert (info.value.status, info.value.param) == (400, "logprobs")


def test_tokenize_needs_exactly_one_input():
    with pytest.raises(APIError):
        parse_body(TokenizeRequest, b"{}").check()
    with pytest.raises(APIError):
        parse_body(
            TokenizeRequest, json.dumps({"prompt": "a", "messages": MESSAGES}).encode()
        ).check()
    parse_body(TokenizeRequest, b'{"prompt": "a"}').check()


def test_resolve_max_tokens_fits_the_context():
    assert resolve_max_tokens(None, 10, 100, prompt_param="prompt", tokens_param="max_tokens") == 90
    assert resolve_max_tokens(90, 10, 100, prompt_param="prompt", tokens_param="max_tokens") == 90
    with pytest.raises(APIError) as info:
        resolve_max_tokens(91, 10, 100, prompt_param="prompt", tokens_param="max_tokens")
    assert (info.value.status, info.value.param, info.value.code) == (
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, 100, 100, prompt_param="messages", tokens_param="max_tokens")
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")


def test_error_helpers_give_openai_bodies_and_statuses():
    response = errors.overloaded("queue full").to_response()
    assert response.status_code == 429
    assert response.headers["retry-after"] == str(errors.DEFAULT_RETRY_AFTER_S)
    body = json.loads(response.body)["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert errors.model_not_found("x").status == 404
    assert errors.unauthorized().status == 401
    assert errors.body_too_large(2048).status == 413
    assert errors.param_of("top_p must be in (0, 1]") == "top_p"
    assert errors.param_of("max_tokens=9 plus the prompt's 5 tokens exceeds") == "max_tokens"
    assert errors.param_of("EngineConfig.max_model_len: too big") is None
    assert errors.param_of("something else happened") is None


def test_unknown_routes_and_methods_get_openai_errors():
    from fastapi.testclient import TestClient

    from cluster.ingress import app

    client = TestClient(app)
    missing = client.get("/v1/no-such-endpoint")
    assert missing.status_code == 404
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    wrong_method = client.get("/v1/chat/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"]


def test_null_means_the_default_and_integral_floats_are_integers():
    nulls = dict.fromkeys(
        [
            "n",
            "stream",
            "logprobs",
            "top_logprobs",
            "temperature",
            "stop",
            "max_tokens",
            "seed",
            "stream_options",
            "ignore_eos",
            "min_tokens",
            "logit_bias",
            "chat_template_kwargs",
        ]
    )
    request = parse_body(ChatCompletionRequest, chat(**nulls))
    assert (request.n, request.stream, request.logprobs, request.min_tokens) == (1, False, False, 0)
    params = request.sampling_params()
    assert (params.n, params.logprobs, params.temperature, params.logit_bias) == (
        1,
        None,
        1.0,
        None,
    )
    completion = parse_body(
        CompletionRequest,
        json.dumps({"prompt": "x", "echo": None, "logprobs": None, "n": None}).encode(),
    )
    assert (completion.echo, completion.logprobs, completion.n) == (False, None, 1)
    params = params_of(chat(n=2.0, max_tokens=5.0, seed=3.0))
    assert (params.n, params.max_tokens, params.seed) == (2, 5, 3)
    assert isinstance(params.n, int)


def test_unknown_fields_are_ignored_logged_once_and_counted():
    before = ignored_field_counts()
    name = "x_unknown_field_for_test"
    message = {"role": "user", "content": "hi", "x_message_extra": 1}
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("ray.serve")  # Ray's logger does not propagate to caplog's
    logger.addHandler(handler)
    try:
        for _ in range(3):
            params_of(chat(messages=[message], **{name: {"any": "thing"}}))
    finally:
        logger.removeHandler(handler)
    after = ignored_field_counts()
    assert after[name] - before.get(name, 0) == 3
    assert after["messages[].x_message_extra"] - before.get("messages[].x_message_extra", 0) == 3
    warnings = [r.getMessage() for r in records if name in r.getMessage()]
    assert len(warnings) == (0 if name in before else 1)


def test_logit_bias_prompt_logprobs_and_echo_reach_sampling_params():
    params = params_of(chat(logit_bias={"5": -100, " 7": 2.5}, prompt_logprobs=3))
    assert params.logit_bias == {5: -100.0, 7: 2.5}
    assert params.prompt_logprobs == 3

    def completion(**fields):
        return params_of(json.dumps({"prompt": "x", **fields}).encode(), CompletionRequest)

    # echo with logprobs scores the prompt too (what lm-eval's loglikelihood asks for).
    assert completion(echo=True, logprobs=1).prompt_logprobs == 1
    assert completion(echo=True).prompt_logprobs is None
    assert completion(logprobs=1).prompt_logprobs is None


def test_errors_use_string_or_null_codes_and_name_the_field_sent():
    body = errors.bad_request("nothing to blame").body()["error"]
    assert body["code"] is None
    assert errors.internal("boom").body()["error"]["type"] == "server_error"
    assert errors.unavailable("down").body()["error"]["type"] == "server_error"
    assert APIError(502, "bad gateway").body()["error"]["type"] == "server_error"
    with pytest.raises(APIError) as info:
        params_of(chat(logprobs=True, top_logprobs=21))
    assert info.value.message.startswith("top_logprobs ")
    with pytest.raises(APIError) as info:
        params_of(chat(max_completion_tokens=0))
    assert info.value.message.startswith("max_completion_tokens ")


def test_ignored_fields_are_exported_summed_over_ingress_replicas():
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.metrics_render import render_prometheus
    from cluster.metrics_snapshots import sum_ingress_snapshots

    base = {"model_name": "m", "histograms": {}, "finished_reasons": {}, "router": None}
    total = sum_ingress_snapshots(
        [
            {**base, "ignored_fields": {"foo": 2}},
            {**base, "ignored_fields": {"foo": 1, "messages[].bar": 4}},
            base,  # an ingress from before the field existed
        ]
    )
    text = render_prometheus({}, None, ingress_snapshot=total).decode()
    samples = {
        sample.labels["field"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "prefixserve:request_ignored_fields"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert samples == {"foo": 3.0, "messages[].bar": 4.0}
