"""The sampler takes plain greedy rows together; every row must get what it would alone."""

from __future__ import annotations

import torch

from worker.request import Request
from worker.sampler import Sampler
from worker.sampling_params import SamplingParams

EOS = 2


def request(i: int, params: SamplingParams, outputs: int = 0) -> Request:
    """Request ``r{i}`` (seed ``i``) with ``outputs`` tokens already sampled."""
    req = Request(
        request_id=f"r{i}",
        index=0,
        prompt_token_ids=[5, 6, 7, 5],
        params=params,
        seed=i,
        block_size=16,
        model_id="m",
        cache_salt=None,
        detokenizer=None,
        max_total_tokens=64,
    )
    for token in range(10, 10 + outputs):
        req.append_token(token)
    return req


def test_batched_greedy_rows_equal_rows_sampled_alone():
    kinds = [
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=4, logprobs=3),
        SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=4, min_tokens=2),
        SamplingParams(temperature=0.8, max_tokens=4, top_k=20),
    ]
    requests = [request(i, kinds[i % len(kinds)]) for i in range(15)]
    logits = torch.randn(len(requests), 100)
    logits[:, EOS] = 50.0  # every row's argmax, unless min_tokens bans it
    logits[:, 5] = 49.0  # the runner-up, unless the repetition penalty pushes it down
    sampler = Sampler({EOS})
    together = sampler.sample(logits, requests)
    alone = [sampler.sample(logits[i : i + 1], [req])[0] for i, req in enumerate(requests)]
    assert [r.token_id for r in together] == [r.token_id for r in alone]
    assert [r.logprob for r in together] == [r.logprob for r in alone]
    assert {together[i].token_id for i in (0, 1, 2)} == {EOS}
    assert together[3].token_id == 5, "min_tokens must ban EOS in the batched path too"
    assert together[1].logprob is not None and len(together[1].logprob.top) == 3
