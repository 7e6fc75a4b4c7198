"""Anthropic's Messages API (``POST /v1/messages``) on the chat path.

Like the Responses API (``cluster/openai_responses.py``), a Messages request becomes one
chat request (``MessagesRequest.chat_request``), so tools built on Anthropic's SDK reach the
same template, tool calling, stop strings and sampling; the chat output is written back as a
``message`` (``message_object``) or, streamed, as Anthropic's events (``MessageEvents``).

What maps to what:

- ``system`` (a string or text blocks) is the leading system message; ``messages`` alternate
  user and assistant turns whose ``content`` is a string or blocks: ``text``, an assistant's
  ``tool_use`` (a chat tool call, its ``input`` as the arguments) and a user's
  ``tool_result`` (a tool message, placed before that turn's text). Image and document
  blocks are a 400 saying the model takes text only.
- ``tools`` (``name``, ``description``, ``input_schema``) become function tools;
  ``tool_choice`` ``auto``/``any``/``tool``/``none`` become ``auto``/``required``/a named
  function/``none``, ``disable_parallel_tool_use`` one call at most. ``stop_sequences``,
  ``max_tokens`` (required), ``temperature``, ``top_p`` and ``top_k`` carry over.
- The reply's ``content`` is a ``text`` block when the model wrote text and a ``tool_use``
  block per call; ``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` (with
  ``stop_sequence``) or ``tool_use``. ``usage.input_tokens`` counts the prompt tokens not read
  from the prefix cache, ``cache_read_input_tokens`` those that were (Anthropic's split).

How it fails: a malformed block or an unsupported one is a 400 naming it, in OpenAI's error
shape (Anthropic's SDK raises by status code).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from cluster.errors import bad_request
from cluster.openai_protocol import ChatCompletionRequest, Int, _Strict, parse_body
from cluster.responses import ChoiceState


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


class MessagesRequest(_Strict):
    """The fields of ``POST /v1/messages`` this server reads; others are ignored (logged)."""

    model: str | None = None
    max_tokens: Int
    messages: list[dict]
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The one chat request that answers this message."""
        messages = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{i}]")
        if not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
        }
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"], parallel = _chat_tool_choice(self.tool_choice)
            if parallel is False:
                body["parallel_tool_calls"] = False
        raw = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
        return parse_body(ChatCompletionRequest, raw)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of blocks", "messages")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise bad_request(
                f"{where}[{j}] is of type {kind!r}: the served model takes text only", "messages"
            )
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _chat_messages(message: dict, where: str) -> list[dict]:
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be user or assistant", "messages")
    role, content = message["role"], message.get("content", "")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", "messages")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{at}: a tool_use block needs id and name", "messages")
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}: a tool_result block needs tool_use_id", "messages")
            output = block.get("content", "")
            output = output if isinstance(output, str) else _text(output, f"{at}.content")
            results.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": output}
            )
        else:
            raise bad_request(
                f"{at} is of type {kind!r}: served are text, an assistant's tool_use and a "
                "user's tool_result (the served model takes text only)",
                "messages",
            )
    if role == "assistant":
        message = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _chat_tool(tool: dict, index: int) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise bad_request(f"tools[{index}] needs a name", "tools")
    if tool.get("type") not in (None, "custom"):
        raise bad_request(
            f"tools[{index}]: only client tools (name, input_schema) are served, got type "
            f"{tool.get('type')!r}",
            "tools",
        )
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict) -> tuple[str | dict, bool | None]:
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request("tool_choice.type must be auto, any, none or tool (with name)", "tool_choice")


def _usage(chat_usage: dict) -> dict:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": chat_usage["completion_tokens"],
    }


def stop_reason_of(finish_reason: str | None, stop: str | int | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _input_of(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_object(completion: dict, message_id: str, model: str) -> dict:
    """A whole chat completion as Anthropic's ``message``."""
    choice = completion["choices"][0]
    message = choice["message"]
    content = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _input_of(function["arguments"]),
            }
        )
    stop_reason, stop_sequence = stop_reason_of(choice["finish_reason"], choice.get("stop_reason"))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(completion["usage"]),
    }


class MessageEvents:
    """Anthropic's stream from the chat choice's deltas: ``start``, ``feed`` per delta,
    ``finish``. Blocks are sent one after another: a text block is closed before the first
    ``tool_use`` block opens, and each call's arguments arrive as ``input_json_delta``."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._index = -1
        self._open: str | None = None  # "text", or the open call's chat index as a string

    def start(self, num_prompt_tokens: int) -> list[str]:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": num_prompt_tokens, "output_tokens": 0},
        }
        return [_event("message_start", {"message": message})]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": self._index})]

    def feed(self, delta: dict) -> list[str]:
        events = []
        text = delta.get("content")
        if text:
            if self._open != "text":
                events += self._close()
                self._index += 1
                self._open = "text"
                block = {"type": "text", "text": ""}
                events.append(
                    _event("content_block_start", {"index": self._index, "content_block": block})
                )
            piece = {"type": "text_delta", "text": text}
            events.append(_event("content_block_delta", {"index": self._index, "delta": piece}))
        for call in delta.get("tool_calls") or []:
            key = f"call{call['index']}"
            function = call.get("function") or {}
            if self._open != key:
                events += self._close()
                self._index += 1
                self._open = key
                block = {
                    "type": "tool_use",
                    "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                    "name": function.get("name") or "",
                    "input": {},
                }
                events.append(
                    _event("content_block_start", {"index": self._index, "content_block": block})
                )
            if function.get("arguments"):
                piece = {"type": "input_json_delta", "partial_json": function["arguments"]}
                events.append(_event("content_block_delta", {"index": self._index, "delta": piece}))
        return events

    def finish(
        self, state: ChoiceState | None, finish_reason: str | None, usage: dict
    ) -> list[str]:
        stop_reason, stop_sequence = stop_reason_of(
            finish_reason, state.stop_reason if state is not None else None
        )
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return [
            *self._close(),
            _event("message_delta", {"delta": delta, "usage": _usage(usage)}),
            _event("message_stop", {}),
        ]
