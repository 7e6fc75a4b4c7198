"""Tool calling for chat completions: which calls a request allows, how the tools reach the
prompt, and the grammar that forces a call.

``plan_tool_calls`` turns a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
into a ``ToolPlan`` (or None when the output is plain text):

- ``none`` (or no tools): no tools in the prompt, nothing parsed.
- ``auto`` (the default when tools are given): the model chooses; its output is parsed with the
  server's ``--tool-call-parser``. As in vLLM this needs ``--enable-auto-tool-choice``; without
  it the request is a 400 naming the flag.
- ``required`` and a named function (``{"type": "function", "function": {"name": ...}}``):
  a grammar (``StructuredOutputSpec``, enforced by the sampler's token mask) lets the model
  write only calls in the format's syntax whose arguments match the tools' ``parameters``
  schemas: one call, or with ``parallel_tool_calls`` (default true) one or more for
  ``required``. A model that follows instructions poorly still makes a valid call.

The format is the server's parser, or ``hermes`` when none is configured (``required`` and
named choice work without any flag). Rendering: a chat template that renders ``tools`` itself
(Qwen2.5, Llama 3.1, Hermes) gets the tools and the history as they are. A template that
ignores them (the bundled SmolLM2's) gets ``template_messages``: the tools and the format's
instructions appended to the system message, assistant calls written out in the format, and
tool results as user turns in ``<tool_response>`` tags, so nothing is silently dropped.

Failures are 400s naming the field: a bad function name, duplicate names, a named function
not in ``tools``, ``required`` without tools, a schema the grammar library rejects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from dataclasses import dataclass

from cluster.errors import bad_request
from cluster.tool_parsers import TOOL_CALL_STREAMS, ToolCallStream
from worker.sampling_params import SamplingParams
from worker.structured_output import (
    StructuredOutputSpec,
    check_spec,
    forbid_unlisted_properties,
)

TOOL_CALL_PARSERS = tuple(TOOL_CALL_STREAMS)
DEFAULT_TOOL_FORMAT = "hermes"
# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Compact JSON with one space after ':' and ',' (how the formats' examples write calls).
# Without it the grammar library allows any whitespace between tokens, and a model that
# follows instructions poorly can spend its whole budget on it.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
# A probe tool for telling whether a chat template renders `tools` at all.
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_rendering", "description": "", "parameters": {}},
}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    arguments_key: str
    """The key the format's calls put the arguments under."""

    def render_call(self, name: str, arguments) -> str:
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        call = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>" if self.name == "hermes" else call

    def instructions(self, functions: list[dict]) -> str:
        """The system-prompt text for a template that does not render tools itself."""
        listing = "\n".join(
            json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions
        )
        example = self.render_call("<function-name>", {"<argument>": "<value>"})
        if self.name == "hermes":
            how = "To call a function, reply with one block per call:"
        else:
            how = "To call a function, reply with only its JSON (several separated by ';'):"
        return (
            "You can call these functions (JSON signatures inside <tools></tools>):\n"
            f"<tools>\n{listing}\n</tools>\n{how}\n{example}"
        )

    def grammar(self, functions: list[dict], *, many: bool, strict: bool = True) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is a valid call list;
        ``strict``: arguments carry no key their parameters do not list, unless the schema
        says otherwise (``forbid_unlisted_properties``)."""
        alternatives = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    self.arguments_key: _parameters_schema(f, strict),
                },
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        schema = {**schema, "x-guidance": _JSON_STYLE}
        call_json = "%json " + json.dumps(schema, ensure_ascii=False)
        if self.name == "hermes":
            call_rule = f'call: "<tool_call>\\n" {call_json} "\\n</tool_call>"'
            separator = '"\\n"'
        else:
            call_rule = f"call: {call_json}"
            separator = '"; "'
        start = f"start: call ({separator} call)*" if many else "start: call"
        return f"{start}\n{call_rule}\n"


TOOL_FORMATS = {
    "hermes": ToolFormat("hermes", "arguments"),
    "llama3_json": ToolFormat("llama3_json", "parameters"),
}
assert set(TOOL_FORMATS) == set(TOOL_CALL_STREAMS)


def _parameters_schema(function: dict, strict: bool) -> dict:
    parameters = function.get("parameters")
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return forbid_unlisted_properties(parameters) if strict else parameters


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools (None from ``plan_tool_calls`` means: it does not)."""

    format: ToolFormat
    functions: list[dict]
    """The tools' function definitions, as the template and the grammar see them."""
    mode: str
    """``auto``, ``required`` or ``named``."""
    max_calls: int | None
    """1 when parallel calls are off (or a named function); None: any number."""
    structured_output: StructuredOutputSpec | None
    """The grammar forcing calls (``required`` and named); None for ``auto``."""

    @property
    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]

    def new_stream(self) -> ToolCallStream:
        """A fresh parser state machine for one choice."""
        return TOOL_CALL_STREAMS[self.format.name](max_calls=self.max_calls)


