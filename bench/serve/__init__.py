"""Serving benchmark: our engine offline, our HTTP server, and llama.cpp, one run.

    python -m bench.serve                        # offline + served (+ llama when its binary exists)
    python -m bench.serve --llama-server PATH --cluster-replicas 2
    python -m bench.serve --quick --out-dir /tmp/serve_quick   # smoke: 8 requests, 16 tokens, c=1,4

Workload (``bench.loadgen.workloads.load_workload``): ``bench.engine.make_workload``'s (64
requests over 4 system prompts of 300-500 tokens, a distinct question each), sent as chat
messages (system prompt text + user question); 64 greedy output tokens per request with EOS
ignored, so every system does the same work. ``make_chat_workload`` keeps make_workload's
system-prompt tokens and questions and adds the token ids the server's chat template gives
for those messages (``Tokenizer.apply_chat_template``); the offline run feeds exactly those
ids to the engine.

Systems, each (system, concurrency) in a fresh process, so each run starts with a cold prefix
cache and no state from another run:

``--threads`` (default 2) sets the threads of the three one-replica systems:

- ``offline``: ``worker.LLM``'s engine in a child interpreter, ``max_num_seqs`` = concurrency,
  2 torch threads; it keeps ``c`` requests in flight as the HTTP client does, and reads TTFT
  from the engine's outputs (first token time - arrival time, per request).
- ``served``: ``prefixserve serve --num-replicas 1 --num-threads 2`` on a free loopback port
  (``--num-kv-blocks`` as offline; default routing).
- ``llama``: llama.cpp's ``llama-server -m <the same GGUF> -t 2 -np c -c c*1024`` (the GGUF is
  Q4_1, run natively; our engine runs the same weights dequantised to float32). Its binary:
  ``--llama-server PATH``, by default ``.tools/llama.cpp/build/bin/llama-server`` when
  ``scripts/build_llama_server.sh`` built it; without one the llama rows say "skipped".
- ``--cluster-replicas N``: ``prefixserve serve --num-replicas N --num-threads 1`` (prefix
  routing) at ``--cluster-concurrency`` (8), and, when llama-server and sglang-router are both
  available, N llama-servers (``-t 1 -np c/N``) behind ``sglang_router.launch_router --policy
  cache_aware`` at the same concurrency.

Every HTTP system gets the same streaming OpenAI client (``bench.loadgen.client.run_benchmark``:
``/v1/chat/completions``, stream, temperature 0, ``ignore_eos``, ``stream_options.include_usage``)
with ``c`` requests in flight. Concurrency 1 runs the first ``--c1-requests`` (16)
requests only, to keep it short. One warm-up request per server precedes the measured run.

Per (system, concurrency): output tok/s (output tokens / wall time from first send to last
finish), requests/s, TTFT p50/p90/p99, ITL and TPOT means, cached-token ratio (from
``usage.prompt_tokens_details.cached_tokens``), failures, CPU seconds of the server's process
tree (the offline child's own) during the run, and whether each greedy output equals the
offline engine's at the same concurrency. ``--idle-s S`` also measures each HTTP system's
processes over S idle seconds after the warm-up (``idle_cpu_s``: CPU seconds per second with
no request in flight, by process in ``idle_cpu_s_by_process``): on a machine whose cores the
engine fills, the server's floor that every run pays.
Writes ``<out-dir>/serve_<UTC date>[_quick].json`` and ``.png`` and prints a markdown table.

Failure modes: a server that does not answer ``GET /health`` within ``--startup-timeout-s``,
exits early or fails its warm-up is stopped and its row gets an ``error``; the other systems
still run. Every process this starts is stopped on the way out (SIGINT to the server, then
SIGTERM and SIGKILL to its process group and known descendants), also on errors, Ctrl-C and
SIGTERM. Server logs go to ``--log-dir``. Timings on a shared machine are only smoke checks:
the header records the load average at start and end.
"""

# Each module's docstring says what it owns and how it fails: stats (row metrics), processes
# (child processes and stopping them), systems (the plan and starting servers), offline and
# http_load (one run each), report (table, plot, files), cli. The chat workload is
# bench.loadgen.workloads's, sent through bench.loadgen.client.
# The docstring above is the --help text. Patch STOP_GRACE_S / KILL_GRACE_S in .processes.

from .cli import DEFAULT_LLAMA_SERVER, RESULTS, build_parser, main, parse_args
from .http_load import run_http_system, warm_up
from .offline import ROW_PREFIX, WARMUP, run_offline, run_offline_child
from .processes import REPO, Server, server_env
from .report import markdown, plot, write_results
from .stats import same_as_offline, summarize
from .systems import SYSTEMS, Run, has_sglang_router, plan, start_servers

__all__ = [
    "DEFAULT_LLAMA_SERVER",
    "REPO",
    "RESULTS",
    "ROW_PREFIX",
    "SYSTEMS",
    "WARMUP",
    "Run",
    "Server",
    "build_parser",
    "has_sglang_router",
    "main",
    "markdown",
    "parse_args",
    "plan",
    "plot",
    "run_http_system",
    "run_offline",
    "run_offline_child",
    "same_as_offline",
    "server_env",
    "start_servers",
    "summarize",
    "warm_up",
    "write_results",
]
