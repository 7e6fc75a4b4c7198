"""``EngineMetrics``: token counters and the measured prefill/decode rates the router uses;
``EngineMetricsSnapshot``: the engine's counters and gauges after a step, as exported.

Rates are exponential moving averages over steps (the decode time: over finished requests),
so they follow load changes within a few steps; a step's time is split between its prefill
and decode tokens by token count. Nothing here exports: ``EngineMetricsSnapshot.as_dict()``
is what travels to ``cluster/metrics.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

RATE_SMOOTHING = 0.2
"""Weight of the newest step in the moving averages (about the last 5 steps dominate)."""


@dataclass
class EngineMetrics:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    num_finished: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    decode_s: float = 0.0
    """Seconds a request runs from its first token to its finish, a moving average over the
    finished requests (0 until one finished): how soon running requests free their KV."""

    def record_finish(self, decode_s: float) -> None:
        """A request finished ``decode_s`` seconds after its first token."""
        weight = 1.0 if self.num_finished == 0 else RATE_SMOOTHING
        self.decode_s += weight * (decode_s - self.decode_s)
        self.num_finished += 1

    def record_step(self, batch, sampling_reqs, step_s: float) -> None:
        self.num_steps += 1
        if step_s <= 0:
            return
        decode = sum(
            1
            for n, r in zip(batch.num_new_tokens, batch.requests, strict=True)
            if n == 1 and r.output_token_ids
        )
        prefill = batch.total_tokens - decode
        rate = batch.total_tokens / step_s
        if prefill:
            self.prefill_tokens_per_s = self._ema(self.prefill_tokens_per_s, rate)
        if decode and not prefill:
            self.decode_tokens_per_s = self._ema(self.decode_tokens_per_s, rate)

    @staticmethod
    def _ema(old: float, new: float) -> float:
        return new if old == 0.0 else (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * new


@dataclass(frozen=True)
class HostTierMetrics:
    """The host-RAM KV tier's counters (``worker/host_cache.py``), present only with one."""

    host_cache_hits_total: int
    """Prompt tokens whose KV came back from host RAM."""
    host_kv_blocks_used: int
    host_kv_blocks_total: int
    kv_offload_bytes_total: int
    kv_onload_bytes_total: int


@dataclass(frozen=True)
class EngineMetricsSnapshot:
    """The engine's counters (``*_total``, since start) and gauges after one step; each field
    is named as the series ``cluster/metrics.py`` exports it."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    """Fraction (0..1) of the KV blocks in use, despite the name (vLLM's)."""
    prefix_cache_queries_total: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits_total: int
    """Prompt tokens found there."""
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_free_blocks: int
    num_total_blocks: int
    host: HostTierMetrics | None = None
    lora_requests: dict[str, tuple[int, int]] | None = None
    """With LoRA on: per adapter in use, (requests running, requests waiting)."""

    def as_dict(self) -> dict[str, float]:
        """Flat ``{series name: value}``; the host tier's names only when there is one, and
        with LoRA on one ``lora_running:<adapter>`` and one ``lora_waiting:<adapter>`` count
        per adapter in use (``lora_requests_of`` reads them back)."""
        flat = {
            name: value
            for name, value in asdict(self).items()
            if name not in ("host", "lora_requests")
        }
        if self.host is not None:
            flat.update(asdict(self.host))
        for name, (running, waiting) in (self.lora_requests or {}).items():
            flat[LORA_RUNNING + name] = float(running)
            flat[LORA_WAITING + name] = float(waiting)
        return flat


LORA_RUNNING = "lora_running:"
LORA_WAITING = "lora_waiting:"


def lora_requests_of(flat: dict[str, float]) -> tuple[list[str], list[str]]:
    """The adapters with running and with waiting requests in an ``as_dict()``, sorted."""
    running = sorted(
        k[len(LORA_RUNNING) :] for k, v in flat.items() if k.startswith(LORA_RUNNING) and v
    )
    waiting = sorted(
        k[len(LORA_WAITING) :] for k, v in flat.items() if k.startswith(LORA_WAITING) and v
    )
    return running, waiting
