"""The model's tokenizer, its chat template, and incremental detokenisation with stop strings.

``chat_template`` (``--chat-template``) replaces the model's template: ``read_chat_template``
takes a file (a ``.jinja`` file, or a ``.json`` holding ``{"chat_template": ...}``) or the
template itself, and checks that Jinja parses it, so a broken template fails at start-up
with a ``ValueError`` naming the field rather than on every request.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas. It never
emits half a multi-byte character (a trailing U+FFFD means "wait for the next token"), and
holds back the last ``len(longest stop string) - 1`` characters so a stop string that spans
tokens is never partly streamed before it is recognised. Two ways to decode, the same text:

- byte-level BPE tokenizers (GPT-2's scheme: SmolLM2, Llama 3, Qwen) whose decoder is
  ``ByteLevel`` alone: each token is a fixed byte string (``Tokenizer.token_bytes``, built
  once), fed to an incremental UTF-8 decoder: a table lookup per token, no tokenizer call;
- any other tokenizer: a short window of recent tokens decoded twice per token (with and
  without the new one), the difference being the new text.
"""

from __future__ import annotations

import codecs
import functools
import importlib
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
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


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted: the character a byte-level BPE vocabulary
    writes for each byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def byte_level_table(backend) -> list[bytes] | None:
    """Each token id's bytes under a ``ByteLevel`` decoder, as the Rust decoder makes them
    (a token with a character outside the byte map is its own UTF-8); None when the
    tokenizer's decoder is anything else."""
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    chars = _byte_level_chars()
    to_bytes = str.maketrans({c: chr(b) for c, b in chars.items()})
    outside = re.compile("[^" + re.escape("".join(chars)) + "]")
    table = [b""] * backend.get_vocab_size(with_added_tokens=True)
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if outside.search(token):
            table[token_id] = token.encode()
        else:
            table[token_id] = token.translate(to_bytes).encode("latin-1")
    return table


def load_backend(path: str, backend_class: str | None = None):
    """transformers' tokenizer for the folder ``path``: of the class ``backend_class`` names
    (``module:QualName``, what ``Tokenizer.backend_class`` reports) when it is one of
    transformers' own, else whatever ``AutoTokenizer`` picks.

    ``AutoTokenizer`` reads the model's config to choose, which imports torch (seconds of CPU
    and a few hundred MB); a process that only tokenizes (the ingress) is told the class the
    engine's ``AutoTokenizer`` chose and loads it directly, the same way, without torch. A class
    this process's transformers lacks (another version than the engine's) falls back too."""
    if backend_class is not None:
        module_name, _, qualname = backend_class.partition(":")
        if module_name.startswith("transformers.") and qualname and "." not in qualname:
            try:
                cls = getattr(importlib.import_module(module_name), qualname)
            except (ImportError, AttributeError):
                log.warning("tokenizer class %s not found here; using AutoTokenizer", backend_class)
            else:
                return cls.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Tokenizer:
    def __init__(
        self, path: str, chat_template: str | None = None, backend_class: str | None = None
    ):
        """``chat_template``: Jinja source replacing the model's own (``read_chat_template``);
        ``backend_class``: transformers' tokenizer class to load (``load_backend``)."""
        self.path = path
        self._tok = load_backend(path, backend_class)
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

    @property
    def backend_class(self) -> str:
        """transformers' class behind this tokenizer, as ``load_backend`` takes it."""
        cls = type(self._tok)
        return f"{cls.__module__}:{cls.__qualname__}"

    @functools.cached_property
    def token_bytes(self) -> list[bytes] | None:
        """Each token's bytes when decoding is byte-level BPE with nothing after it (no space
        clean-up), else None; built on first use (the engine builds it at start)."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None or self._backend_decode is None:
            return None
        return byte_level_table(backend)

    @functools.cached_property
    def token_text(self) -> list[str | None] | None:
        """With ``token_bytes``: each token's text where its bytes are whole UTF-8 on their own
        (most tokens), None where they end mid-character or are not UTF-8. A detokenizer with
        no bytes pending takes such a token's text as it is, without decoding."""
        if self.token_bytes is None:
            return None
        return [_whole_utf8(b) for b in self.token_bytes]

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids ``skip_special_tokens`` drops: the added tokens marked special."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return frozenset(self._tok.all_special_ids)
        return frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)

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


