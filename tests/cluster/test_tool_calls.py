"""Tool calling without a server: the parsers and their streaming state machine, the request
plan (tool_choice rules and their 400s), the template fallback, and the grammar that forces
calls, walked at random under its own token mask on the bundled tokenizer."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from cluster.errors import APIError
from cluster.responses import ResponseBuilder
from cluster.tool_calls import (
    plan_tool_calls,
    template_inputs,
    template_renders_tools,
)
from cluster.tool_parsers import HermesStream, Llama3JsonStream
from tests.cluster.helpers import delta as replica_output

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "ping"}}

HERMES_TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and \\" inside"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>'
)
LLAMA_TEXT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}; '
    '{"name": "ping", "parameters": {}}'
)


def plan(tools=None, choice=None, parallel=None, parser=None, auto=False):
    return plan_tool_calls(tools, choice, parallel, parser=parser, enable_auto_tool_choice=auto)


def replay(stream, text: str, rng: random.Random):
    """Feeds ``text`` in random pieces; returns (content, calls as dicts) rebuilt from deltas
    the way OpenAI's clients accumulate them."""
    content, calls = [], {}
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    outputs = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for new_content, deltas in outputs:
        content.append(new_content)
        for delta in deltas:
            d = delta.to_dict()
            if "id" in d:
                assert d["index"] not in calls, "a call's header comes once"
                assert d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert d["index"] in calls, "arguments before the call's header"
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return "".join(content), [calls[i] for i in sorted(calls)]


def as_dicts(calls):
    return [{"name": c.name, "arguments": c.arguments} for c in calls]


def test_hermes_whole_output_keeps_content_before_calls_and_raw_arguments():
    content, calls = HermesStream().parse(HERMES_TEXT)
    assert content == "Let me check."
    assert as_dicts(calls) == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "note": "a } and \\" inside"}'},
        {"name": "get_time", "arguments": '{"zone": "UTC"}'},
    ]
    assert json.loads(calls[0].arguments)["note"] == 'a } and " inside'
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].id != calls[1].id
    assert HermesStream().parse('<tool_call>{"name": "ping"}</tool_call>')[0] is None


def test_llama3_json_calls_and_plain_answers():
    content, calls = Llama3JsonStream().parse(LLAMA_TEXT)
    assert content is None
    assert as_dicts(calls) == [
        {"name": "get_weather", "arguments": '{"city": "Rome", "days": 3}'},
        {"name": "ping", "arguments": "{}"},
    ]
    assert Llama3JsonStream().parse("  The answer is {x}.") == ("  The answer is {x}.", [])
    # A JSON object that is no call is the answer itself, text after it included.
    assert Llama3JsonStream().parse('{"city": "Rome"} ok') == ('{"city": "Rome"} ok', [])


@pytest.mark.parametrize(
    "stream_cls, text",
    [
        (HermesStream, HERMES_TEXT),
        (HermesStream, "No tools needed: 2 < 3 and <tool is not a tag."),
        (HermesStream, "Hi <tool_call>not json</tool_call> bye"),
        (HermesStream, 'x <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'),
        (Llama3JsonStream, LLAMA_TEXT),
        (Llama3JsonStream, '{"name": "get_time", "arguments": {"zone": "CET"}}'),
        (Llama3JsonStream, "<|python_ta is not a tag"),
        (Llama3JsonStream, '{"name": 5}'),
    ],
)
def test_streaming_in_any_pieces_gives_the_whole_parse(stream_cls, text, test_seed):
    whole_content, whole_calls = stream_cls().parse(text)
    rng = random.Random(test_seed)
    for _ in range(20):
        content, calls = replay(stream_cls(), text, rng)
        assert content == (whole_content or "")
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == as_dicts(
            whole_calls
        )


def test_tags_and_failed_calls_never_leak_or_vanish():
    stream = HermesStream()
    assert stream.feed("Sure <tool") == ("Sure", [])  # maybe a tag: held back
    content, deltas = stream.feed('_call>{"name": "ping"')
    assert content == "" and [d.to_dict()["function"]["name"] for d in deltas] == ["ping"]
    # garbage inside the tags is content; a cut-off call keeps the arguments written so far
    assert HermesStream().parse("a <tool_call>oops</tool_call>") == (
        "a <tool_call>oops</tool_call>",
        [],
    )
    content, calls = HermesStream().parse('<tool_call>{"name": "f", "arguments": {"a": [1, 2')
    assert content is None and as_dicts(calls) == [{"name": "f", "arguments": '{"a": [1, 2'}]


def test_max_calls_drops_calls_past_the_first():
    content, calls = HermesStream(max_calls=1).parse(HERMES_TEXT)
    assert [c.name for c in calls] == ["get_weather"]
    _, calls = Llama3JsonStream(max_calls=1).parse(LLAMA_TEXT)
    assert [c.name for c in calls] == ["get_weather"]


