"""Where one decode step of the engine process's loop spends its time, part by part.

    python -m bench.step_anatomy [--batch 64 256] [--steps 100] [--overlap on off]
                                 [--async on off] [--tag _X]
    python -m bench.step_anatomy --device cuda --model smollm2   # the real engine on a GPU

The loop is ``EngineLoop.step`` with its ``("step", StepResult)`` message pickled, as the
engine process runs it, over ``batch`` requests decoding after 32-token prompts (greedy, EOS
ignored, all past their prefill before the measured steps). Timers wrap the loop's parts on
the engine's own objects, each time one of them is called:

- ``device_wait``: the wait for the forward pass, taken at the start of sampling (a CUDA
  synchronize, or the simulated engine's sleep), before the sampler's own work; or, for a
  step whose ids were taken on the device at its launch (``SampledIds``), the wait for them;
- ``sample``: the sampler after that wait (the argmax and the copy of the ids to the host);
- ``commit`` (``Scheduler.commit_computed``: computed tokens counted, filled blocks cached),
  ``append`` (``LLMEngine._append``, each sampled token with its stop checks, summed) and
  ``sample_rest``: the rest of ``LLMEngine.sample_step`` (the sampled sequences grouped by
  request, the step's metrics and KV events);
- ``schedule`` (``Scheduler.schedule``), ``execute`` (the runner: the step's inputs built,
  the forward pass launched), ``fill`` (on CUDA with graphs: the graphs' static inputs
  written, inside ``execute``) and ``launch_rest``: the rest of ``LLMEngine.launch_step``;
- ``deltas`` (``LLMEngine.deltas_of``: the text decoded, the streamed deltas built),
  ``stats`` (the replica stats and the metrics snapshot the step reports) and ``message``
  (the step's message pickled);
- ``other``: the step's wall time less those: the loop's own bookkeeping.

Each part is its own time: a timed call inside another counts for its own part. A row gives
each part's median ms per step and its share of the median step. Overlapped
(``EngineConfig.overlap_outputs``), ``deltas``, ``message`` and much of ``other`` run while
the device computes, so the device wait shrinks by what they take; what is left between two
forward passes is the critical path (``CRITICAL``): sampling, committing and appending,
the rest of the sampling step, and the next step's launch. Scheduled ahead
(``EngineConfig.async_scheduling``, ``--async on``), the next step is launched before this
one's tokens are waited for, so the critical path runs while the device computes too.

Each timer costs a fraction of a microsecond per call; ``append`` is called once per token,
so the parts add about 0.1 ms per step at batch 256 on top of what they measure. Defaults
run the simulated engine (``worker/sim_runner.py``, the ``gpu`` profile: its forward pass is a
sleep); ``--device cuda`` the real one (random weights of ``--model``'s shape when the
weights are not there: ``bench/gpu_check.py`` registers them). Writes
``bench/results/step_anatomy_<cpu|cuda>_<UTC date><--tag>.json`` and a ``.png`` of stacked
parts per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from multiprocessing.reduction import ForkingPickler

from bench.result_files import result_header, result_stem

PARTS = (
    "device_wait",
    "sample",
    "commit",
    "append",
    "sample_rest",
    "schedule",
    "execute",
    "fill",
    "launch_rest",
    "deltas",
    "stats",
    "message",
)
"""The parts, each its own time; ``other`` is what none of them took."""
CRITICAL = (
    "sample", "commit", "append", "sample_rest", "schedule", "execute", "fill", "launch_rest",
)  # fmt: skip
"""The parts an overlapped step cannot hide behind the device's work unless the next step is
scheduled ahead of this one's tokens."""


class _Timers:
    """Wall seconds per part within the current step, each part's own: a timed call made
    inside another counts for its own part, not the outer one's."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self._nested: list[list[float]] = []  # per open call: seconds of timed calls inside

    def call(self, part: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its own time added to ``part``."""
        inside = [0.0]
        self._nested.append(inside)
        start_s = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed_s = time.perf_counter() - start_s
            self._nested.pop()
            self.step[part] += elapsed_s - inside[0]
            if self._nested:
                self._nested[-1][0] += elapsed_s

    def wrap(self, obj, name: str, part: str) -> None:
        """Replaces ``obj.name`` (a bound method) with one timed as ``part``."""
        method = getattr(obj, name)
        setattr(obj, name, lambda *args, **kwargs: self.call(part, method, *args, **kwargs))

    def wrap_sampler(self, sampler, wait) -> None:
        """Times ``wait(logits)`` as ``device_wait``, then the sampler as ``sample``."""
        sample = sampler.sample

        def timed(logits, requests):
            self.call("device_wait", wait, logits)
            return self.call("sample", sample, logits, requests)

        sampler.sample = timed


def _wrap_sampled_ids(timers: _Timers):
    """Times ``SampledIds.tokens`` (the wait for a step's ids taken on the device, and their
    copy) as ``device_wait``; returns what puts it back."""
    from worker.sampler import SampledIds

    tokens = SampledIds.tokens
    SampledIds.tokens = lambda ids: timers.call("device_wait", tokens, ids)
    return lambda: setattr(SampledIds, "tokens", tokens)


def _device_wait(device: str):
    """What waits for a launched forward pass on ``device``."""
    if device.startswith("cuda"):
        import torch

        return lambda logits: torch.cuda.synchronize()
    return lambda logits: logits.wait() if hasattr(logits, "wait") else None


