"""Drawn rows: one batched pass whose every row gets what it would alone, from the right
distribution, with its draw a function of the row's key only."""

from __future__ import annotations

import math

import pytest
import torch

from tests.worker.test_sampler import request
from worker import random_sampling
from worker.random_sampling import random_tokens, uniform
from worker.sampler import Sampler, sampling_key
from worker.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def draw(logits, keys, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[int]:
    n = len(keys)
    return random_tokens(
        logits, keys, [temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n
    ).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_draws_the_same_token_alone_in_a_batch_and_in_any_order(device):
    gen = torch.Generator().manual_seed(0)
    rows = 24
    logits = (torch.randn(rows, 500, generator=gen) * 3).to(device)
    keys = [sampling_key(seed, 0, 7) for seed in range(rows)]
    temperature = [0.3 + 0.1 * (i % 9) for i in range(rows)]
    top_k = [(0, 5, 50, 499, 500, 1000)[i % 6] for i in range(rows)]
    top_p = [(1.0, 0.9, 0.5, 0.05)[i % 4] for i in range(rows)]
    min_p = [(0.0, 0.0, 0.1, 0.3, 0.0)[i % 5] for i in range(rows)]
    together = random_tokens(logits, keys, temperature, top_k, top_p, min_p).tolist()
    alone = [
        random_tokens(
            logits[i : i + 1], [keys[i]], [temperature[i]], [top_k[i]], [top_p[i]], [min_p[i]]
        ).item()
        for i in range(rows)
    ]
    assert together == alone
    order = list(reversed(range(rows)))
    shuffled = random_tokens(
        logits[order],
        [keys[i] for i in order],
        [temperature[i] for i in order],
        [top_k[i] for i in order],
        [top_p[i] for i in order],
        [min_p[i] for i in order],
    ).tolist()
    assert shuffled == [together[i] for i in order]
    assert len(set(together)) > rows // 2, "different keys and rows must draw differently"


def test_a_rows_draw_is_uniform_and_a_function_of_its_key_only():
    keys = [
        sampling_key(seed, index, position)
        for seed in range(20)
        for index in range(2)
        for position in range(500)
    ]
    u = torch.tensor([uniform(k) for k in keys], dtype=torch.float64)
    assert bool(((u > 0) & (u < 1)).all())
    assert uniform(keys[5]) == uniform(keys[5]) and len(set(u.tolist())) == len(keys)
    assert abs(u.mean().item() - 0.5) < 0.01
    counts = torch.histc(u, bins=10, min=0.0, max=1.0) / len(keys)
    assert (counts - 0.1).abs().max().item() < 0.01


def test_candidates_give_what_the_whole_vocabulary_gives(monkeypatch):
    """A filtered row draws among its likeliest tokens; where its filters end within them it
    gets the token the whole vocabulary in the same order gives, and where they reach past
    them (top-p 0.999 over a flat row, a top-k above the candidates) it is drawn over the
    whole vocabulary."""
    gen = torch.Generator().manual_seed(2)
    vocab = 2000
    logits = torch.randn(12, vocab, generator=gen) * 4
    logits[3] = torch.randn(vocab, generator=gen) * 0.01  # flat: top-p 0.999 reaches past
    keys = [sampling_key(seed, 0, 1) for seed in range(12)]
    temperature = [0.8] * 12
    top_k = [0, 10, 0, 0, 600, 0, 40, 0, 0, 1999, 0, 300]
    top_p = [0.9, 1.0, 0.5, 0.999, 1.0, 0.95, 0.9, 0.7, 0.99, 1.0, 0.999, 0.8]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0]
    # A top-k past the candidates renormalizes over its k tokens, even where top-p ends
    # within the candidates: those rows are drawn over the whole vocabulary too.
    flat = torch.randn(4, vocab, generator=gen) * 0.5
    logits = torch.cat([logits, flat])
    keys += [sampling_key(seed, 0, 1) for seed in range(100, 104)]
    temperature += [1.0] * 4
    top_k += [400] * 4
    top_p += [0.05] * 4
    min_p += [0.0] * 4
    args = (keys, temperature, top_k, top_p, min_p)
    over_candidates = random_tokens(logits, *args).tolist()
    monkeypatch.setattr(random_sampling, "CANDIDATES", vocab)
    over_everything = random_tokens(logits, *args).tolist()
    assert over_candidates == over_everything


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.7
    n = 20000
    keys = [sampling_key(seed, 0, 0) for seed in range(n)]
    tokens = torch.tensor(draw(logits.expand(n, -1), keys, temperature))
    seen = torch.bincount(tokens, minlength=6).double() / n
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    # Binomial standard error at n=20000 is at most 0.0035: five of them.
    assert (seen - expected).abs().max().item() < 0.018, (seen, expected)


def test_filters_keep_only_what_they_allow():
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    n = 4000
    keys = [sampling_key(seed, 0, 0) for seed in range(n)]
    rows = logits.expand(n, -1)

    def drawn(**filters) -> set[int]:
        return set(draw(rows, keys, **filters))

    assert drawn() == set(range(6))
    assert drawn(top_k=2) == {0, 1}
    assert drawn(top_p=0.5) == {0, 1}, "the smallest prefix reaching top_p: 0.4 + 0.25"
    assert drawn(top_p=0.35) == {0}
    assert drawn(min_p=0.3) == {0, 1, 2}, "kept: p >= 0.3 * 0.4"
    assert drawn(top_k=3, top_p=0.9, min_p=0.5) == {0, 1}
    # A low temperature sharpens before the filters: 0.4 against 0.25 becomes near-certain.
    assert drawn(temperature=0.05) == {0}


def test_the_row_by_row_path_draws_what_the_batched_one_draws():
    """A row with penalties or a grammar is transformed on the host and drawn alone; with
    nothing to transform, that path gives the token the batched one gives."""
    sampler = Sampler({2})
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 300, generator=gen) * 2
    params = SamplingParams(temperature=0.9, top_p=0.8, max_tokens=8)
    requests = [request(seed, params, outputs=seed % 5) for seed in range(16)]
    assert all(Sampler.plain_drawn(req) for req in requests)
    batched = [r.token_id for r in sampler.sample(logits, requests)]
    by_row = [sampler._choose(logits[i], req) for i, req in enumerate(requests)]
    assert batched == by_row


def test_a_drawn_request_switches_to_the_batched_path_once_min_tokens_are_out():
    params = SamplingParams(temperature=1.0, min_tokens=2, max_tokens=8)
    assert not Sampler.plain_drawn(request(3, params, outputs=1))
    assert Sampler.plain_drawn(request(3, params, outputs=2))
    penalized = SamplingParams(temperature=1.0, presence_penalty=0.5, max_tokens=8)
    assert not Sampler.plain_drawn(request(3, penalized, outputs=4))
    assert not Sampler.plain_drawn(request(3, SamplingParams(temperature=0.0), outputs=4))


def test_keys_change_with_the_position_so_a_stream_is_not_one_token_repeated():
    logits = torch.zeros(1, 50)
    tokens = {draw(logits, [sampling_key(9, 0, position)])[0] for position in range(40)}
    assert len(tokens) > 20
    assert math.isclose(len(tokens) / 40, 1.0, abs_tol=0.5)
