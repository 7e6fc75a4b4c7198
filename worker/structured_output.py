"""Structured outputs: constrained decoding as a per-request grammar and a token mask.

What this module owns:

- ``StructuredOutputSpec``: the one internal way to say "this request's output must match X"
  (a JSON schema, any JSON object, a regex, one of a list of strings, or a Lark grammar).
  The HTTP layer builds it from ``response_format`` / ``structured_outputs`` / ``guided_*``;
  tool calling builds it to force ``tool_choice: required`` or a named function. It is a plain
  picklable dataclass: it crosses to the engine's child process inside ``SamplingParams``.
- Compiling a spec against a tokenizer (cached by the spec's key) and the per-request matcher
  that the sampler asks for a token mask and advances with every accepted token.

The grammar library is ``llguidance`` (chosen over ``xgrammar``, measured on this 2-core CPU
with SmolLM2's 49,152-token vocabulary, a 4-field object schema):

- weight: llguidance is one abi3 wheel with no dependencies; xgrammar 0.2.8 requires torch,
  transformers and apache-tvm-ffi, so it ties our torch pin to its own;
- compile: 0.8 ms per schema against xgrammar's 364 ms, so a spec compiles in
  ``add_request`` (and is checked in ``validate_request``) with no worker pool or async
  compile, and tool-calling schemas that differ per request cost nothing;
- JSON-schema coverage: both took ``pattern``, ``$ref``/``$defs`` (recursive too), ``anyOf``/
  ``oneOf``/``allOf``, ``format``, ``minItems``, ``minimum``, ``patternProperties``; for
  ``if``/``then``, ``not`` and ``uniqueItems`` llguidance refuses the schema (our 400) where
  xgrammar compiled it without enforcing them (an output that then fails validation);
- per-step mask: 105 us mean per constrained row against xgrammar's 22 us. That is the one
  cost where xgrammar wins; at batch 64 it is about 7 ms a step, next to a forward pass of
  the 135M model that takes far longer on this CPU (``bench/structured.py`` measures it).

JSON comes out compact (no free whitespace: ``{"a":1,"b":[2,3]}``), so a model cannot spend
its token budget on blank space. The mask is one bit per token, unpacked with numpy (a
``torch`` unpack of the 49k-bit mask cost ~2 ms a row here; numpy's ~60 us).

Failure modes: a spec that names no constraint or several, or a malformed schema / regex /
grammar, raises ``ValueError`` naming the field (the HTTP layer's 400) before the request
reaches the engine (``check_spec``, no tokenizer needed, cached by key). A matcher that
reaches an error state (a token outside its mask: a bug, never the model's choice) is
logged and ends its request like a completed grammar, so it never stalls the engine.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_CHOICES = 1024
MAX_SPEC_CHARS = 256 * 1024
MAX_CACHED_GRAMMARS = 256
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
"""Compact JSON: no free whitespace (a weak model could otherwise fill max_tokens with it)."""


@dataclass(frozen=True)
class StructuredOutputSpec:
    """Exactly one of the constraint fields is set.

    ``json_schema``: a JSON schema (dict, or its JSON text); ``json_object``: any JSON object;
    ``regex``: the whole output matches it; ``choice``: the output is exactly one of these
    strings; ``grammar``: a Lark grammar (llguidance's dialect, which may embed
    ``%json {...}``) or a GBNF one (llama.cpp's, converted). ``field_name`` is what error
    messages call the request field the spec came from (``response_format``, ``guided_json``,
    ``tool_choice``...).
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field_name: str = field(default="structured_outputs", compare=False)
    strict_properties: bool = True
    """``json_schema``: an object schema that lists ``properties`` and says nothing about
    others allows no others (``forbid_unlisted_properties``), as OpenAI's strict mode and
    vLLM's default do; False keeps plain JSON Schema semantics (any extra key allowed)."""

    def __post_init__(self) -> None:
        name = self.field_name
        if self.choice is not None and not isinstance(self.choice, tuple):
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"{name}: choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [
            k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None
        ]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(
                f"{name} must set exactly one of json_schema, json_object, regex, choice, grammar; "
                f"got {', '.join(kinds) or 'none'}"
            )
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name}: json schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    f"{name}: json schema must be a JSON object, got {type(schema).__name__}"
                )
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"{name}: regex must be a non-empty string")
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or not self.grammar.strip()
        ):
            raise ValueError(f"{name}: grammar must be a non-empty string")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"{name}: choice must list 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{name}: choice entries must be non-empty strings")
        if len(self.key) > MAX_SPEC_CHARS:
            raise ValueError(f"{name}: the constraint is longer than {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        for k in ("json_schema", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        raise AssertionError("unreachable: validated in __post_init__")

    @property
    def key(self) -> str:
        """A canonical string naming the constraint: the compile cache's key."""
        kind = self.kind
        if kind == "json_schema":
            value = json.dumps(self.schema_to_compile(), sort_keys=True, separators=(",", ":"))
        elif kind == "json_object":
            value = ""
        elif kind == "choice":
            value = json.dumps(list(self.choice))
        else:
            value = getattr(self, kind)
        return f"{kind}:{value}"

    def schema_to_compile(self) -> dict | bool:
        """The ``json_schema`` as a dict, unlisted properties forbidden if ``strict_properties``."""
        schema = self.json_schema
        if isinstance(schema, str):
            schema = json.loads(schema)
        return forbid_unlisted_properties(schema) if self.strict_properties else schema


def forbid_unlisted_properties(schema):
    """A copy of ``schema`` in which every object schema that lists ``properties`` and says
    nothing of other keys (no ``additionalProperties``, ``patternProperties`` or
    ``unevaluatedProperties``) gets ``additionalProperties: false``, at any depth
    (``properties``, ``items``, ``$defs``, ``anyOf``...). The direct members of an ``allOf``
    keep their own rule: each lists only its share of the keys the whole allows."""
    return _forbid(schema, in_all_of=False)


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _forbid(schema, in_all_of: bool):
    if isinstance(schema, list):
        return [_forbid(s, False) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _forbid(sub, False) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_forbid(sub, False) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), (dict, list)):
            out[key] = _forbid(out[key], False)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_forbid(sub, True) for sub in out["allOf"]]
    says_nothing = not any(
        k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
    )
    if isinstance(out.get("properties"), dict) and says_nothing and not in_all_of:
        out["additionalProperties"] = False
    return out