def anatomy(engine, steps: int, overlap: bool, device: str) -> dict:
    """Steps ``engine`` (its requests past their prefill) through ``EngineLoop`` ``steps``
    times with the parts timed; the row of medians (module docstring)."""
    from worker.engine_core import EngineLoop

    timers = _Timers()
    timers.wrap_sampler(engine.sampler, _device_wait(device))
    timers.wrap(engine.scheduler, "commit_computed", "commit")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.runner, "execute", "execute")
    timers.wrap(engine, "_append", "append")
    timers.wrap(engine, "deltas_of", "deltas")
    timers.wrap(engine, "sample_step", "sample_rest")
    timers.wrap(engine, "launch_step", "launch_rest")
    timers.wrap(engine, "stats", "stats")
    timers.wrap(engine, "metrics_snapshot", "stats")
    graphs = getattr(engine.runner, "step_graphs", None)
    if graphs is not None:
        timers.wrap(graphs, "_fill", "fill")
    restore = _wrap_sampled_ids(timers)
    loop = EngineLoop(engine)
    loop.overlap = overlap
    per_step: dict[str, list[float]] = defaultdict(list)
    batch = len(engine.scheduler.running)
    try:
        _steps(loop, steps, overlap, timers, per_step)
    finally:
        restore()
    assert len(engine.scheduler.running) == batch, "every request decodes in every step"
    medians = {key: round(statistics.median(values), 3) for key, values in per_step.items()}
    step_ms = medians["step"]
    return {
        "batch": batch,
        "overlap": overlap,
        "scheduled_ahead": overlap and engine.schedules_ahead,
        "steps": len(per_step["step"]),
        "ms_p50": medians,
        "share_of_step": {
            k: round(v / step_ms, 3) for k, v in medians.items() if k != "step" and step_ms
        },
        "critical_ms_p50": round(sum(medians[p] for p in CRITICAL), 3),
        "tokens_per_s": round(batch / step_ms * 1000, 1) if step_ms else 0.0,
    }


def _steps(loop, steps: int, overlap: bool, timers: _Timers, per_step: dict) -> None:
    """Runs ``steps`` timed loop steps into ``per_step`` (one more, untimed, first when
    overlapped: it only launches)."""
    for i in range(steps + 1):
        timers.step.clear()
        start_s = time.perf_counter()
        result = loop.step()
        pickled_s = time.perf_counter()
        ForkingPickler.dumps(("step", result))
        end_s = time.perf_counter()
        if i == 0 and overlap:
            continue
        parts = dict(timers.step)
        parts["message"] = end_s - pickled_s
        parts["step"] = end_s - start_s
        parts["other"] = parts["step"] - sum(parts.get(p, 0.0) for p in PARTS)
        for key in (*PARTS, "other", "step"):
            per_step[key].append(parts.get(key, 0.0) * 1000)


def sim_engine(batch: int, profile: str, model: str, async_scheduling: str = "auto"):
    """A simulated engine, its device wait slept, with ``batch`` requests past prefill."""
    from bench.engine_host import _sim_engine

    return _sim_engine(batch, profile, model, wait=True, async_scheduling=async_scheduling)


def plot(rows: list[dict], title: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(row: dict) -> str:
        how = "sequential"
        if row["overlap"]:
            how = "overlapped, ahead" if row["scheduled_ahead"] else "overlapped"
        return f"batch {row['batch']}\n{how}"

    labels = [label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 0.9 * len(rows) + 1.6))
    left = [0.0] * len(rows)
    colors = plt.get_cmap("tab20").colors
    for i, part in enumerate((*PARTS, "other")):
        widths = [r["ms_p50"].get(part, 0.0) for r in rows]
        hatch = "//" if part == "device_wait" else None
        color = "#dddddd" if part == "device_wait" else colors[(2 * i) % 20 + (i >= 10)]
        ax.barh(labels, widths, left=left, label=part, hatch=hatch, color=color)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, r in enumerate(rows):
        ax.text(left[i], i, f" {r['ms_p50']['step']:.2f} ms", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step (medians of each part; bar end: sum of the parts)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_anatomy", description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--overlap", nargs="+", choices=["on", "off"], default=["off", "on"])
    parser.add_argument(
        "--async",
        dest="async_",
        nargs="+",
        choices=["on", "off"],
        default=["off", "on"],
        help="with overlap on: schedule a step ahead of the last one's tokens, or not",
    )
    parser.add_argument("--device", default="cpu", help="cpu: the simulated engine; cuda: real")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--profile", default="gpu", help="sim profile (worker/sim_profiles.json)")
    parser.add_argument("--tag", default="", help="appended to the result file's name")
    args = parser.parse_args(argv)
    real = args.device.startswith("cuda")
    rows = []
    cells = [(o, a) for o in args.overlap for a in (args.async_ if o == "on" else ["off"])]
    for batch in args.batch:
        for overlap, ahead in cells:
            if real:
                from bench.engine_host import decode_engine

                engine, _ = decode_engine(
                    args.model, batch, args.steps, args.device, async_scheduling=ahead
                )
            else:
                engine = sim_engine(batch, args.profile, args.model, ahead)
            row = anatomy(engine, min(args.steps, 120), overlap == "on", args.device)
            rows.append(row)
            ms = row["ms_p50"]
            print(
                f"batch {batch:4d} overlap {overlap:3s} ahead {ahead:3s}:"
                f" step {ms['step']:.3f} ms,"
                f" critical {row['critical_ms_p50']:.3f} ms, "
                + ", ".join(f"{p} {ms[p]:.3f}" for p in (*PARTS, "other")),
                flush=True,
            )
    header = result_header("step_anatomy", "bench.step_anatomy", argv, device=args.device)
    engine_kind = "real engine" if real else f"simulated engine, {args.profile} profile"
    result = {**header, "engine": engine_kind, "rows": rows}
    stem = result_stem("step_anatomy", args.device, args.tag)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    where = header["device"] if real else header["machine"]
    plot(rows, f"Engine loop step, part by part ({engine_kind})\n{where}", stem.with_suffix(".png"))
    print(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
