"""OpenAI request models (pydantic, strict) and their translation into ``SamplingParams``.

Bodies are parsed with ``model_validate_json`` in strict mode: malformed JSON, invalid UTF-8
and wrong field types all become a pydantic ``ValidationError`` that ``cluster.errors`` turns
into a 400 naming the field. Two leniencies, as OpenAI and vLLM allow: ``null`` in any field
that has a default means the default, and an integer field takes an integral number written
as a float (``"n": 2.0``); strings are never numbers. Range checks live in one place,
``SamplingParams`` (its ``ValueError``s name the field too); this module adds only what
depends on the API shape (chat ``logprobs``/``top_logprobs``, ``logit_bias`` keys, unsupported
OpenAI options, empty messages) and on the prompt length (``max_tokens`` against the
context). Unknown fields are ignored, as vLLM does: each name is logged once at WARNING and
counted (``ignored_field_counts``, exported by ``cluster.metrics``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cluster.errors import APIError, bad_request, from_validation_error, from_value_error
from worker.generation_defaults import apply_defaults
from worker.sampling_params import SamplingParams
from worker.structured_output import SpecError, StructuredOutputSpec, spec_from_request

# A batched completions request fans out into one engine request per prompt; more than this
# many belongs in the offline batch API, not in one HTTP request.
MAX_PROMPTS_PER_REQUEST = 64
# Distinct unknown field names counted one by one; past this, clients could grow the metric's
# label set without bound, so further names share the label OTHER_FIELDS_LABEL.
MAX_TRACKED_IGNORED_FIELDS = 64
OTHER_FIELDS_LABEL = "_other"

# Serve routes the "ray.serve" logger into each replica's log file.
log = logging.getLogger("ray.serve")

_ignored_lock = threading.Lock()
_ignored_counts: Counter[str] = Counter()


def ignored_field_counts() -> dict[str, int]:
    """Requests that carried each unknown (ignored) field, by dotted field name."""
    with _ignored_lock:
        return dict(_ignored_counts)


def _note_ignored_field(name: str) -> None:
    with _ignored_lock:
        if name not in _ignored_counts and len(_ignored_counts) >= MAX_TRACKED_IGNORED_FIELDS:
            name = OTHER_FIELDS_LABEL
        first = name not in _ignored_counts
        _ignored_counts[name] += 1
    if first:
        log.warning("ignoring unknown request field %r (logged once per field name)", name)


def _integral_float(value: Any) -> Any:
    """2.0 -> 2 for integer fields (JSON writers that only have doubles); 2.5 stays invalid."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral_float)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    _FIELD_PATH: ClassVar[str] = ""
    """How this model's fields are named in logs and metrics (``messages[].`` for a message)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_unknowns(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        kept = {}
        for key, value in data.items():
            field = fields.get(key)
            if field is None:
                _note_ignored_field(cls._FIELD_PATH + str(key))
            elif value is not None or field.is_required():
                kept[key] = value  # null in a field with a default: the default
        return kept


class StreamOptions(_Strict):
    _FIELD_PATH = "stream_options."
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    _FIELD_PATH = "messages[].content[]."
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    _FIELD_PATH = "messages[].tool_calls[].function."
    name: str
    arguments: str | dict = "{}"
    """OpenAI sends a JSON string; some clients send the object itself."""


class ToolCall(_Strict):
    _FIELD_PATH = "messages[].tool_calls[]."
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_dict(self) -> dict:
        # Chat templates render arguments with `| tojson` (Llama 3.1) or as given (Qwen2.5);
        # an object suits both, so a string that holds a JSON object is decoded (as vLLM does).
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": arguments},
        }


class FunctionDefinition(_Strict):
    _FIELD_PATH = "tools[].function."
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    _FIELD_PATH = "tools[]."
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    _FIELD_PATH = "tool_choice.function."
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the one function the model must call."""

    _FIELD_PATH = "tool_choice."
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    """One message of a conversation, as the chat template sees it.

    Assistant ``tool_calls``, a tool message's ``tool_call_id`` and ``name`` are kept for the
    template (a template that ignores them renders as before).
    """

    _FIELD_PATH = "messages[]."

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A content part the served model cannot read (``image_url``, ``input_audio``, ...)
        is named in the 400, rather than failing as "not a valid string"."""
        if isinstance(value, list):
            for index, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError(
                        "unsupported_content_part",
                        "content part {index} is of type '{kind}': the served model takes "
                        "text only (parts of type 'text')",
                        {"index": index, "kind": kind},
                    )
        return value

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = content or ""
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class _SamplingRequest(_Strict):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    seed: Int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    response_format: dict | None = None
    """OpenAI's
    ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}``."""
    structured_outputs: dict | None = None
    """vLLM's: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar``, ``json_object``."""
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's shape: token id (a JSON object key, so a string) -> bias in [-100, 100]."""
    best_of: Int | None = None
    prompt_logprobs: Int | None = None
    """vLLM's: the logprob of every prompt token after the first, plus this many top ones."""

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        raise NotImplementedError

    def engine_logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            token = key.strip()
            if not token.isdigit():
                raise bad_request(
                    f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                    "logit_bias",
                )
            bias[int(token)] = value
        return bias

    def check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt must be a non-empty string when given", "cache_salt")

    def sampling_params(
        self,
        max_tokens: int | None = None,
        model_defaults: dict[str, float | int] | None = None,
        *,
        strict_json_schema: bool = True,
    ) -> SamplingParams:
        """SamplingParams for this request; ``max_tokens`` overrides the requested value.
        ``model_defaults`` (``worker.generation_defaults``) fill sampling fields the request left
        unset or null: the request's value, else the model's default, else ours.
        ``strict_json_schema``: the server's ``ClusterConfig.strict_json_schema``."""
        self.check_unsupported()
        options = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        kwargs = apply_defaults(options, model_defaults or {})
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens if max_tokens is not None else self.requested_max_tokens(),
                min_tokens=self.min_tokens,
                seed=self.seed,
                stop=self.stop if self.stop is not None else [],
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                logprobs=self.engine_logprobs(),
                prompt_logprobs=self.engine_prompt_logprobs(),
                logit_bias=self.engine_logit_bias(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                structured_output=self.engine_structured_output(strict_json_schema),
                **kwargs,
            )
        except ValueError as exc:
            raise from_value_error(exc, self._param_renames()) from None

    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def engine_structured_output(
        self, strict_json_schema: bool = True
    ) -> StructuredOutputSpec | None:
        """The constraint ``response_format``/``structured_outputs``/``guided_*`` ask for (at most
        one), checked to compile: a 400 naming the field otherwise."""
        try:
            return spec_from_request(
                response_format=self.response_format,
                structured_outputs=self.structured_outputs,
                strict_properties=strict_json_schema,
                guided_json=self.guided_json,
                guided_regex=self.guided_regex,
                guided_choice=self.guided_choice,
                guided_grammar=self.guided_grammar,
            )
        except SpecError as exc:
            raise bad_request(str(exc), exc.field) from None

    def _param_renames(self) -> dict[str, str]:
        return {}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class _ChatPromptFields(BaseModel):
    """What decides a conversation's prompt tokens: the chat request's and ``/tokenize``'s
    chat form share these, so both count the same tokens."""

    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (Qwen3's ``enable_thinking``), as in vLLM."""
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: ``auto`` when tools are given, else ``none`` (see ``cluster/tool_calls.py``)."""
    parallel_tool_calls: bool | None = None

    def template_messages(self) -> list[dict]:
        return [message.as_template_dict() for message in self.messages]

    def tool_definitions(self) -> list[dict] | None:
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_choice_value(self) -> str | dict | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


class ChatCompletionRequest(_ChatPromptFields, _SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not self.logprobs:
            return None
        return self.top_logprobs if self.top_logprobs is not None else 0

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")

    def _param_renames(self) -> dict[str, str]:
        renamed = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            renamed["max_tokens"] = "max_completion_tokens"
        return renamed


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Int | None = None
    echo: bool = False
    """The prompt leads each choice's text (and, with ``logprobs``, its logprobs: the first
    token's is null), as OpenAI's legacy completions do; what log-likelihood harnesses use."""
    suffix: str | None = None

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one string or token list each, never empty."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(item, int) for item in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise bad_request(
                f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompts)}",
                "prompt",
            )
        for item in prompts:
            if len(item) == 0:
                raise bad_request("prompt must not be empty", "prompt")
        return prompts


class TokenizeRequest(_ChatPromptFields, _Strict):
    """vLLM's two forms: ``prompt``, or ``messages`` with the chat request's prompt fields
    (``tools`` included), which count the tokens a chat request's ``prompt_tokens`` does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens (BOS) to ``prompt``, as ``/v1/completions`` does not."""

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if self.messages is not None and not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int] = Field(default_factory=list)


def parse_body(model_cls: type[BaseModel], raw: bytes):
    """``model_cls`` from a raw body; malformed JSON, bad UTF-8 or wrong types -> 400."""
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    *,
    prompt_param: str,
    tokens_param: str,
) -> int:
    """The max_tokens a prompt may use: the requested value if it fits, else a 400.

    ``prompt_param``/``tokens_param`` name the fields to blame (``messages`` or ``prompt``;
    ``max_tokens`` or ``max_completion_tokens``).
    """
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens, leaving no room for a completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion).",
            param=tokens_param,
            code="context_length_exceeded",
        )
    return requested
