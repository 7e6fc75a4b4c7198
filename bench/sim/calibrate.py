"""Measure this machine's engine rates for the simulator and record them (``calibration.json``).

    python -m bench.sim.calibrate                  # bundled SmolLM2 on the CPU, ~1 minute
    python -m bench.sim.calibrate --device cuda --model <path>

Runs ``worker.engine.LLMEngine`` directly (no server): prefill rate from whole prompts of
``--prompt-tokens`` random token ids with ``max_tokens=1`` and prefix caching off (so nothing
is reused), decode step time at several batch sizes from the steps after every request of
the batch has its first token. ``rates_from_samples`` fits the decode line; ``record_rates``
writes the file with the machine and the date. Failure modes: engine errors propagate (a
calibration that fails must not leave a half-written file: the file is written last).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from bench.sim.calibration import CALIBRATION_PATH, rates_from_samples, record_rates

DECODE_BATCHES = (1, 4)  # two points fit the step-time line; more cost minutes on a small CPU
DECODE_STEPS = 6  # steps timed per batch size, after the batch's prefills


def _engine(args):
    from worker.config import EngineConfig
    from worker.engine import LLMEngine

    config = EngineConfig(
        model=args.model, device=args.device, enable_prefix_caching=False, num_threads=args.threads
    )
    return LLMEngine(config)


def _params(max_tokens: int):
    from worker.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def measure_prefill_tokens_per_s(engine, num_tokens: int, repeats: int, rng) -> float:
    rates = []
    for r in range(repeats + 1):  # the first run warms up and is dropped
        prompt = [rng.randrange(1000, 20000) for _ in range(num_tokens)]
        engine.add_request(f"prefill-{r}", prompt, _params(1))
        start = time.perf_counter()
        _drain(engine)
        if r:
            rates.append(num_tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def measure_decode_step_s(engine, batch: int, rng) -> float:
    for i in range(batch):
        prompt = [rng.randrange(1000, 20000) for _ in range(16)]
        engine.add_request(f"decode-{batch}-{i}", prompt, _params(DECODE_STEPS + 4))
    for _ in range(3):  # prefills and the first decode steps
        engine.step()
    times = []
    for _ in range(DECODE_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    _drain(engine)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    rng = random.Random(0)
    load_before = os.getloadavg()
    started = time.perf_counter()
    engine = _engine(args)
    print(f"engine loaded in {time.perf_counter() - started:.1f} s", flush=True)
    prefill = measure_prefill_tokens_per_s(engine, args.prompt_tokens, args.repeats, rng)
    print(f"prefill {prefill:.0f} tok/s", flush=True)
    samples = [(b, measure_decode_step_s(engine, b, rng)) for b in DECODE_BATCHES]
    rates = rates_from_samples(
        prefill,
        samples,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        source=(
            f"measured: {args.model} on {args.device}, {args.threads or 'default'} threads, "
            "by bench/sim/calibrate.py"
        ),
    )
    # The load average says how much the rates are to be trusted on a shared machine.
    note = (
        f"prefill {args.prompt_tokens}-token prompts; decode samples (batch, step_s): {samples}; "
        "command: python -m bench.sim.calibrate "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}; "
        f"load average (1/5/15 min) before {load_before}, after {os.getloadavg()}"
    )
    path = record_rates(rates, CALIBRATION_PATH, note=note)
    print(f"decode steps (batch, s): {samples}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
