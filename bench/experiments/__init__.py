"""One-off experiments: each answered one question once, and its figures are in
``bench/README.md``; they are kept so the figures can be reproduced, not run routinely.

- ``decode_step``: one decode step of the engine benchmark's workload, timed and profiled in
  isolation (``python -m bench.experiments.decode_step``).
- ``kv_export_busy``: how long a busy engine process takes to answer a peer's KV export
  (``python -m bench.experiments.kv_export_busy``).
- ``kv_pull_served``: a served follow-up's TTFT when its prefix's holder is busy, KV pulls on
  against off, in one local Ray (``python -m bench.experiments.kv_pull_served``).

Each writes its result file to ``bench/results/`` through ``bench.result_files``, as the
routine benchmarks do. Not shipped in the wheel.
"""