def test_plan_follows_tool_choice_rules():
    assert plan() is None
    assert plan([WEATHER], "none") is None
    with pytest.raises(APIError) as err:
        plan([WEATHER])  # auto by default, and auto needs the server flag
    assert err.value.status == 400 and "--enable-auto-tool-choice" in err.value.message
    assert err.value.param == "tool_choice"
    auto = plan([WEATHER], parser="llama3_json", auto=True)
    assert auto.mode == "auto" and auto.structured_output is None
    assert auto.format.name == "llama3_json" and auto.max_calls is None
    required = plan([WEATHER, TIME], "required", parallel=False)
    assert required.format.name == "hermes" and required.max_calls == 1
    assert required.structured_output.grammar.startswith("start: call\n")
    named = plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.max_calls == 1
    assert "get_weather" not in named.structured_output.grammar
    for bad, param in [
        (([WEATHER], {"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        ((None, "required"), "tool_choice"),
        (([{"type": "function", "function": {"name": "bad name"}}], "required"), "tools"),
        (([WEATHER, WEATHER], "required"), "tools"),
        # a schema the grammar library cannot compile is refused here, not in the engine
        (
            (
                [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "required",
            ),
            "tools",
        ),
    ]:
        with pytest.raises(APIError) as err:
            plan(*bad)
        assert err.value.status == 400 and err.value.param == param


def test_template_fallback_writes_tools_calls_and_results_into_messages():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    required = plan([WEATHER], "required")
    native, tools = template_inputs(history, required, renders_tools=True)
    assert native is history and tools == [WEATHER]
    messages, tools = template_inputs(history, required, renders_tools=False)
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # plain chats pass through untouched
    plain = [{"role": "user", "content": "hi"}]
    assert template_inputs(plain, None, renders_tools=False) == (plain, None)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def ll_tokenizer(hf_tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer)


def test_template_probe_tells_templates_that_render_tools(hf_tokenizer):
    def render(template):
        return lambda messages, tools: hf_tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False
        )

    assert not template_renders_tools(render(None))  # SmolLM2's own template ignores tools
    renders = (
        "{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    assert template_renders_tools(render(renders))


def _random_walk(matcher_factory, tokenizer, rng: random.Random, max_tokens: int) -> str:
    import llguidance.numpy as llg_numpy
    import numpy as np

    matcher, ll_tokenizer = matcher_factory()
    mask = llg_numpy.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    tokens = []
    for _ in range(max_tokens):
        llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: ll_tokenizer.vocab_size]
        token = int(rng.choice(np.nonzero(bits)[0]))
        if token == ll_tokenizer.eos_token:
            break
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
        if matcher.is_stopped():
            break
    assert matcher.is_accepting(), "ran out of tokens inside a call"
    return tokenizer.decode(tokens)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_calls_grammar_admits_only_valid_calls(
    parser, choice, hf_tokenizer, ll_tokenizer, test_seed
):
    """Uniformly random tokens under the grammar's mask (a model at its worst) always parse
    into calls of the allowed functions whose arguments match their schemas."""
    import llguidance

    tools = [WEATHER, TIME, NO_ARGS]
    tool_plan = plan(tools, choice, parser=parser)
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_plan.structured_output.grammar)

    def factory():
        return llguidance.LLMatcher(ll_tokenizer, grammar), ll_tokenizer

    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    allowed = {"get_time"} if isinstance(choice, dict) else set(schemas)
    rng = random.Random(test_seed)
    for _ in range(6):
        text = _random_walk(factory, hf_tokenizer, rng, max_tokens=400)
        content, calls = tool_plan.new_stream().parse(text)
        assert content is None and calls, text
        if isinstance(choice, dict):
            assert len(calls) == 1
        for call in calls:
            assert call.name in allowed
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, schemas[call.name] or {"maxProperties": 0})


LOOSE = {  # pydantic's model_json_schema() leaves additionalProperties out, as here
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        },
    },
}


def test_strict_tool_arguments_carry_only_listed_keys(hf_tokenizer, ll_tokenizer, test_seed):
    """Parameters that say nothing of other keys get none (the server's default,
    ``--strict-json-schema``): uniformly random tokens under the grammar's mask never add
    one, while ``--no-strict-json-schema`` leaves the schema as written."""
    import llguidance

    strict = plan([LOOSE], "required", parser="hermes")
    loose = plan_tool_calls(
        [LOOSE],
        "required",
        None,
        parser="hermes",
        enable_auto_tool_choice=False,
        strict_json_schema=False,
    )
    assert strict.structured_output.key != loose.structured_output.key
    grammar = llguidance.LLMatcher.grammar_from_lark(strict.structured_output.grammar)

    def factory():
        return llguidance.LLMatcher(ll_tokenizer, grammar), ll_tokenizer

    closed = {**LOOSE["function"]["parameters"], "additionalProperties": False}
    rng = random.Random(test_seed)
    for _ in range(6):
        text = _random_walk(factory, hf_tokenizer, rng, max_tokens=400)
        _, calls = strict.new_stream().parse(text)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), closed)


def test_response_builder_streams_calls_and_reports_tool_calls(test_seed):
    rng = random.Random(test_seed)
    tool_plan = plan([WEATHER, TIME], "required")
    text = HERMES_TEXT.split("\n", 1)[1]  # only calls, as the grammar forces

    def builder():
        return ResponseBuilder(
            chat=True,
            request_id="chatcmpl-1",
            model="m",
            n=1,
            num_prompts=1,
            want_logprobs=False,
            token_to_str=str,
            tool_plan=tool_plan,
        )

    cuts = sorted(rng.sample(range(1, len(text)), 15))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    streaming, events = builder(), []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = replica_output(0, piece, [1], "stop" if last else None, text if last else None)
        events += streaming.stream_events(0, out)
    chunks = [json.loads(e[len("data: ") :]) for e in events]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert not any(d.get("content") for d in deltas[1:])
    names = [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
    assert names == ["get_weather", "get_time"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    whole = builder()
    whole.add(
        0,
        replica_output(0, text, [1, 2], "stop", text),
    )
    choice = whole.full_response()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
    assert json.loads(choice["message"]["tool_calls"][1]["function"]["arguments"]) == {
        "zone": "UTC"
    }
