"""What the chat template sees: tool calls, tool results and names survive parsing, and
``chat_template_kwargs`` reach the template; rendered by the real tokenizer of the bundled model
with a template that prints those fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cluster.openai_protocol import ChatCompletionRequest, parse_body
from worker.tokenizer import Tokenizer

# A template in the style of Qwen2.5's: tool calls as JSON, tool results by id, an optional
# thinking switch. Only for this test; real models bring their own.
TOOL_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.name is defined %}[name={{ m.name }}]{% endif %}"
    "{% if m.tool_call_id is defined %}[result of {{ m.tool_call_id }}]{% endif %}"
    "{{ m.content }}"
    "{% for call in m.tool_calls or [] %}"
    "<call id={{ call.id }}>{{ call.function.name }}{{ call.function.arguments | tojson }}</call>"
    "{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?", "name": "ann"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]},
]


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory, smollm2_path) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tool_template")
    for f in Path(smollm2_path).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    return Tokenizer(str(folder))


def render(tokenizer: Tokenizer, body: dict) -> str:
    request = parse_body(ChatCompletionRequest, json.dumps(body).encode())
    ids = tokenizer.apply_chat_template(
        request.template_messages(), True, chat_template_kwargs=request.chat_template_kwargs
    )
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_tool_calls_tool_results_and_names_reach_the_template(tool_tokenizer):
    text = render(tool_tokenizer, {"messages": CONVERSATION})
    assert "<|user|>[name=ann]weather in Paris?" in text
    # The arguments string is decoded into an object, so `tojson` does not quote it twice.
    assert '<call id=call_1>get_weather{"city": "Paris"}</call>' in text
    assert "<|tool|>[result of call_1]18C" in text
    assert text.endswith("<|assistant|>")


def test_tool_call_arguments_that_are_not_a_json_object_pass_through(tool_tokenizer):
    conversation = json.loads(json.dumps(CONVERSATION))
    conversation[2]["tool_calls"][0]["function"]["arguments"] = "not json"
    text = render(tool_tokenizer, {"messages": conversation})
    assert 'get_weather"not json"' in text


def test_chat_template_kwargs_reach_the_template(tool_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    thinking_off = render(
        tool_tokenizer, {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert thinking_off.endswith("<|assistant|><think></think>")
    assert render(tool_tokenizer, {"messages": messages, "chat_template_kwargs": None}).endswith(
        "<|assistant|>"
    )
    request = parse_body(
        ChatCompletionRequest,
        json.dumps(
            {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}}
        ).encode(),
    )
    with pytest.raises(ValueError, match="^chat_template_kwargs may not set add_generation_prompt"):
        tool_tokenizer.apply_chat_template(
            request.template_messages(), True, chat_template_kwargs=request.chat_template_kwargs
        )


def test_encode_adds_special_tokens_only_when_asked(tool_tokenizer):
    # The bundled tokenizer adds no BOS of its own; the flag must still reach transformers.
    assert tool_tokenizer.encode(
        "hello world", add_special_tokens=True
    ) == tool_tokenizer._tok.encode("hello world")
    assert tool_tokenizer.encode("hello world") == tool_tokenizer._tok.encode(
        "hello world", add_special_tokens=False
    )
