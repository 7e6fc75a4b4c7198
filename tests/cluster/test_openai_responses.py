"""The Responses API's mapping onto the chat path, without Ray: requests to chat requests,
chat output to response objects and streamed events, and the response store."""

from __future__ import annotations

import json

import pytest

from cluster.errors import APIError
from cluster.openai_protocol import parse_body
from cluster.openai_responses import (
    ResponseEvents,
    ResponsesRequest,
    output_messages,
    output_of_chat,
    response_object,
)
from cluster.response_store import ResponseStore, tenant_of


def request(**fields) -> ResponsesRequest:
    return parse_body(ResponsesRequest, json.dumps({"model": "m", **fields}).encode())


def chat_of(req: ResponsesRequest, history=(), stream=False) -> dict:
    return req.chat_request(list(history), stream=stream).model_dump(exclude_none=True)


def decode(events: list[str]) -> list[dict]:
    return [json.loads(e[len("data: ") :]) for e in events]


def test_a_string_input_is_one_user_message_after_the_instructions():
    chat = chat_of(request(input="Hi", instructions="Be brief.", max_output_tokens=7))
    assert [(m["role"], m["content"]) for m in chat["messages"]] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    assert chat["max_tokens"] == 7


def test_items_become_messages_with_calls_and_their_outputs():
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather in "},
                {"type": "input_text", "text": "Rome?"},
            ],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city":"Rome"}',
        },
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": {"hour": 9}},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sunny."}],
        },
    ]
    messages = chat_of(request(input=items))["messages"]
    assert messages[0] == {"role": "user", "content": "Weather in Rome?"}
    assert messages[1]["role"] == "assistant"
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]  # one message, two calls
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert messages[3]["content"] == '{"hour": 9}'
    assert messages[4] == {"role": "assistant", "content": "Sunny."}


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "text only",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning'"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": []}, "must not be empty"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(fields, fragment):
    with pytest.raises(APIError) as info:
        chat_of(request(**fields))
    assert info.value.status == 400 and fragment in info.value.body()["error"]["message"]


def test_tools_choice_and_format_become_the_chat_requests():
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {}},
    }
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_of(
        request(
            input="x",
            tools=[tool],
            tool_choice={"type": "function", "name": "get_weather"},
            text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        )
    )
    assert chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["tool_choice"]["function"]["name"] == "get_weather"
    assert chat["response_format"]["json_schema"] == {"name": "answer", "schema": schema}


def test_a_stored_conversation_goes_before_the_new_input():
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one"}]
    chat = chat_of(request(input="second", instructions="New rules."), history)
    assert [m["content"] for m in chat["messages"]] == ["New rules.", "first", "one", "second"]


def test_a_chat_completion_becomes_output_items_and_usage():
    completion = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    output, finish = output_of_chat(completion)
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[0]["content"][0] == {
        "type": "output_text",
        "text": "Let me check.",
        "annotations": [],
    }
    assert output[1]["call_id"] == "call_1" and output[1]["name"] == "f"
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    body = response_object(request(input="x"), "resp_1", "m", 0, output, finish, usage)
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 8
    assert body["usage"]["total_tokens"] == 14
    cut = response_object(request(input="x"), "resp_2", "m", 0, output, "length", usage)
    assert (
        cut["status"] == "incomplete" and cut["incomplete_details"]["reason"] == "max_output_tokens"
    )
    # What a follow-up sees of this response: its text and its call, as chat messages.
    follow = output_messages(output)
    assert follow[0] == {"role": "assistant", "content": "Let me check."}
    assert follow[1]["tool_calls"][0]["id"] == "call_1"


def test_streamed_events_build_the_items_the_final_response_holds():
    stream = ResponseEvents(request(input="x", stream=True), "resp_1", "m")
    events = decode(stream.start())
    events += decode(stream.feed({"content": "Hel"}))
    events += decode(stream.feed({"content": "lo"}))
    call = {
        "index": 0,
        "id": "call_9",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    events += decode(stream.feed({"tool_calls": [call]}))
    events += decode(
        stream.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]})
    )
    events += decode(stream.feed({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}))
    events += decode(stream.finish("stop", {"prompt_tokens": 3, "completion_tokens": 5}))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    message, function_call = final["output"]
    assert message["content"][0]["text"] == "Hello"
    assert events[2]["item"]["id"] == message["id"]  # the streamed id is the final one
    assert function_call["arguments"] == '{"a":1}' and function_call["call_id"] == "call_9"
    assert final["usage"]["output_tokens"] == 5
    cut = ResponseEvents(request(input="x", stream=True), "resp_2", "m")
    cut.start()
    assert decode(cut.finish("length", {"prompt_tokens": 1, "completion_tokens": 1}))[-1][
        "type"
    ] == ("response.incomplete")


def test_the_store_keeps_tenants_apart_bounded_and_for_a_while(monkeypatch):
    import cluster.response_store as module

    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_entries=2, ttl_s=60.0)
    alice, bob = tenant_of("Bearer a"), tenant_of("Bearer b")
    assert alice != bob and tenant_of(None) == ""
    store.put(alice, "r1", [{"role": "user", "content": "1"}])
    assert store.get(alice, "r1") == [{"role": "user", "content": "1"}]
    assert store.get(bob, "r1") is None  # another key never sees it
    store.put(alice, "r2", [])
    store.put(alice, "r3", [])
    assert store.get(alice, "r1") is None and len(store) == 2  # the oldest went first
    now[0] += 61.0
    assert store.get(alice, "r3") is None and len(store) == 0  # expired
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)
