"""Structured outputs in the engine: a random-weight model, so only the grammar's token mask
stands between it and garbage. Every constrained output must be valid (JSON that meets its
schema, a full regex match, one of the choices), end with finish_reason "stop" when the
grammar completes, and keep the determinism contract: the same tokens alone, in a mixed
batch, on a prefix-cache hit and after preemption by recompute.
"""

from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest

from tests.worker.helpers import run
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams
from worker.structured_output import (
    SpecError,
    StructuredOutputSpec,
    check_spec,
    forbid_unlisted_properties,
    spec_from_request,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "kind": {"anyOf": [{"const": "human"}, {"type": "boolean"}]},
    },
    "required": ["name", "age", "pets", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe not"]
LARK = 'start: "(" item ("," item)? ")"\nitem: /[xy]/'
GBNF = 'root ::= "v" [0-9] "." [0-9]'


def check_valid(spec: StructuredOutputSpec, text: str) -> None:
    """Fails unless ``text`` is what ``spec`` allows (each kind checked by an independent tool)."""
    if spec.json_schema is not None:
        jsonschema.validate(json.loads(text), spec.json_schema)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice, text
    elif spec.grammar == LARK:
        assert re.fullmatch(r"\([xy](,[xy])?\)", text), text
    else:
        assert re.fullmatch(r"v[0-9]\.[0-9]", text), text


SPECS = {
    "json_schema": StructuredOutputSpec(json_schema=PERSON),
    "regex": StructuredOutputSpec(regex=REGEX),
    "choice": StructuredOutputSpec(choice=CHOICES),
    "lark": StructuredOutputSpec(grammar=LARK),
    "gbnf": StructuredOutputSpec(grammar=GBNF),
}


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(
        EngineConfig(model=tiny_models["llama"], num_kv_blocks=256, max_num_batched_tokens=256)
    )


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("Reply in the requested format:")


def params(spec, *, seed=0, temperature=1.0, max_tokens=120, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens, structured_output=spec, **kw
    )


# -- the spec and the request fields (no engine) ------------------------------------------------
def test_spec_names_exactly_one_constraint_and_pickles():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputSpec()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputSpec(regex="a", choice=["a"])
    spec = StructuredOutputSpec(json_schema=json.dumps(PERSON), field_name="guided_json")
    assert spec.key == StructuredOutputSpec(json_schema=PERSON).key, (
        "the cache key is canonical JSON"
    )
    assert pickle.loads(pickle.dumps(params(spec))).structured_output == spec
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output={"regex": "a"})


@pytest.mark.parametrize(
    "fields, field, fragment",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"uniqueItems": True}},
                }
            },
            "response_format",
            "uniqueItems",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
        ({"guided_regex": "(open"}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "start: @@"}, "guided_grammar", "invalid grammar"),
        ({"guided_choice": []}, "guided_choice", "choice"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"json": PERSON}, "guided_regex": "a"}, "guided_regex", "only one"),
    ],
)
def test_bad_request_fields_name_the_field(fields, field, fragment):
    with pytest.raises(SpecError) as info:
        spec_from_request(**{"response_format": None, "structured_outputs": None, **fields})
    assert info.value.field == field and fragment in str(info.value), str(info.value)
    assert str(info.value).startswith(field), (
        "the message leads with the field, like SamplingParams'"
    )


def test_request_fields_map_to_specs():
    assert spec_from_request(response_format={"type": "text"}) is None
    assert spec_from_request(response_format={"type": "json_object"}).json_object
    got = spec_from_request(
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    )
    assert got.json_schema == PERSON and got.field_name == "response_format"
    assert spec_from_request(structured_outputs={"choice": CHOICES}).choice == tuple(CHOICES)
    assert spec_from_request(guided_grammar=GBNF).grammar == GBNF
    check_spec(SPECS["gbnf"])


def test_unlisted_properties_are_forbidden_unless_the_schema_says_so():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "array", "items": {"properties": {"y": {}}}},
            "c": {"anyOf": [{"properties": {"z": {}}}, {"type": "null"}]},
            "free": {"type": "object"},
            "open": {"properties": {"k": {}}, "additionalProperties": True},
            "pattern": {"properties": {"k": {}}, "patternProperties": {"^p": {}}},
            "ref": {"$ref": "#/$defs/Item"},
        },
        "$defs": {"Item": {"properties": {"id": {}}}},
        "allOf": [{"properties": {"m": {}}}, {"properties": {"n": {}}}],
    }
    out = forbid_unlisted_properties(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["items"]["additionalProperties"] is False
    assert props["c"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # lists nothing: any object
    assert props["open"]["additionalProperties"] is True  # said otherwise: kept
    assert "additionalProperties" not in props["pattern"]
    assert out["$defs"]["Item"]["additionalProperties"] is False
    assert all("additionalProperties" not in part for part in out["allOf"])
    assert "additionalProperties" not in schema  # a copy: the request's schema is untouched


def test_strict_properties_is_the_default_and_can_be_turned_off():
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}}
    field = {"type": "json_schema", "json_schema": {"name": "p", "schema": loose}}
    strict = spec_from_request(response_format=field)
    assert strict.schema_to_compile()["additionalProperties"] is False
    plain = spec_from_request(response_format=field, strict_properties=False)
    assert plain.schema_to_compile() == loose
    assert strict.key != plain.key  # compiled and cached apart


# -- the engine -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SPECS))
def test_random_weights_still_give_valid_output(engine, prompt, name, test_seed):
    spec = SPECS[name]
    reqs = {
        f"{name}-{i}": (prompt, params(spec, seed=test_seed + i, temperature=t))
        for i, t in enumerate([0.0, 0.7, 1.0, 1.5])
    }
    done = run(engine, reqs)
    for rid, out in done.items():
        c = out.outputs[0]
        assert c.finish_reason == "stop", (rid, c.finish_reason, c.text)
        check_valid(spec, c.text)


