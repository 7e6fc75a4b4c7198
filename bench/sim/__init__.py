"""The routing simulator: replicas with LRU block caches, workloads, policies, reports.

Modules: ``calibration`` (engine cost rates, the one place they live), ``cache`` (LRU tiers and
the oracle), ``workloads`` (seeded request streams), ``simulator`` (the event loop and
metrics), ``baselines`` (random, round robin, least loaded, pow2, SGLang, llm-d), ``ours``
(adapter for ``router.policy``), ``report`` (JSON rows and PNG plots). Entry point:
``bench/run_sim.py``. Nothing here talks to a network or a GPU; a run fails loudly
(``ValueError``) on bad sizes rather than producing numbers from a broken setup.
"""
