"""Structured outputs through the HTTP API of the shared tiny cluster (random weights), with the
official ``openai`` client (``response_format``, ``chat.completions.parse``, vLLM's
``guided_*``/``structured_outputs`` as ``extra_body``) and langchain-openai's
``ChatOpenAI.with_structured_output``.

A random-weight model follows no instruction at all, so every valid answer here is the token
mask's doing; outputs are checked with ``jsonschema`` (or the regex, or the choice list). The
engines run in child processes here, so the spec also crosses a process boundary.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "member"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=120)]
    city: Literal["Paris", "Rome", "Oslo"]
    member: bool


def schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_response_format_json_schema_is_valid_streamed_or_not(client, model, seed):
    kw = dict(
        model=model,
        messages=MESSAGES,
        response_format=schema_format(PERSON),
        max_tokens=64,
        temperature=1.0,
        seed=seed,
    )
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    ]
    assert "".join(chunks) == choice.message.content, "same seed, same tokens"


def test_official_client_parse_returns_the_pydantic_model(client, model):
    for seed in (4, 5):
        done = client.chat.completions.parse(
            model=model,
            messages=MESSAGES,
            response_format=Person,
            max_tokens=64,
            temperature=1.0,
            seed=seed,
        )
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Person), done.choices[0].message.content
        jsonschema.validate(parsed.model_dump(), Person.model_json_schema())


def test_vllm_fields_on_completions(client, model):
    for seed in (1, 2):
        extra = {"guided_regex": r"[A-Z]{2}-[0-9]{2,4}"}
        out = client.completions.create(
            model=model, prompt="Code:", max_tokens=16, temperature=1.0, seed=seed, extra_body=extra
        )
        assert (
            re.fullmatch(extra["guided_regex"], out.choices[0].text)
            and out.choices[0].finish_reason == "stop"
        )
        out = client.completions.create(
            model=model,
            prompt="Answer:",
            max_tokens=8,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        assert out.choices[0].text in ("yes", "no")
        out = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=64,
            seed=seed,
            extra_body={"guided_json": PERSON},
        )
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": schema_format({"type": "array", "uniqueItems": True})},
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
            "guided_choice",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client, model, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **body)
    assert info.value.body["param"] == param, info.value.body


def test_langchain_with_structured_output(tiny_server, model):
    from langchain_openai import ChatOpenAI

    for seed in (6, 7):
        llm = ChatOpenAI(
            base_url=f"{tiny_server.url}/v1",
            api_key=tiny_server.api_key,
            model=model,
            max_tokens=64,
            temperature=1.0,
            seed=seed,
            max_retries=0,
        )
        person = llm.with_structured_output(Person, method="json_schema").invoke(
            "Describe a person."
        )
        assert isinstance(person, Person)
