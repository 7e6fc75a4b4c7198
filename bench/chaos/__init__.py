"""Chaos benchmark: faults injected under a steady load of streaming requests, with figures.

``python -m bench.chaos`` starts ``prefixserve serve`` (2 engine replicas, 2 ingress
replicas, the bundled model) once, runs a fault-free load to record every request's greedy
text, then for each fault runs the same load again and injects the fault a third of the way
in. Per fault it reports:

- ``lost``: requests cut after some text without ``[DONE]`` and without an error; must be 0;
- ``errored``: requests that got an HTTP error or an ``error`` event, lost their connection
  or ended before any text (target 0 for replica and index faults: the ingress fails streams
  over);
- ``mismatched``: finished requests whose text differs from the fault-free run;
- TTFT p99 during the fault (requests started in the ``DURING_WINDOW_S`` after it) and after
  recovery;
- ``recovery_s``: from the fault until a probe request succeeds and the killed kind of
  process is back to its count;
- ``leaked_blocks``: KV blocks still held once the load is over and the replicas idle
  (``kv_cache_usage_perc`` x the replica's KV blocks); must be 0.

Faults: an engine replica SIGKILLed; the embedded index actor SIGKILLed; an ingress replica
SIGKILLed; a client disconnect storm (streams dropped after their first token); slow readers
(streams never drained for a while). With ``--redis`` the index is a redis-server this script
starts, and two more faults run: Redis killed then restarted, and Redis slowed by a TCP proxy
adding latency. ``tp_worker_kill`` SIGKILLs one tensor-parallel worker (rank 1) of an engine
replica: it runs on a second server started with ``--tensor-parallel-size 3`` (SmolLM2's 9
query and 3 KV heads split in 3) after the others, with its own fault-free run (outputs may
differ between TP degrees). Writes
``bench/results/chaos_<date>.{json,md}``.

The parts are importable: ``load`` (``Target``, ``Load``, the closed loop and the storms,
sent through ``bench.loadgen.client``), ``faults``
(what is killed or slowed, and how), ``run`` (``run_baseline``, ``run_fault``: one load with
one fault, its recovery and leak checks), ``report`` (``summarize``, ``markdown``) and ``cli``
(the servers and the result files). The CI-sized suite in ``tests/chaos/`` runs them against a
tiny-model cluster started by pytest, with the pytest process as the root whose descendants
faults may touch.

Failure modes: the server not starting raises (its log is in the temporary folder printed
at the start); a fault whose process cannot be found is reported as skipped, not as a pass.
"""
