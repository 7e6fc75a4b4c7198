"""The offline system: our engine (``worker.LLM``) driven in-process like the HTTP client.

Owns ``run_offline`` (``concurrency`` requests in flight, TTFT from the engine's per-request
metrics, CPU from ``getrusage``) and ``run_offline_child``, which runs it in a fresh
``python -m bench.serve --child-offline c`` so each run starts with a cold prefix cache; the
child prints its row as the last ``ROW_PREFIX`` line.

Failure modes: a child that exceeds ``--run-timeout-s``, exits non-zero or prints no row gives
the row an ``error`` (its stderr, not captured, is in the terminal above). A request the
engine finishes with an error is a failed record.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

from bench.loadgen.workloads import ChatRequest

from .processes import REPO, server_env
from .stats import summarize
from .systems import Run

ROW_PREFIX = "ROW "
WARMUP = [{"role": "user", "content": "Say hi."}]


def run_offline(
    workload: Sequence[ChatRequest],
    concurrency: int,
    max_tokens: int,
    threads: int,
    num_kv_blocks: int,
) -> dict:
    """Our engine in this process; ``concurrency`` requests in flight, like the HTTP client."""
    import resource

    from tqdm import tqdm

    from worker import LLM, SamplingParams

    llm = LLM(
        model="smollm2", max_num_seqs=concurrency, num_threads=threads, num_kv_blocks=num_kv_blocks
    )
    engine = llm.engine
    llm.generate(
        [list(llm.tokenizer.apply_chat_template(WARMUP))],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(workload)[::-1]
    last_token: dict[str, float] = {}
    records: dict[str, dict] = {}
    bar = tqdm(total=len(workload), desc=f"offline c={concurrency}", unit="req", file=sys.stderr)

    def submit() -> None:
        req = pending.pop()
        rid = f"r{req.index}"
        records[rid] = {"index": req.index, "success": False, "error": "", "itl_s": []}
        engine.add_request(rid, list(req.token_ids), params)

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    while pending and len(records) < concurrency:
        submit()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            rec = records[out.request_id]
            if out.outputs and out.outputs[0].new_token_ids:
                if out.request_id in last_token:
                    rec["itl_s"].append(now - last_token[out.request_id])
                last_token[out.request_id] = now
            if out.finished:
                m = {k: v or 0.0 for k, v in out.metrics.items()}
                ttft = m.get("first_token_time", 0.0) - m.get("arrival_time", 0.0)
                rec.update(
                    success=out.error is None,
                    error=out.error or "",
                    prompt_tokens=len(out.prompt_token_ids),
                    output_tokens=len(out.token_ids),
                    cached_tokens=out.num_cached_tokens,
                    ttft_s=ttft,
                    latency_s=m.get("finished_time", 0.0) - m.get("arrival_time", 0.0),
                    text=out.text,
                )
                bar.update()
                if pending:
                    submit()
    duration = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    bar.close()
    row = summarize(sorted(records.values(), key=lambda r: r["index"]), duration)
    row["cpu_s"] = round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1)
    return row


def run_offline_child(run: Run, args, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.serve", *argv, "--child-offline", str(run.concurrency)]
    env = server_env(run.threads)
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env, timeout=args.run_timeout_s
        )
    except subprocess.TimeoutExpired:
        return {
            "error": f"offline run exceeded {args.run_timeout_s:.0f} s",
            "command": shlex.join(cmd),
        }
    rows = [
        line[len(ROW_PREFIX) :] for line in proc.stdout.splitlines() if line.startswith(ROW_PREFIX)
    ]
    if proc.returncode != 0 or not rows:
        return {
            "error": f"offline child failed (exit {proc.returncode}); its stderr is above",
            "command": shlex.join(cmd),
        }
    return {"command": shlex.join(cmd), **json.loads(rows[-1])}
