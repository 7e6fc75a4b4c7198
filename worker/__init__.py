"""One replica's engine: config, requests, block pool, scheduler, model runner, sampler.

No Ray and no Redis here; the only part of ``router`` used is ``router.protocol``.
"""

from worker.config import EngineConfig
from worker.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy, so `from worker import SamplingParams` stays cheap for the HTTP ingress.
    if name == "LLM":
        from worker.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from worker.async_engine import AsyncEngine

        return AsyncEngine
    if name == "LLMEngine":
        from worker.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["EngineConfig", "SamplingParams", "LLM", "AsyncEngine", "LLMEngine"]
