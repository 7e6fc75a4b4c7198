"""``bench.sampling``: the sampler per step for every kind of row, its result file and plot;
its logits are a language model's shape (a few likely tokens, a long tail)."""

from __future__ import annotations

import json

import torch

import bench.sampling as sampling
from worker.sampler import Sampler


def test_the_logits_are_peaked_like_a_models():
    logits = sampling.zipf_logits(4, 5000, "cpu")
    probs = torch.softmax(logits, dim=-1)
    top = probs.topk(50, dim=-1).values.sum(dim=-1)
    assert bool((top > 0.5).all()) and bool((top < 0.999).all())
    assert not torch.equal(logits[0], logits[1])


def test_every_kind_takes_its_path_and_the_run_writes_rows_and_a_plot(tmp_path, monkeypatch):
    drawn = [
        Sampler.plain_drawn(sampling.requests_for(1, sampling.SamplingParams(**kw))[0])
        for kw in sampling.KINDS.values()
    ]
    assert drawn == [False, True, True, True, True, False]  # greedy; penalty: on the host
    monkeypatch.setattr(
        sampling, "result_stem", lambda name, device, tag: tmp_path / f"{name}{tag}"
    )
    args = ["--batch", "1", "3", "--vocab", "300", "--steps", "2"]
    assert sampling.main(args) == 0
    result = json.loads((tmp_path / "sampling.json").read_text())
    assert result["vocab"] == 300 and result["benchmark"] == "sampling"
    assert [(r["kind"], r["batch"]) for r in result["rows"]] == [
        (kind, batch) for kind in sampling.KINDS for batch in (1, 3)
    ]
    assert all(r["ms_per_step"] > 0 for r in result["rows"])
    assert (tmp_path / "sampling.png").stat().st_size > 0


def test_the_engine_benchmark_samples_every_request_when_asked(tiny_models):
    from bench.engine import run_ours

    prompts = [[5 + i, 6, 7, 8, 9] for i in range(6)]
    greedy = run_ours(prompts, 5, True, 4, model=tiny_models["llama"])
    sampled = run_ours(prompts, 5, True, 4, model=tiny_models["llama"], temperature=0.8, top_p=0.9)
    assert greedy["output_tokens"] == sampled["output_tokens"] == 30
