"""Tool-call parsers: model text in, content and ``tool_calls`` out, streamed or whole.

Two formats, named as vLLM's ``--tool-call-parser`` names them:

- ``hermes`` (Hermes, Qwen2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call; text before the first block is content.
- ``llama3_json`` (Llama 3.1/3.2): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several calls separated by ``;``. An output that
  does not start with ``{`` is plain content.

Both accept ``arguments`` or ``parameters`` as the arguments key. One state machine per choice
(``ToolCallStream``) serves streaming and whole responses alike (a whole response is one
``feed`` and ``finish``), so both shapes give the same calls. Per ``feed`` it returns the new
content and ``ToolCallDelta``s in OpenAI's streaming order: a call's id, type and name first
(as soon as the name is complete), then its arguments text piece by piece as the model writes
it. Text that might still become a tag is held back until it cannot.

How it fails: a block whose name never completes (garbage, or cut off) is handed back as
content; a call whose arguments are cut off (``max_tokens``) or malformed keeps the text
written so far, as OpenAI's own calls may hold invalid JSON. Nothing here raises on model
output. Content after the first call is dropped (as vLLM does); with ``max_calls`` set,
calls past it are dropped too (``parallel_tool_calls: false``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One streamed piece of one call: the header (id, name) once, then argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class _CallScanner:
    """Scans one ``{"name": ..., "arguments": ...}`` object a character at a time.

    Reports the name once its string is complete and the arguments value's raw text as it
    goes; ``done`` once the outer object closes, ``failed`` on text that cannot be one.
    """

    def __init__(self) -> None:
        self.state = "start"  # start, key, in_key, colon, value, in_value, comma, done, failed
        self.key_chars: list[str] = []
        self.key: str | None = None
        self.value_chars: list[str] = []
        self.value_kind: str | None = None  # "string", "container" or "scalar"
        self.nesting = 0
        self.in_string = False
        self.escaped = False
        self.name: str | None = None
        self.args_key: str | None = None

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    def feed(self, text: str) -> tuple[int, str | None, str]:
        """Consumes ``text`` up to the end of the object: (chars used, name if completed now,
        new arguments text)."""
        new_name = None
        args: list[str] = []
        i = 0
        while i < len(text) and self.state not in ("done", "failed"):
            c = text[i]
            i += 1
            state = self.state
            if state == "in_value":
                ended, reprocess = self._value_char(c)
                if reprocess:
                    i -= 1
                elif self.key == self.args_key:
                    args.append(c)
                if ended:
                    value = "".join(self.value_chars)
                    if self.key == "name":
                        try:
                            name = json.loads(value)
                        except ValueError:
                            name = None
                        if not isinstance(name, str) or self.name is not None:
                            self.state = "failed"
                            continue
                        self.name = new_name = name
                    self.state = "comma"
            elif c in _WHITESPACE and state not in ("in_key",):
                continue
            elif state == "start":
                self.state = "key" if c == "{" else "failed"
            elif state == "key":
                if c == '"':
                    self.key_chars, self.state = [], "in_key"
                else:
                    self.state = "done" if c == "}" and self.key is None else "failed"
            elif state == "in_key":
                if self.escaped:
                    self.escaped = False
                    self.key_chars.append(c)
                elif c == "\\":
                    self.escaped = True
                    self.key_chars.append(c)
                elif c == '"':
                    self.key = json.loads('"' + "".join(self.key_chars) + '"')
                    if self.key in ARGUMENT_KEYS and self.args_key is None:
                        self.args_key = self.key
                    self.state = "colon"
                else:
                    self.key_chars.append(c)
            elif state == "colon":
                self.state = "value" if c == ":" else "failed"
            elif state == "value":
                self.value_chars = [c]
                self.nesting, self.in_string, self.escaped = 0, False, False
                if c == '"':
                    self.value_kind = "string"
                elif c in "{[":
                    self.value_kind, self.nesting = "container", 1
                else:
                    self.value_kind = "scalar"
                self.state = "in_value"
                if self.key == self.args_key:
                    args.append(c)
            elif state == "comma":
                if c == ",":
                    self.state = "key"
                elif c == "}":
                    self.state = "done"
                else:
                    self.state = "failed"
        return i, new_name, "".join(args)

    def _value_char(self, c: str) -> tuple[bool, bool]:
        """Adds ``c`` to the value: (value ended, ``c`` is not part of it)."""
        kind = self.value_kind
        if kind == "scalar":
            if c in ",}" or c in _WHITESPACE:
                return True, True
            self.value_chars.append(c)
            return False, False
        self.value_chars.append(c)
        if kind == "string":
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                return True, False
            return False, False
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.nesting += 1
        elif c in "}]":
            self.nesting -= 1
            return self.nesting == 0, False
        return False, False


@dataclass
class _OpenCall:
    scanner: _CallScanner = field(default_factory=_CallScanner)
    raw: list[str] = field(default_factory=list)
    index: int | None = None
    """The call's index in ``tool_calls`` once its name is known (None: not a call yet)."""
    pending_args: list[str] = field(default_factory=list)
    """Arguments text seen before the name (a model that writes them first)."""
    num_args_chars: int = 0