def grammar_text(spec: StructuredOutputSpec) -> str:
    """The spec as an llguidance grammar (not yet checked: ``check_spec`` does that)."""
    from llguidance import LLMatcher

    kind = spec.kind
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.schema_to_compile(), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec.choice)
        )
    from llguidance import grammar_from

    return grammar_from("grammar", spec.grammar)  # Lark, or GBNF (llama.cpp's) converted to Lark


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _check_grammar(kind: str, grammar: str) -> str:
    """llguidance's complaint about ``grammar`` ('' when it is fine); cached by the text."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error and messages else ""


def check_spec(spec: StructuredOutputSpec) -> None:
    """Raises ``ValueError`` naming ``spec.field_name`` when the constraint cannot compile."""
    try:
        grammar = grammar_text(spec)
    except ValueError as e:
        raise ValueError(f"{spec.field_name}: invalid {spec.kind.replace('_', ' ')}: {e}") from None
    error = _check_grammar(spec.kind, grammar)
    if error:
        raise ValueError(
            f"{spec.field_name}: invalid {spec.kind.replace('_', ' ')}: {_short(error)}"
        )


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


class SpecError(ValueError):
    """A request's structured-output fields are wrong; ``field`` names the one to blame."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older per-kind request fields, and the spec field each fills."""
STRUCTURED_OUTPUTS_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
"""vLLM's ``structured_outputs`` object: its constraint keys and the spec field each fills."""