def test_outputs_of_a_schema_without_additional_properties_carry_only_its_keys(
    engine, prompt, test_seed
):
    """What pydantic's ``model_json_schema()`` sends (no ``additionalProperties``): a random
    model under the strict default never invents a key. (With ``strict_properties=False``
    about 3 in 8 of these runs invent keys with unbounded strings and end at max_tokens.)"""
    loose = {key: value for key, value in PERSON.items() if key != "additionalProperties"}
    loose["required"] = ["name"]
    spec = StructuredOutputSpec(json_schema=loose)
    reqs = {
        f"loose-{i}": (prompt, params(spec, seed=test_seed + i, temperature=1.5)) for i in range(8)
    }
    for rid, out in run(engine, reqs).items():
        c = out.outputs[0]
        assert c.finish_reason == "stop", (rid, c.text)  # every field is bounded in length
        jsonschema.validate(json.loads(c.text), PERSON | {"required": ["name"]})


def test_json_object_and_n_sequences_each_valid(engine, prompt, test_seed):
    # Any object allows strings of any length, which a random model rarely closes: an output
    # either completes (and parses) or is cut at max_tokens.
    spec = StructuredOutputSpec(json_object=True)
    done = run(
        engine,
        {f"obj{i}": (prompt, params(spec, seed=test_seed + i, max_tokens=80)) for i in range(3)},
    )
    for out in done.values():
        c = out.outputs[0]
        if c.finish_reason == "stop":
            check_valid(spec, c.text)
        else:
            assert (c.finish_reason, len(c.token_ids)) == ("length", 80) and c.text.startswith("{")
    multi = run(engine, {"n": (prompt, params(SPECS["regex"], seed=test_seed, n=3))})["n"]
    assert len(multi.outputs) == 3
    for c in multi.outputs:
        check_valid(SPECS["regex"], c.text)


def test_grammar_completion_stops_even_with_ignore_eos_and_min_tokens(engine, prompt, test_seed):
    spec = StructuredOutputSpec(choice=["ok"])
    out = run(engine, {"x": (prompt, params(spec, seed=test_seed, ignore_eos=True, min_tokens=5))})[
        "x"
    ]
    c = out.outputs[0]
    assert (c.text, c.finish_reason) == ("ok", "stop")
    assert len(c.token_ids) <= 2


def test_max_tokens_cuts_a_constrained_output_with_length(engine, prompt):
    out = run(engine, {"x": (prompt, params(SPECS["json_schema"], temperature=0.0, max_tokens=3))})[
        "x"
    ]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_invalid_spec_is_refused_before_the_engine_state_changes(engine, prompt):
    bad = StructuredOutputSpec(regex="(open", field_name="guided_regex")
    with pytest.raises(ValueError, match="guided_regex"):
        engine.add_request("bad", prompt, params(bad))
    assert "bad" not in engine._groups and not engine.has_unfinished()


def test_same_tokens_alone_in_a_mixed_batch_and_on_a_cache_hit(engine, prompt, test_seed):
    spec = SPECS["json_schema"]
    mine = params(spec, seed=test_seed)
    alone = run(engine, {"alone": (prompt, mine)})["alone"].outputs[0]
    others = {
        "plain": (
            prompt,
            SamplingParams(temperature=1.0, seed=test_seed + 1, max_tokens=40, ignore_eos=True),
        ),
        "greedy": (prompt[:3], SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)),
        "regex": (prompt, params(SPECS["regex"], seed=test_seed + 2)),
        "choice": (prompt[1:], params(SPECS["choice"], seed=test_seed + 3, temperature=0.0)),
        "mine": (prompt, mine),  # a prefix-cache hit on "alone"'s prompt
    }
    batch = run(engine, others)
    assert batch["mine"].num_cached_tokens > 0 or len(prompt) < engine.block_size
    assert batch["mine"].outputs[0].token_ids == alone.token_ids
    check_valid(spec, alone.text)
    fresh = LLMEngine(
        EngineConfig(model=engine.model_path, num_kv_blocks=256, enable_prefix_caching=False)
    )
    assert run(fresh, {"miss": (prompt, mine)})["miss"].outputs[0].token_ids == alone.token_ids


def test_preemption_by_recompute_keeps_the_grammar_state(tiny_models, test_seed):
    # 6 sequences of a 2-block prompt plus up to 50 tokens in 8 blocks of 16: some must be
    # preempted and recomputed; the matcher keeps its state (the generated tokens stay) and
    # must not take them again.
    roomy = LLMEngine(EngineConfig(model=tiny_models["llama"], num_kv_blocks=256))
    tight = LLMEngine(EngineConfig(model=tiny_models["llama"], num_kv_blocks=8, max_num_seqs=8))
    prompt = tight.tokenizer.encode(
        "Fill in the form below with a name, an age, pets and a kind, then stop. Form:"
    )
    assert 16 < len(prompt) <= 32
    reqs = {
        f"r{i}": (prompt, params(SPECS["json_schema"], seed=test_seed + i, max_tokens=50))
        for i in range(6)
    }
    want = run(roomy, reqs)
    got = run(tight, reqs)
    assert tight.scheduler.counters.num_preemptions > 0, "the KV pool was meant to force preemption"
    for rid, out in got.items():
        assert out.outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
        if out.outputs[0].finish_reason == "stop":
            check_valid(SPECS["json_schema"], out.outputs[0].text)
