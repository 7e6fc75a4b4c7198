"""Anthropic's Messages API mapped onto the chat path, without Ray: requests to chat
requests, chat output to messages and to Anthropic's stream events."""

from __future__ import annotations

import json

import pytest

from cluster.anthropic_messages import MessageEvents, MessagesRequest, message_object
from cluster.errors import APIError
from cluster.openai_protocol import parse_body


def request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    return parse_body(MessagesRequest, json.dumps({**body, **fields}).encode())


def chat_of(req: MessagesRequest) -> dict:
    return req.chat_request().model_dump(exclude_none=True)


def decode(events: list[str]) -> list[tuple[str, dict]]:
    out = []
    for event in events:
        kind_line, data_line = event.strip().split("\n")
        out.append((kind_line[len("event: ") :], json.loads(data_line[len("data: ") :])))
    return out


def test_system_turns_and_sampling_fields_carry_over():
    chat = chat_of(
        request(
            system=[{"type": "text", "text": "Be brief."}],
            stop_sequences=["END"],
            temperature=0.5,
            top_k=5,
            max_tokens=9,
        )
    )
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][1] == {"role": "user", "content": "Hi"}
    assert (chat["stop"], chat["temperature"], chat["top_k"], chat["max_tokens"]) == (
        ["END"],
        0.5,
        5,
        9,
    )


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages():
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Rome"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    tools = [
        {
            "name": "get_weather",
            "description": "d",
            "input_schema": {"type": "object", "properties": {}},
        }
    ]
    chat = chat_of(
        request(
            messages=messages,
            tools=tools,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )
    )
    assistant, tool, user = chat["messages"][1:]
    assert assistant["content"] == "Checking."
    assert assistant["tool_calls"][0]["id"] == "toolu_1"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"}
    assert user == {"role": "user", "content": "And tomorrow?"}
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    named = chat_of(request(tools=tools, tool_choice={"type": "tool", "name": "get_weather"}))
    assert named["tool_choice"]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "text only",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "user or assistant"),
        ({"messages": []}, "non-empty"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(fields, fragment):
    with pytest.raises(APIError) as info:
        chat_of(request(**fields))
    assert info.value.status == 400 and fragment in info.value.body()["error"]["message"]


def test_max_tokens_is_required():
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    with pytest.raises(APIError) as info:
        parse_body(MessagesRequest, raw)
    assert info.value.param == "max_tokens"


def completion(content, calls=(), finish="stop", stop=None, cached=4):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return {
        "choices": [{"message": message, "finish_reason": finish, "stop_reason": stop}],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def test_a_chat_completion_becomes_a_message():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    reply = message_object(completion("Sure.", [call], finish="tool_calls"), "msg_1", "m")
    assert reply["content"] == [
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
    ]
    assert reply["stop_reason"] == "tool_use"
    assert reply["usage"] == {
        "input_tokens": 6,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
        "output_tokens": 3,
    }
    assert (
        message_object(completion("x", finish="length"), "m2", "m")["stop_reason"] == "max_tokens"
    )
    stopped = message_object(completion("x", stop="END"), "m3", "m")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    assert message_object(completion("x"), "m4", "m")["stop_reason"] == "end_turn"


def test_stream_events_open_and_close_one_block_at_a_time():
    stream = MessageEvents("msg_1", "m")
    events = decode(stream.start(10))
    events += decode(stream.feed({"content": "Let me "}))
    events += decode(stream.feed({"content": "check."}))
    call = {
        "index": 0,
        "id": "call_7",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    events += decode(stream.feed({"tool_calls": [call]}))
    events += decode(
        stream.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":1}'}}]})
    )
    usage = {"prompt_tokens": 10, "completion_tokens": 5}
    events += decode(stream.finish(None, "tool_calls", usage))
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(payload["type"] == kind for kind, payload in events)
    assert events[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_7",
        "name": "f",
        "input": {},
    }
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a":1}'}
    assert [payload["index"] for _, payload in events[1:8]] == [0, 0, 0, 0, 1, 1, 1]
    assert events[8][1]["delta"]["stop_reason"] == "tool_use"
    assert events[8][1]["usage"]["output_tokens"] == 5
