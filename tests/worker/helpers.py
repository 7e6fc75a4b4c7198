"""Test helpers: transformers as the reference, a way to read our engine's prompt logits, and
a model laid out in the Hugging Face cache as huggingface_hub writes it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.worker.fake_hub import FakeRepo
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampling_params import SamplingParams

_RESOLVED_HERE = EngineConfig().resolved()
AUTO_HERE = (_RESOLVED_HERE.device, _RESOLVED_HERE.dtype)
"""What ``device``/``dtype`` ``auto`` resolve to on this machine: ``("cpu", "float32")`` on
CI, CUDA and bfloat16 (or float16) where a GPU is visible."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Translate to German: good morning",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\n",
    "Dear Sir or Madam,",
    "In 1492, Columbus",
    "The mitochondria is",
    "<html><body>",
    "SELECT * FROM users WHERE",
    "Roses are red, violets are",
    "The three laws of robotics are",
    "a" * 3,
    "🙂 Emoji test:",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore",
    "To be, or not to be,",
    "x = [i * i for i in range(10)]\nprint(",
]


def run(engine: LLMEngine, prompts: dict | None = None, *, check_invariants: bool = False) -> dict:
    """Submit ``{request_id: (token_ids, params)}`` (if given), step until idle, return the
    finished ``RequestOutput``s by id; optionally check the block pool after every step."""
    for rid, (ids, params) in (prompts or {}).items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check_invariants:
            engine.scheduler.check_invariants()
    return done


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt_ids) :].tolist()


def engine_prompt_logits(engine: LLMEngine, prompt_ids: list[int]) -> torch.Tensor:
    """Logits of the prompt's last position through the engine's scheduler and runner."""
    rid = f"logits-{len(engine._groups)}-{id(prompt_ids)}"
    engine.add_request(rid, prompt_ids, SamplingParams(temperature=0, max_tokens=1))
    batch = engine.scheduler.schedule()
    assert batch.total_tokens == len(prompt_ids), "the prompt must run in one step for this helper"
    logits, _ = engine.runner.execute(batch)
    engine.scheduler.commit_computed(batch)
    engine.abort(rid)
    return logits[0].cpu()


def check_every_step_against_eager(runner, graphs) -> list:
    """Makes ``runner`` run each step twice, from ``graphs`` and eagerly from the same KV,
    asserting equal logits bits and equal KV writes; returns the shapes seen (None: eager)."""
    original = runner.run_inputs
    shapes = []

    def checked(inputs):
        shape = graphs.shape_for(inputs)
        shapes.append(shape)
        kv_before = runner.kv.clone()
        runner.step_graphs = graphs
        padded = original(inputs).clone()
        kv_padded = runner.kv.clone()
        runner.kv.copy_(kv_before)
        runner.step_graphs = None
        eager = original(inputs)
        assert torch.equal(padded, eager), f"logits differ in {shape}"
        assert torch.equal(runner.kv, kv_padded), f"KV writes differ in {shape}"
        return eager

    runner.run_inputs = checked
    return shapes


def staggered_run(engine: LLMEngine, lengths: list[int]) -> dict[str, list[int]]:
    """Adds one request of each length per step (``max_tokens`` growing with its index),
    steps to the end; returns each request's tokens."""
    tokens = {}
    for step in range(300):
        if step < len(lengths):
            n = lengths[step]
            params = SamplingParams(temperature=0, max_tokens=4 + 3 * step, ignore_eos=True)
            engine.add_request(f"r{step}", [100 + (7 * step + j) % 900 for j in range(n)], params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
        if step >= len(lengths) and not engine.has_unfinished():
            break
    assert len(tokens) == len(lengths)
    return tokens


def lay_out_cache(cache: Path, repo_id: str, folder: str, revision: str = "main") -> Path:
    """The Hugging Face cache layout of one snapshot, as huggingface_hub writes it."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    sha = FakeRepo.sha(revision)
    snapshot = storage / "snapshots" / sha
    shutil.copytree(folder, snapshot)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(sha)
    return snapshot
