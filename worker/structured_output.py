"""Structured outputs: constrained decoding as a per-request grammar and a token mask.

What this module owns:

- ``StructuredOutputSpec``: the one internal way to say "this request's output must match X"
  (a JSON schema, any JSON object, a regex, one of a list of strings, or a Lark grammar).
  The HTTP layer builds it from ``response_format`` / ``structured_outputs`` / ``guided_*``;
  tool calling builds it to force ``tool_choice: required`` or a named function. It is a plain
  picklable dataclass: it crosses to the engine's child process inside ``SamplingParams``.
- Compiling a spec against a tokenizer (cached by the spec's key) and the per-request matcher
  that the sampler asks for a token mask and advances with every accepted token.

Failure modes: a spec that names no constraint or several, or a malformed schema / regex /
grammar, raises ``ValueError`` naming the field (the HTTP layer's 400) before the request
reaches the engine. The grammar library itself is imported only when a spec is compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_CHOICES = 1024
MAX_SPEC_CHARS = 256 * 1024


@dataclass(frozen=True)
class StructuredOutputSpec:
    """Exactly one of the constraint fields is set.

    ``json_schema``: a JSON schema (dict, or its JSON text); ``json_object``: any JSON object;
    ``regex``: the whole output matches it; ``choice``: the output is exactly one of these
    strings; ``grammar``: a Lark grammar (llguidance's dialect, which may embed
    ``%json {...}``). ``field_name`` is what error messages call the request field the spec
    came from (``response_format``, ``guided_json``, ``tool_choice``...).
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field_name: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        name = self.field_name
        if self.choice is not None and not isinstance(self.choice, tuple):
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"{name}: choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
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
                raise ValueError(f"{name}: json schema must be a JSON object, got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"{name}: regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
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
            schema = self.json_schema
            if isinstance(schema, str):
                schema = json.loads(schema)
            value = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        elif kind == "json_object":
            value = ""
        elif kind == "choice":
            value = json.dumps(list(self.choice))
        else:
            value = getattr(self, kind)
        return f"{kind}:{value}"