class ToolCallStream:
    """The per-choice state machine shared by the formats: content, then calls."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[ParsedToolCall] = []
        self._content: list[str] = []
        self._held_whitespace = ""
        self._call: _OpenCall | None = None
        self._deltas: list[ToolCallDelta] = []
        self._buffer = ""
        """Model text fed but not yet decided (a tag may be starting)."""

    # ---- what the formats call ----------------------------------------------------------
    def _emit_content(self, text: str) -> None:
        if not text or self.calls:
            return  # content after the first call is dropped
        text = self._held_whitespace + text
        stripped = text.rstrip(_WHITESPACE)
        self._held_whitespace = text[len(stripped) :]
        if stripped:
            self._content.append(stripped)

    def _open_call(self) -> None:
        self._call = _OpenCall()

    def _feed_call(self, text: str) -> int:
        """Feeds the open call; returns the characters its JSON object used."""
        call = self._call
        used, name, args = call.scanner.feed(text)
        call.raw.append(text[:used])
        if name is not None and call.index is None:
            if self.max_calls is None or len(self.calls) < self.max_calls:
                call.index = len(self.calls)
                parsed = ParsedToolCall(new_call_id(), name, "")
                self.calls.append(parsed)
                self._held_whitespace = ""
                self._deltas.append(ToolCallDelta(call.index, id=parsed.id, name=name))
            else:
                call.index = -1  # a call past max_calls: parsed, then dropped
        if args:
            call.pending_args.append(args)
        if call.index is not None and call.index >= 0 and call.pending_args:
            piece = "".join(call.pending_args)
            call.pending_args.clear()
            call.num_args_chars += len(piece)
            self.calls[call.index].arguments += piece
            self._deltas.append(ToolCallDelta(call.index, arguments=piece))
        return used

    def _close_call(self, wrapper: tuple[str, str] = ("", "")) -> bool:
        """Ends the open call; a call without a name goes back as content (wrapped as it was
        written). Returns whether it was a call."""
        call, self._call = self._call, None
        if call.index is None:
            self._emit_content(wrapper[0] + "".join(call.raw) + wrapper[1])
            return False
        if call.index >= 0 and call.num_args_chars == 0:
            self.calls[call.index].arguments = "{}"
            self._deltas.append(ToolCallDelta(call.index, arguments="{}"))
        return True

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, self._content = "".join(self._content), []
        deltas, self._deltas = self._deltas, []
        return content, deltas

    # ---- what the formats define --------------------------------------------------------
    UNCLOSED_WRAPPER: tuple[str, str] = ("", "")
    """How a call still open at the end was written around its JSON, should it go back as
    content."""

    def _drain(self, final: bool) -> None:
        """Consumes ``self._buffer`` as far as it can be decided (all of it when ``final``)."""
        raise NotImplementedError

    def _tail_is_content(self) -> bool:
        """Whether text left in the buffer at the end is content (rather than dropped)."""
        return True

    # ---- the interface ------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New model text in; (new content, new call deltas) out."""
        self._buffer += text
        self._drain(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: flushes what was held back and closes an open call."""
        self._drain(final=True)
        if self._call is not None:
            self._close_call(self.UNCLOSED_WRAPPER)
        if self._tail_is_content():
            self._emit_content(self._buffer)
        self._buffer = ""
        if not self.calls:
            self._content.append(self._held_whitespace)
            self._held_whitespace = ""
        return self._take()

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """A whole output: (content, calls); content is None when there are calls and no text."""
        content, _ = self.feed(text)
        rest, _ = self.finish()
        content += rest
        if self.calls and not content:
            return None, self.calls
        return content, self.calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesStream(ToolCallStream):
    START = "<tool_call>"
    END = "</tool_call>"
    UNCLOSED_WRAPPER = (START, "")

    def _drain(self, final: bool) -> None:
        while self._buffer:
            buffer = self._buffer
            tag = self.END if self._call is not None else self.START
            at = buffer.find(tag)
            if at >= 0:
                body, self._buffer = buffer[:at], buffer[at + len(tag) :]
            else:
                keep = 0 if final else _partial_suffix(buffer, tag)
                body, self._buffer = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
            if self._call is None:
                self._emit_content(body)
                if at >= 0:
                    self._open_call()
            else:
                if not self._call.scanner.done:
                    used = self._feed_call(body)
                    self._call.raw.append(body[used:])
                else:
                    self._call.raw.append(body)
                if at >= 0:
                    self._close_call((self.START, self.END))
            if at < 0:
                return


class Llama3JsonStream(ToolCallStream):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._mode: str | None = None  # None (undecided), "content", "calls", "ended"

    def _tail_is_content(self) -> bool:
        return self._mode in (None, "content")

    def _drain(self, final: bool) -> None:
        if self._mode is None:
            head = self._buffer.lstrip(_WHITESPACE)
            if not head:
                return
            if head.startswith(self.PYTHON_TAG):
                self._mode, self._buffer = "calls", head[len(self.PYTHON_TAG) :]
            elif head.startswith("{"):
                self._mode, self._buffer = "calls", head
            elif self.PYTHON_TAG.startswith(head) and not final:
                return
            else:
                self._mode = "content"
        if self._mode == "content":
            self._emit_content(self._buffer)
            self._buffer = ""
            return
        while self._mode == "calls" and self._buffer:
            if self._call is None:
                rest = self._buffer.lstrip(_WHITESPACE + ";")
                self._buffer = rest
                if not rest:
                    return
                if rest[0] != "{":
                    self._mode = "ended"  # trailing text after the calls: dropped
                    return
                self._open_call()
            used = self._feed_call(self._buffer)
            self._buffer = self._buffer[used:]
            scanner = self._call.scanner
            if not (scanner.done or scanner.failed):
                return
            was_call = self._close_call()
            if not was_call and not self.calls:
                self._mode = "content"  # not calls after all: the text is the answer
                self._emit_content(self._buffer)
                self._buffer = ""
            elif scanner.failed:
                self._mode = "ended"


TOOL_CALL_STREAMS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
}