def _whole_utf8(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


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
        self.has_stop_strings = bool(self._stop)
        """Whether a token's text decides the sequence's end (the engine decodes it at once;
        otherwise it may decode after launching the next step)."""
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        self._holdback_chars = max((len(s) for s in self._stop), default=1) - 1
        self._handed_out: list[str] = []
        """The text ``take_delta`` returned so far, in pieces (joined only when ``text`` is
        read: appending to one long string would copy it for every token)."""
        self._tail = ""
        """Decoded text not handed out yet: the newest text and the held-back characters
        that may start a stop string. Stop strings are searched for here only."""
        self.stop_reason: str | None = None
        self._token_bytes = tokenizer.token_bytes
        if self._token_bytes is not None:
            self._token_text = tokenizer.token_text
            self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._pending = ""
            """Decoded text ending in U+FFFD, held until a token makes it end otherwise."""
            self._clean = True
            """No text pending and no bytes buffered in ``_utf8``: a whole token's text
            (``Tokenizer.token_text``) is the new text as it is."""
            return
        self._ids: list[int] = list(prompt_token_ids[-_PREFIX_WINDOW_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    @property
    def text(self) -> str:
        """All decoded text so far, including any held-back tail."""
        if len(self._handed_out) > 1:
            self._handed_out = ["".join(self._handed_out)]
        return (self._handed_out[0] if self._handed_out else "") + self._tail

    def add_token(self, token_id: int) -> None:
        """Decode one more token; sets ``stop_reason`` when a stop string appears."""
        if self.stop_reason is not None:
            return
        if self._token_bytes is not None:
            self._add_byte_level(token_id)
            return
        self._ids.append(token_id)
        prefix = self._tok.decode(
            self._ids[self._prefix_offset : self._read_offset], self._skip_special
        )
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip_special)
        if full.endswith(_REPLACEMENT_CHAR) or len(full) <= len(prefix):
            return  # an incomplete character (or nothing visible yet): wait for more bytes
        start = len(self._tail)
        self._tail += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._check_stop(start)

    def _add_byte_level(self, token_id: int) -> None:
        if token_id in self._skipped or not 0 <= token_id < len(self._token_bytes):
            return
        text = self._token_text[token_id] if self._clean else None
        if text is None:  # part of a character, or after one: through the UTF-8 decoder
            text = self._pending + self._utf8.decode(self._token_bytes[token_id])
            self._pending = text if text.endswith(_REPLACEMENT_CHAR) or not text else ""
            self._clean = not self._pending and not self._utf8.getstate()[0]
            if self._pending:
                return
        if not text:
            return
        start = len(self._tail)
        self._tail += text
        if self._stop:
            self._check_stop(start)

    def _check_stop(self, new_start: int) -> None:
        """``new_start``: where the new text begins in ``_tail``. A stop string that ends in
        it starts at most ``_holdback_chars`` before it, text never handed out."""
        window_start = max(0, new_start - self._holdback_chars)
        for s in self._stop:
            idx = self._tail.find(s, window_start)
            if idx != -1:
                self.stop_reason = s
                self._tail = self._tail[: idx + len(s)] if self._include_stop else self._tail[:idx]
                return

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; keeps the possible start of a stop string unless finished."""
        tail = self._tail
        end = len(tail) if finished or self.stop_reason else len(tail) - self._holdback_chars
        if end <= 0:
            return ""
        delta, self._tail = tail[:end], tail[end:]
        self._handed_out.append(delta)
        return delta
