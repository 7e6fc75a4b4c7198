"""Resuming a request from the tokens another replica already streamed (stream failover).

The ingress re-submits a stream whose replica died with ``resume_token_ids``; the engine must
go on exactly where a fault-free run would: the same next tokens (greedy, seeded sampling
with penalties), the same stop, the text the client lacks and nothing it has.
"""

from __future__ import annotations

import pytest

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(
        EngineConfig(model=tiny_models["llama"], num_kv_blocks=256, max_num_batched_tokens=64)
    )


def stream(
    engine: LLMEngine,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    resume: list[int] = (),
    others: int = 0,
) -> tuple[list[list[int]], list[str], object]:
    """Runs ``rid`` (beside ``others`` unrelated requests) to the end: its per-output new
    token ids and new texts, and its last output."""
    engine.add_request(rid, prompt, params, resume_token_ids=resume)
    for i in range(others):
        engine.add_request(
            f"{rid}-other{i}",
            prompt[: 5 + 3 * i] + [7 + i] * 9,
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        )
    ids, texts, last = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                ids.append(list(out.outputs[0].new_token_ids))
                texts.append(out.outputs[0].new_text)
                last = out
    return ids, texts, last


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        max_tokens=MAX_TOKENS,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        ignore_eos=True,
    ),
}


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("cut", [1, 7, 16])
def test_resumed_stream_continues_like_the_uncut_one(engine, name, cut):
    params = PARAMS[name]
    prompt = engine.tokenizer.encode("Resume me: the quick brown fox jumps over the lazy dog")
    ids, texts, full = stream(engine, f"{name}-{cut}-full", prompt, params)
    tokens = [t for step_ids in ids for t in step_ids]
    assert len(tokens) == MAX_TOKENS
    sent_text = "".join(texts[:cut])  # one token per output when running alone
    r_ids, r_texts, resumed = stream(
        engine, f"{name}-{cut}-resumed", prompt, params, resume=tokens[:cut], others=3
    )
    assert [t for step_ids in r_ids for t in step_ids] == tokens[cut:]
    assert sent_text + "".join(r_texts) == full.outputs[0].text
    assert resumed.outputs[0].text == full.outputs[0].text
    assert resumed.outputs[0].token_ids == tokens
    assert resumed.outputs[0].finish_reason == full.outputs[0].finish_reason


def test_a_stop_string_that_spans_the_cut_still_stops(engine):
    prompt = engine.tokenizer.encode("Count with me: one two three")
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    _, texts, full = stream(engine, "stop-free", prompt, free)
    text = full.outputs[0].text
    stop = text[len(texts[0]) + len(texts[1]) - 2 :][:6]  # starts two characters before the cut
    assert len(stop) >= 3, text
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    ids, texts, uncut = stream(engine, "stop-uncut", prompt, params)
    tokens = [t for step_ids in ids for t in step_ids]
    cut = 2
    _, r_texts, resumed = stream(engine, "stop-resumed", prompt, params, resume=tokens[:cut])
    assert "".join(texts[:cut]) + "".join(r_texts) == uncut.outputs[0].text
    assert resumed.outputs[0].stop_reason == uncut.outputs[0].stop_reason == stop
    assert resumed.outputs[0].token_ids == uncut.outputs[0].token_ids


def test_resume_is_refused_when_it_cannot_continue(engine):
    prompt = engine.tokenizer.encode("Refuse me")
    with pytest.raises(ValueError, match="n == 1"):
        engine.add_request("n2", prompt, SamplingParams(n=2, max_tokens=8), resume_token_ids=[5])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("full", prompt, SamplingParams(max_tokens=2), resume_token_ids=[5, 6])
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("range", prompt, SamplingParams(max_tokens=8), resume_token_ids=[10**9])
    assert not engine.has_unfinished()
