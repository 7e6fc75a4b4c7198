"""Prompt logprobs and logit_bias in the engine, on a tiny random model: prompt logprobs equal
transformers' own log-softmax over the same weights, whatever the chunking, the cache and the
batch; logit_bias moves tokens as OpenAI says and keeps a request's tokens the same alone or
in a batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."


def make_engine(path: str, **options) -> LLMEngine:
    config = dict(
        model=path, num_kv_blocks=256, block_size=8, max_num_batched_tokens=2048, device="cpu"
    )  # float32, compared with transformers' float32
    return LLMEngine(EngineConfig(**(config | options)))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """transformers' log-softmax at every prompt position."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    engine = make_engine(tiny_llama)
    ids = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, logprobs


def check_against(entries, ids, ref, num_top):
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry, row = entries[pos], ref[pos - 1]
        assert entry.token_id == ids[pos]
        assert entry.logprob == pytest.approx(float(row[ids[pos]]), abs=2e-4)
        # The rank counts likelier tokens; near-ties within the tolerance may go either way.
        value = float(row[ids[pos]])
        assert (
            int((row > value + 2e-4).sum()) + 1 <= entry.rank <= int((row > value - 2e-4).sum()) + 1
        )
        assert len(entry.top) == num_top
        assert [lp for _, lp in entry.top] == pytest.approx(
            torch.topk(row, num_top).values.tolist(), abs=2e-4
        )


@pytest.mark.parametrize("chunk_tokens", [2048, 9])
def test_prompt_logprobs_match_transformers(tiny_llama, reference, chunk_tokens):
    ids, ref = reference
    engine = make_engine(tiny_llama, max_num_batched_tokens=chunk_tokens, max_model_len=256)
    out = run(engine, {"a": (ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))})[
        "a"
    ]
    check_against(out.prompt_logprobs, ids, ref, 2)
    # Asked for nothing: nothing.
    assert (
        run(engine, {"b": (ids, SamplingParams(temperature=0, max_tokens=1))})["b"].prompt_logprobs
        is None
    )


def test_prompt_logprobs_skip_the_prefix_cache_and_change_no_tokens(tiny_llama, reference):
    ids, ref = reference
    engine = make_engine(tiny_llama)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = run(engine, {"warm": (ids, greedy)})["warm"]
    # The prompt is cached now; a request for prompt logprobs still gets all of them, and the
    # same tokens, while other requests share its batch.
    others = {f"o{i}": (ids[: 5 + i], greedy) for i in range(3)}
    done = run(
        engine,
        {
            "p": (
                ids,
                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0),
            )
        }
        | others,
    )
    assert done["p"].num_cached_tokens == 0
    check_against(done["p"].prompt_logprobs, ids, ref, 0)
    assert done["p"].token_ids == alone.token_ids
    for rid, (prompt, _) in others.items():
        assert (
            done[rid].token_ids
            == run(make_engine(tiny_llama), {rid: (prompt, greedy)})[rid].token_ids
        )


def test_prompt_logprobs_of_n_choices_are_computed_once(tiny_llama, reference):
    ids, ref = reference
    engine = make_engine(tiny_llama)
    out = run(
        engine,
        {"n": (ids, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=2, prompt_logprobs=1))},
    )["n"]
    check_against(out.prompt_logprobs, ids, ref, 1)
    assert engine.metrics.prompt_tokens_total == len(ids)


def test_logit_bias_forces_and_bans_tokens(tiny_llama, reference, test_seed):
    ids, _ = reference
    engine = make_engine(tiny_llama)
    base = run(engine, {"g": (ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))})[
        "g"
    ]
    forced = run(
        engine,
        {
            "f": (
                ids,
                SamplingParams(
                    temperature=0, max_tokens=4, ignore_eos=True, logit_bias={42: 100.0}
                ),
            )
        },
    )["f"]
    assert forced.token_ids == [42] * 4
    banned = set(base.token_ids)
    out = run(
        engine,
        {
            "b": (
                ids,
                SamplingParams(
                    temperature=0,
                    max_tokens=4,
                    ignore_eos=True,
                    logit_bias={t: -100.0 for t in banned},
                ),
            )
        },
    )["b"]
    assert not banned & set(out.token_ids)
    # Sampled with a bias: the same tokens alone and in a batch of others.
    biased = SamplingParams(
        temperature=1.0,
        seed=test_seed,
        max_tokens=6,
        ignore_eos=True,
        logit_bias={7: 5.0, 11: -3.0, 42: 2.5},
    )
    alone = run(make_engine(tiny_llama), {"s": (ids, biased)})["s"]
    crowd = {
        f"c{i}": (ids[i:], SamplingParams(temperature=0.8, seed=i, max_tokens=6))
        for i in range(1, 6)
    }
    assert (
        run(make_engine(tiny_llama), {"s": (ids, biased)} | crowd)["s"].token_ids == alone.token_ids
    )


def test_bad_logit_bias_and_prompt_logprobs_are_value_errors(tiny_llama):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="^logit_bias"):
        engine.add_request("x", [1, 2], SamplingParams(logit_bias={engine.spec.vocab_size: 1.0}))
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
