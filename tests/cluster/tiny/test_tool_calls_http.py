"""Tool calling through the HTTP API of the shared tiny cluster (random weights, hermes format,
``auto`` enabled), with the official ``openai`` client and langchain-openai's ``bind_tools``.

A random-weight model is a model at its worst: with ``required`` or a named function only the
grammar stands between it and garbage, so every call must still parse and match its schema,
streamed or not.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_call(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed(client, model, **kw) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) accumulated from the stream as a client does."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function"
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_calls_are_valid_every_time_streamed_or_not(client, model, tool_choice, seed):
    choice = NAMED if tool_choice == "named" else "required"
    allowed = {"get_weather"} if tool_choice == "named" else set(SCHEMAS)
    kw = dict(
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=1.0,
        seed=seed,
    )
    whole = client.chat.completions.create(model=model, **kw)
    choice0 = whole.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    assert choice0.message.content is None
    (call,) = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments, allowed)

    content, calls, finish = streamed(client, model, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)  # same seed, same tokens
    ]


def test_parallel_required_calls_each_valid(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=256,
        temperature=1.0,
        seed=7,
    )
    choice = response.choices[0]
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason in ("tool_calls", "length")
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    for call in complete:
        check_call(call.function.name, call.function.arguments, set(SCHEMAS))
    assert len({call.id for call in calls}) == len(calls)


def test_auto_none_and_history_with_tool_results(client, model):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "Sunny, 24 C"},
    ]
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    none = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    auto = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=16, temperature=0
    )
    # `none` leaves the prompt alone; the model's template ignores tools, so with `auto` they
    # and the earlier call and its result are written into the messages it renders.
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    message = auto.choices[0].message
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert message.content is not None or message.tool_calls


def test_tool_errors_are_400s_naming_the_field(tiny_server, model):
    def post(**body):
        return httpx.post(
            f"{tiny_server.url}/v1/chat/completions",
            json={"model": model, "messages": MESSAGES, "max_tokens": 4, **body},
            headers=tiny_server.headers,
            timeout=60,
        )

    cases = [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ]
    for body, param in cases:
        response = post(**body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text
    assert post().status_code == 200


def test_langchain_bind_tools_named_and_streamed(tiny_server, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=model,
        base_url=f"{tiny_server.url}/v1",
        api_key=tiny_server.api_key,
        max_tokens=96,
        temperature=1.0,
        max_retries=0,
        seed=5,
    )
    bound = llm.bind_tools(TOOLS, tool_choice="get_weather")
    message = bound.invoke("What is the weather in Rome?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER_PARAMETERS)

    merged = None
    for chunk in bound.stream("What is the weather in Rome?"):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]
    assert merged.tool_calls[0]["args"] == call["args"]  # same seed, same call