def plan_tool_calls(
    tools: list[dict] | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    *,
    parser: str | None,
    enable_auto_tool_choice: bool,
    strict_json_schema: bool = True,
) -> ToolPlan | None:
    """The request's ``ToolPlan``; raises ``APIError`` (400) naming the field.
    ``strict_json_schema``: the server's ``ClusterConfig.strict_json_schema``."""
    if isinstance(tool_choice, dict):
        named = tool_choice.get("function", {}).get("name")
        mode = "named"
    else:
        named = None
        mode = tool_choice or ("auto" if tools else "none")
    if not tools:
        if mode in ("required", "named"):
            raise bad_request(f"tool_choice {mode!r} needs a non-empty tools list", "tool_choice")
        return None
    if mode == "none":
        return None
    functions = _check_functions(tools)
    if mode == "auto" and not enable_auto_tool_choice:
        raise bad_request(
            '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
            "--tool-call-parser",
            "tool_choice",
        )
    fmt = TOOL_FORMATS[parser or DEFAULT_TOOL_FORMAT]
    parallel = parallel_tool_calls is not False
    if mode == "named":
        chosen = [f for f in functions if f["name"] == named]
        if not chosen:
            raise bad_request(f"tool_choice names {named!r}, which is not in tools", "tool_choice")
        functions_for_grammar, max_calls = chosen, 1
    else:
        functions_for_grammar, max_calls = functions, None if parallel else 1
    spec = None
    if mode != "auto":
        grammar = fmt.grammar(
            functions_for_grammar, many=max_calls is None, strict=strict_json_schema
        )
        try:
            spec = StructuredOutputSpec(grammar=grammar, field_name="tools")
            check_spec(spec)  # a schema the grammar library rejects: 400 here, not in the engine
        except ValueError as exc:
            raise bad_request(str(exc), "tools") from None
    return ToolPlan(fmt, functions, mode, max_calls, spec)


def _check_functions(tools: list[dict]) -> list[dict]:
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise bad_request(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', "
                f"got {name!r}",
                "tools",
            )
        if name in seen:
            raise bad_request(f"tools[{i}].function.name {name!r} is not unique", "tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON object", "tools")
        functions.append({k: v for k, v in function.items() if v is not None})
    return functions


def template_renders_tools(render) -> bool:
    """Whether a chat template renders ``tools``: ``render(messages, tools)`` gives different
    prompts with and without a probe tool."""
    messages = [{"role": "user", "content": "hello"}]
    try:
        return render(messages, [_PROBE_TOOL]) != render(messages, None)
    except Exception:  # a template that fails on tools cannot render them
        return False


def template_messages(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    """The history for a template that does not render tools: tool instructions in the system
    message, assistant calls written in the format, tool results as tagged user turns."""
    fmt = plan.format if plan is not None else TOOL_FORMATS[DEFAULT_TOOL_FORMAT]
    out = []
    for message in messages:
        message = dict(message)
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                fmt.render_call(c["function"]["name"], c["function"]["arguments"])
                for c in message.pop("tool_calls")
            ]
            joiner = "\n" if fmt.name == "hermes" else "; "
            text = joiner.join(calls)
            message["content"] = f"{message['content']}\n{text}" if message["content"] else text
        elif role == "tool":
            message = {
                "role": "user",
                "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>",
            }
        out.append(message)
    if plan is not None:
        instructions = plan.format.instructions(plan.functions)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def template_inputs(
    messages: list[dict], plan: ToolPlan | None, renders_tools: bool
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template: as they are for a template that renders tools,
    else with the tools and the calls written into the messages (``template_messages``)."""
    if renders_tools:
        return messages, plan.template_tools if plan is not None else None
    needs_rewrite = plan is not None or any(
        m.get("tool_calls") or m["role"] == "tool" for m in messages
    )
    return (template_messages(messages, plan) if needs_rewrite else messages), None


def apply_tool_plan(params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
    """``params`` with the plan's grammar; a forced call and another output constraint
    (``response_format``, guided decoding) cannot both hold: 400."""
    if plan is None or plan.structured_output is None:
        return params
    if params.structured_output is not None:
        raise bad_request(
            f"tool_choice {plan.mode!r} cannot be combined with response_format or guided decoding",
            "tool_choice",
        )
    return dataclasses.replace(params, structured_output=plan.structured_output)
