"""Tensor parallelism inside one replica: one model split over N ranks that run in lockstep.

- ``communicator.py``: the collectives (all-reduce, all-gather, step messages) over
  ``torch.distributed`` (gloo on CPU, NCCL on CUDA), one group per replica.
- ``sharding.py``: which slice of each weight a rank holds; loading only that slice.
- ``step_message.py``: what rank 0 sends the other ranks per step (only what changed).
- ``workers.py``: starting ranks 1..N-1 (local processes here; Ray actors via
  ``cluster/tp_workers.py``), the worker loop, liveness and shutdown.

Rank 0 is the engine's own ``ModelRunner``: it schedules, samples and talks to callers. The
others hold only their shard and KV cache. A dead rank makes rank 0's step raise; the engine
then reports itself dead (``worker/async_engine.py``) and its replica fails its health check.
Imports stay inside ``worker`` (no Ray here).
"""
