"""One local tensor-parallel worker process: ``python -m worker.parallel.local_worker``.

``LocalProcessLauncher`` (``worker/parallel/workers.py``) starts this module in a fresh
interpreter, so the parent's ``__main__`` is never imported again (a plain script without an
``if __name__ == "__main__":`` guard works). The parent writes one frame to the worker's stdin,
an 8-byte big-endian length and then the pickled ``(WorkerSpec, rank)``, and keeps the pipe
open for as long as it wants the worker alive.

The rest of stdin is the lifeline: a daemon thread reads it until end-of-file, which comes when
the parent closes the pipe or the parent process ends for any reason (SIGKILL included), and
then ends this process at once with ``os._exit``, even while the main thread is still importing
torch, loading its shard or waiting inside a collective. A worker therefore never outlives its
parent (by more than its interpreter's start-up, if the parent dies during that).

Failures: a missing or truncated frame (the parent died before sending it) exits with
``EXIT_NO_SPEC``; anything ``run_worker`` raises prints its traceback and exits non-zero, which
the parent sees as a dead rank. SIGINT is ignored: a Ctrl-C in a terminal reaches the whole
process group, and the parent alone decides when its workers end (by the stop message or by
closing the lifeline), so the user sees one ``KeyboardInterrupt``, not one per rank.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading

FRAME_LENGTH_BYTES = 8
"""Size of the frame header: the pickle's length, big-endian."""
EXIT_PARENT_GONE = 0
"""Exit status when the lifeline closes: the parent is gone or ended us on purpose; no error."""
EXIT_NO_SPEC = 3
"""Exit status when stdin ends before a whole ``(WorkerSpec, rank)`` frame arrived."""
_STDIN_FD = 0
_READ_CHUNK_BYTES = 4096


def encode_frame(spec: object, rank: int) -> bytes:
    """What the parent writes to a worker's stdin (``LocalProcessLauncher.start``)."""
    payload = pickle.dumps((spec, rank), protocol=pickle.HIGHEST_PROTOCOL)
    return len(payload).to_bytes(FRAME_LENGTH_BYTES, "big") + payload


def _read_exactly(fd: int, num_bytes: int) -> bytes | None:
    """``num_bytes`` from ``fd``, or None when it ends first."""
    chunks, remaining = [], num_bytes
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> bytes | None:
    """The pickled ``(WorkerSpec, rank)``, or None when stdin ends first."""
    header = _read_exactly(fd, FRAME_LENGTH_BYTES)
    if header is None:
        return None
    return _read_exactly(fd, int.from_bytes(header, "big"))


def _hold_lifeline(fd: int) -> None:
    """Blocks until the parent's end of the pipe closes, then ends the process."""
    try:
        while os.read(fd, _READ_CHUNK_BYTES):
            pass
    except OSError:
        pass
    os._exit(EXIT_PARENT_GONE)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("PREFIXSERVE_LOG_LEVEL", "WARNING"))
    frame = _read_frame(_STDIN_FD)
    if frame is None:
        print("prefixserve TP worker: stdin ended before the worker spec arrived", file=sys.stderr)
        return EXIT_NO_SPEC
    lifeline = threading.Thread(
        target=_hold_lifeline, args=(_STDIN_FD,), name="tp-lifeline", daemon=True
    )
    lifeline.start()  # before the heavy imports below (torch, the model code)
    spec, rank = pickle.loads(frame)
    from worker.parallel.workers import run_worker

    run_worker(spec, rank, local=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
