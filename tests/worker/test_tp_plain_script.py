"""Tensor parallelism from a plain script: the README's ``LLM(...,
tensor_parallel_size=N)`` example without an ``if __name__ == "__main__":`` guard runs, and an
``LLM`` left open ends its workers quietly at exit, when collected, or when its process dies.

The tiny random-weight llama (4 heads, 2 KV heads, hidden size 64) splits over 2 ranks, not 3;
the bundled model's TP=3 split is covered by ``test_tensor_parallel.py``. Each test starts
real worker processes (a fresh interpreter each, a few seconds on the 2-core CI machine).
"""

from __future__ import annotations

import datetime
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import torch.distributed as dist

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.llm import LLM
from worker.parallel.workers import LocalProcessLauncher
from worker.sampling_params import SamplingParams

PROMPT = "The capital of France is"
MAX_TOKENS = 8
SCRIPT_TIMEOUT_S = 240.0
"""Bounds a hang (a worker that never ends keeps the script from exiting), not the run time."""
WORKER_GONE_DEADLINE_S = 30.0
"""How long a worker may take to end after its parent is gone (the lifeline ends it at once)."""

# The README's example, unguarded: module-level code that a re-import of __main__ would rerun.
PLAIN_SCRIPT = """\
    import sys

    from worker import LLM, SamplingParams

    MODEL = sys.argv[1]
    GREEDY = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)

    with LLM(model=MODEL, tensor_parallel_size=2, num_kv_blocks=64, device="cpu") as tp:
        print("with-block:", tp.generate([{prompt!r}], GREEDY)[0].token_ids, flush=True)

    llm = LLM(model=MODEL, tensor_parallel_size=2, num_kv_blocks=64, device="cpu")  # never shut
    print("left open:", llm.generate([{prompt!r}], GREEDY)[0].token_ids, flush=True)
"""

# A parent that starts one worker against the test's store, waits until the worker has joined
# it (it is still starting: its gloo group waits for a rank 0 that never comes), prints the
# worker's pid and dies by SIGKILL. The store outlives the parent, so only the lifeline can
# end the worker before its group's timeout.
DYING_PARENT_SCRIPT = """\
    import datetime, os, signal, sys

    import torch.distributed as dist

    from worker.config import EngineConfig
    from worker.parallel.workers import LocalProcessLauncher, WorkerSpec

    model, port = sys.argv[1], int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=60))
    launcher = LocalProcessLauncher()
    config = EngineConfig(model=model, tensor_parallel_size=2, device="cpu")
    launcher.start(WorkerSpec(config, model, 256, "127.0.0.1", port, "dying-parent"))
    store.wait(["ready/1"])
    print(launcher._procs[1].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _reference_tokens(model: str) -> list[int]:
    llm = LLM(model=model, num_kv_blocks=64, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].token_ids


def test_unguarded_script_runs_and_exits_quietly(tmp_path, tiny_models):
    """(a) a ``with`` block and (b) an ``LLM`` never shut down (its finalizer runs at exit),
    in one script with no main guard: exit status 0, the right tokens, no traceback, and both
    workers ended by rank 0's stop message."""
    model = tiny_models["llama"]
    script = _write(tmp_path, "plain.py", PLAIN_SCRIPT.format(max_tokens=MAX_TOKENS, prompt=PROMPT))
    started = time.monotonic()
    env = {**os.environ, "PREFIXSERVE_LOG_LEVEL": "INFO"}  # workers say how they ended
    proc = subprocess.run(
        [sys.executable, str(script), model],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        cwd=tmp_path,
        env=env,
    )
    elapsed_s = time.monotonic() - started
    report = (
        f"exit {proc.returncode} after {elapsed_s:.1f}s\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert proc.returncode == 0, report
    expected = _reference_tokens(model)
    assert f"with-block: {expected}" in proc.stdout.splitlines(), report
    assert f"left open: {expected}" in proc.stdout.splitlines(), report
    assert "Traceback" not in proc.stderr, report
    assert "Connection closed" not in proc.stderr, report
    assert "bootstrapping phase" not in proc.stderr, report
    # Both workers got rank 0's stop message: the second one from the finalizer at exit, not
    # from a closed connection (which would log "rank 0 is gone") or the lifeline.
    assert proc.stderr.count("TP worker 1 of replica-0: stopped by rank 0") == 2, report


def test_collected_engine_ends_its_workers(tiny_models):
    """The finalizer holds the group, not the engine: dropping the last reference is enough."""
    launcher = LocalProcessLauncher()
    config = EngineConfig(
        model=tiny_models["llama"], num_kv_blocks=64, tensor_parallel_size=2, device="cpu"
    )
    engine = LLMEngine(config, launcher=launcher)
    collected = weakref.ref(engine)
    assert launcher.dead_ranks() == []
    del engine
    gc.collect()
    assert collected() is None, "something still holds the engine"
    assert launcher.dead_ranks() == [1], "the finalizer stops (and so joins) the workers"


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped (a container's init may not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_worker_ends_when_its_parent_is_killed_while_it_starts(tmp_path, tiny_models):
    script = _write(tmp_path, "dying_parent.py", DYING_PARENT_SCRIPT)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        2,
        True,
        datetime.timedelta(seconds=SCRIPT_TIMEOUT_S),
        wait_for_workers=False,
    )
    command = [sys.executable, str(script), tiny_models["llama"], str(store.port)]
    parent = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    pid_line = parent.stdout.readline()
    assert parent.wait(SCRIPT_TIMEOUT_S) == -signal.SIGKILL, parent.stderr.read()
    worker_pid = int(pid_line)
    deadline = time.monotonic() + WORKER_GONE_DEADLINE_S
    while not _gone(worker_pid):
        if time.monotonic() > deadline:
            os.kill(worker_pid, signal.SIGKILL)
            raise AssertionError(
                f"worker {worker_pid} outlived its parent by {WORKER_GONE_DEADLINE_S:.0f}s"
            )
        time.sleep(0.05)
    stderr = parent.stderr.read()  # the worker shared it; it is closed now
    assert "Traceback" not in stderr, stderr