def spec_from_request(
    *,
    response_format: dict | None = None,
    structured_outputs: dict | None = None,
    strict_properties: bool = True,
    **guided,
) -> StructuredOutputSpec | None:
    """The ``StructuredOutputSpec`` an OpenAI/vLLM request's fields ask for, or None.

    ``response_format`` is OpenAI's (``text``, ``json_object``, ``json_schema`` with
    ``json_schema.schema``), ``structured_outputs`` vLLM's object, ``guided`` vLLM's
    ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar`` (None when unset).
    At most one of them may constrain a request. Raises ``SpecError`` naming the field,
    after checking that the constraint compiles (``check_spec``). ``strict_properties``: see
    ``StructuredOutputSpec``.
    """
    found: list[tuple[str, dict]] = []
    if response_format is not None:
        kind = response_format.get("type", "text")
        name = "response_format"
        if kind == "json_object":
            found.append((name, {"json_object": True}))
        elif kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict):
                raise SpecError(
                    name,
                    "response_format.json_schema must be an object with a 'schema' when type is "
                    "'json_schema'",
                )
            schema = inner.get("schema", inner.get("json_schema"))
            if schema is None:
                raise SpecError(name, "response_format.json_schema.schema is required")
            found.append((name, {"json_schema": schema}))
        elif kind != "text":
            raise SpecError(
                name,
                "response_format type must be 'text', 'json_object' or 'json_schema', "
                f"got {kind!r}",
            )
    if structured_outputs is not None:
        name = "structured_outputs"
        if "structural_tag" in structured_outputs:
            raise SpecError(name, "structured_outputs.structural_tag is not supported")
        kwargs = {
            STRUCTURED_OUTPUTS_KEYS[k]: v
            for k, v in structured_outputs.items()
            if k in STRUCTURED_OUTPUTS_KEYS and v is not None and v is not False
        }
        if kwargs:
            found.append((name, kwargs))
    for name, value in guided.items():
        if name not in GUIDED_FIELDS:
            raise TypeError(f"unknown structured-output field {name!r}")
        if value is not None:
            found.append((name, {GUIDED_FIELDS[name]: value}))
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise SpecError(
            names[1],
            f"{names[1]}: only one structured-output constraint per request, "
            f"got {', '.join(names)}",
        )
    name, kwargs = found[0]
    if "json_object" in kwargs:
        kwargs["json_object"] = kwargs["json_object"] is True
    try:
        spec = StructuredOutputSpec(field_name=name, strict_properties=strict_properties, **kwargs)
        check_spec(spec)
    except ValueError as e:
        raise SpecError(name, str(e)) from None
    return spec


class GrammarCompiler:
    """One engine's grammars: the llguidance tokenizer (built on first use, ~0.4 s for 49k
    tokens) and a compiled matcher per spec key (LRU, ``MAX_CACHED_GRAMMARS``); each
    request gets a copy of the cached matcher in its start state."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """``vocab_size``: the width of the model's logits rows (may exceed the tokenizer's)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok = None
        self._cache: OrderedDict[str, object] = OrderedDict()

    def _ll_tokenizer(self):
        if self._lltok is None:
            import llguidance.hf

            hf = self._tokenizer._tok  # the transformers tokenizer our Tokenizer wraps
            eos = sorted(self._tokenizer.eos_token_ids) or None
            self._lltok = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
        return self._lltok

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A fresh matcher for one sequence; ``ValueError`` naming the field if it won't compile."""
        from llguidance import LLMatcher

        key = spec.key
        template = self._cache.get(key)
        if template is None:
            check_spec(spec)
            template = LLMatcher(self._ll_tokenizer(), grammar_text(spec), log_level=0)
            if template.is_error():
                raise ValueError(
                    f"{spec.field_name}: invalid {spec.kind.replace('_', ' ')}: "
                    f"{_short(template.get_error())}"
                )
            self._cache[key] = template
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return GrammarMatcher(template.deep_copy(), self.vocab_size)


class GrammarMatcher:
    """One sequence's grammar state: the mask for its next token, advanced by each token it
    takes. It lives on rank 0's ``Request`` only, in the engine's process, and is never
    pickled. Preemption by recompute keeps the generated tokens, so it keeps this state too:
    ``num_tokens`` always equals the sequence's output length."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.num_tokens = 0
        self.failed = False

    def allowed(self) -> np.ndarray:
        """Which tokens the grammar allows next: a bool array over the vocabulary."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].view(
            np.bool_
        )

    def mask_logits(self, row: torch.Tensor) -> torch.Tensor:
        """A copy of the logits ``row`` with every token the grammar forbids at -inf."""
        import torch

        allowed = self.allowed()
        if row.device.type == "cpu" and row.dtype == torch.float32 and row.is_contiguous():
            return torch.from_numpy(np.where(allowed, row.numpy(), np.float32(-np.inf)))
        keep = torch.from_numpy(allowed).to(row.device, non_blocking=True)
        return torch.where(
            keep, row, torch.tensor(float("-inf"), dtype=row.dtype, device=row.device)
        )

    def advance(self, token_id: int) -> bool:
        """Takes the sequence's new token; True when the grammar is complete (nothing more
        but EOS may follow) or the matcher failed, i.e. when the sequence must end."""
        self.num_tokens += 1
        if not self._m.consume_token(token_id):
            if not self.failed:
                log.error(
                    "structured output: token %d was outside the grammar (%s); ending the sequence",
                    token_id,
                    _short(self._m.get_error()),
                )
            self.failed = True
            return True
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()
