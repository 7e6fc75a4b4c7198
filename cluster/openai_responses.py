"""OpenAI's Responses API (``POST /v1/responses``) on the chat path.

A Responses request is turned into one chat request (``ResponsesRequest.chat_request``), so
the chat template, tool calling (parsers and forced-call grammars), structured outputs and
sampling are the chat endpoint's own; the chat output is then written as a ``response``
object (``response_object``) or, streamed, as Responses events (``ResponseEvents``).

What maps to what:

- ``input``: a string (one user message) or items: messages (``role`` user, system, developer
  or assistant; ``content`` a string or ``input_text``/``output_text`` parts), ``function_call``
  items (an assistant message's tool calls; consecutive ones form one message) and
  ``function_call_output`` items (tool messages). ``instructions`` is a leading system
  message and is not carried to a follow-up; ``previous_response_id`` puts the stored
  conversation (its input and output, without its instructions) before ``input``.
- ``tools`` (function tools), ``tool_choice`` and ``parallel_tool_calls`` become the chat
  request's; other tool types are a 400. ``text.format`` becomes ``response_format``;
  ``max_output_tokens`` the token limit.
- The output is a ``message`` item (``output_text`` content) when the model wrote text and a
  ``function_call`` item per call; a response cut by the token limit has status
  ``incomplete`` (reason ``max_output_tokens``). ``usage`` counts input tokens (with
  ``cached_tokens`` from the prefix cache) and output tokens.

How it fails: a malformed item, an unsupported content part or tool type is a 400 naming
the field; an unknown ``previous_response_id`` a 404 (``cluster/response_store.py`` keeps
responses, bounded and for a limited time).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from cluster.errors import bad_request
from cluster.openai_protocol import ChatCompletionRequest, Int, _Strict, parse_body
from cluster.responses import sse_event


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(_Strict):
    """The fields of ``POST /v1/responses`` this server reads; others are ignored (logged)."""

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: Int | None = None

    def chat_request(self, history: list[dict], stream: bool) -> ChatCompletionRequest:
        """The one chat request that answers this response: ``history`` (a stored
        conversation) then ``input``, after ``instructions``."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += history + self.input_messages()
        if not messages:
            raise bad_request("input must not be empty", "input")
        body: dict[str, Any] = {
            "messages": messages,
            "stream": stream,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = self.response_format()
        if response_format is not None:
            body["response_format"] = response_format
        if stream:
            body["stream_options"] = {"include_usage": True}
        raw = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
        return parse_body(ChatCompletionRequest, raw)

    def input_messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input, "input")

    def response_format(self) -> dict | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise bad_request("text.format must be an object", "text")
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise bad_request("text.format.schema must be an object for json_schema", "text")
            inner = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
            return {"type": "json_schema", "json_schema": inner}
        raise bad_request(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "text",
        )


def _chat_tool(tool: dict, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise bad_request(
            f"tools[{index}]: only function tools are served, got type {kind!r}", "tools"
        )
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"tools[{index}].name must be a non-empty string", "tools")
    function = {"name": tool["name"]}
    for key in ("description", "parameters"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        "tool_choice",
    )


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad_request(
                f"{where}.content[{j}] is of type {kind!r}: the served model takes text only "
                "(parts of type 'input_text' or 'output_text')",
                "input",
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def items_to_messages(items: list[dict], field: str) -> list[dict]:
    """Chat messages of Responses input items (see the module docstring)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role must be user, system, developer or assistant", "input"
                )
            messages.append({"role": role, "content": _text_of(item.get("content", ""), where)})
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id") or item.get("id") or ""),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if not call["id"] or not isinstance(call["function"]["name"], str):
                raise bad_request(f"{where}: a function_call needs call_id and name", "input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}: a function_call_output needs call_id", "input")
            output = item.get("output", "")
            if not isinstance(output, str):
                output = json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise bad_request(
                f"{where} is of type {kind!r}; served: message, function_call, "
                "function_call_output",
                "input",
            )
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as chat messages, for the stored conversation."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"role": "assistant", "content": item["content"]})
        else:
            items.append(item)
    return items_to_messages(items, "output")


def _usage(chat_usage: dict) -> dict:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"],
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status="completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    req: ResponsesRequest,
    response_id: str,
    model: str,
    created_at: int,
    output: list[dict],
    finish_reason: str | None,
    chat_usage: dict | None,
    status: str | None = None,
) -> dict:
    """The ``response`` object; ``status`` defaults from ``finish_reason``."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": _usage(chat_usage) if chat_usage is not None else None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def output_of_chat(completion: dict) -> tuple[list[dict], str | None]:
    """A whole chat completion's choice as Responses output items, and its finish reason."""
    choice = completion["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content"):
        output.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
    return output, choice["finish_reason"]


class ResponseEvents:
    """Responses streaming events from the chat choice's deltas: ``start`` once, ``feed`` per
    delta (content and tool-call pieces), ``finish`` with the usage at the end. Every event
    carries ``type`` and ``sequence_number``; the last is ``response.completed`` (or
    ``response.incomplete``) with the whole response, whose items carry the streamed ids."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.response_id = response_id
        self.model = model
        self.created_at = int(time.time())
        self._seq = 0
        self._items: list[dict] = []  # output items in order, as they stand
        self._message: dict | None = None
        self._calls: dict[int, dict] = {}  # tool-call index -> its item

    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(event)

    def _snapshot(self, status: str, usage: dict | None = None, finish=None) -> dict:
        return response_object(
            self.req,
            self.response_id,
            self.model,
            self.created_at,
            [dict(item) for item in self._items],
            finish,
            usage,
            status=status,
        )

    def start(self) -> list[str]:
        snapshot = self._snapshot("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, delta: dict) -> list[str]:
        events = []
        text = delta.get("content")
        if text:
            if self._message is None:
                self._message = message_item(new_id("msg"), "", status="in_progress")
                self._items.append(self._message)
                index = len(self._items) - 1
                events.append(
                    self._event(
                        "response.output_item.added", output_index=index, item=self._message
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=self._message["id"],
                        output_index=index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                )
            self._message["content"][0]["text"] += text
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._message["id"],
                    output_index=self._items.index(self._message),
                    content_index=0,
                    delta=text,
                )
            )
        for call in delta.get("tool_calls") or []:
            events += self._feed_call(call)
        return events

    def _feed_call(self, call: dict) -> list[str]:
        events = []
        item = self._calls.get(call["index"])
        function = call.get("function") or {}
        if item is None:
            item = call_item(
                new_id("fc"),
                call.get("id") or new_id("call"),
                function.get("name") or "",
                "",
                status="in_progress",
            )
            self._calls[call["index"]] = item
            self._items.append(item)
            events.append(
                self._event(
                    "response.output_item.added", output_index=len(self._items) - 1, item=item
                )
            )
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._items.index(item),
                    delta=piece,
                )
            )
        return events

    def finish(self, finish_reason: str | None, chat_usage: dict) -> list[str]:
        events = []
        for index, item in enumerate(self._items):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                events.append(
                    self._event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                )
            else:
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                    )
                )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        status = "incomplete" if finish_reason == "length" else "completed"
        self.final = self._snapshot(status, chat_usage, finish_reason)
        events.append(self._event(f"response.{status}", response=self.final))
        return events

    @property
    def output(self) -> list[dict]:
        return self._items
