"""The model's tokenizer, its chat template, and incremental detokenisation with stop strings.

``chat_template`` (``--chat-template``) replaces the model's template: ``read_chat_template``
takes a file (a ``.jinja`` file, or a ``.json`` holding ``{"chat_template": ...}``) or the
template itself, and checks that Jinja parses it, so a broken template fails at start-up
with a ``ValueError`` naming the field rather than on every request.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas. It decodes a
short window of recent tokens (not the whole output each step), never emits half a
multi-byte character (a trailing U+FFFD means "wait for the next token"), and holds back the
last ``len(longest stop string) - 1`` characters so a stop string that spans tokens is never
partly streamed before it is recognised.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

_REPLACEMENT_CHAR = "\ufffd"
_PREFIX_WINDOW_TOKENS = 6
"""Tokens of left context decoded with the new ones, so merges at the boundary are right."""
_RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "messages",
        "conversation",
        "add_generation_prompt",
        "tools",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "documents",
        "continue_final_message",
        "tokenizer_kwargs",
    }
)
"""Arguments of transformers' ``apply_chat_template`` that ``chat_template_kwargs`` must
not override."""


def read_chat_template(value: str) -> str:
    """The Jinja source ``--chat-template`` names: a file's contents or the value itself."""
    path = Path(value)
    is_inline = "{{" in value or "{%" in value
    if not is_inline and path.is_file():
        text = path.read_text()
        if path.suffix == ".json":
            try:
                text = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"EngineConfig.chat_template: {value} is JSON without a 'chat_template' string"
                ) from None
    elif is_inline:
        text = value
    else:
        raise ValueError(
            f"EngineConfig.chat_template: {value!r} is neither a file nor a Jinja template"
        )
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"EngineConfig.chat_template: {value!r} holds an empty template")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            "EngineConfig.chat_template: not a valid Jinja template "
            f"(line {exc.lineno}: {exc.message})"
        ) from None
    return text


class Tokenizer:
    def __init__(self, path: str, chat_template: str | None = None):
        """``chat_template``: Jinja source replacing the model's own (``read_chat_template``)."""
        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path)
        if chat_template is not None:
            self._tok.chat_template = chat_template
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        self.eos_token_ids: set[int] = {eos} if isinstance(eos, int) else set(eos or [])
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        backend = getattr(self._tok, "backend_tokenizer", None)
        self._backend_decode = (
            backend.decode
            if backend is not None and not getattr(self._tok, "clean_up_tokenization_spaces", True)
            else None
        )
        """The Rust tokenizer's own ``decode``, where transformers' wrapper would only add its
        argument handling (no space clean-up to apply): the detokenizer decodes twice per
        output token, and the wrapper doubles what that costs."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds (BOS)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation; ``tools`` (OpenAI tool definitions) go to
        the template as transformers passes them (a template may ignore them), and so do
        ``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``), except the names the
        call itself sets (a ``ValueError``)."""
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_ARGS & extra.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            if not isinstance(m.get("content", ""), str):
                raise ValueError(f"messages[{i}].content must be a string")
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        text = self._tok.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            tokenize=False,
            **extra,
        )
        return self.encode(text)


class IncrementalDetokenizer:
    """Text deltas for one output sequence, with stop strings checked across token edges."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self._tok = tokenizer
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        self._holdback_chars = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = list(prompt_token_ids[-_PREFIX_WINDOW_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        """All decoded text so far, including any held-back tail."""
        self._emitted = 0
        self.stop_reason: str | None = None

    def add_token(self, token_id: int) -> None:
        """Decode one more token; sets ``stop_reason`` when a stop string appears."""
        if self.stop_reason is not None:
            return
        self._ids.append(token_id)
        prefix = self._tok.decode(
            self._ids[self._prefix_offset : self._read_offset], self._skip_special
        )
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip_special)
        if full.endswith(_REPLACEMENT_CHAR) or len(full) <= len(prefix):
            return  # an incomplete character (or nothing visible yet): wait for more bytes
        start = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._check_stop(start)

    def _check_stop(self, new_start: int) -> None:
        window_start = max(0, new_start - self._holdback_chars)
        for s in self._stop:
            idx = self.text.find(s, window_start)
            if idx != -1:
                self.stop_reason = s
                self.text = self.text[: idx + len(s)] if self._include_stop else self.text[:idx]
                return

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; keeps the possible start of a stop string unless finished."""
        end = (
            len(self.text)
            if finished or self.stop_reason
            else len(self.text) - self._holdback_chars
        )
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
