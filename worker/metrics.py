"""``EngineMetrics``: token counters and the measured prefill/decode rates the router uses.

Rates are exponential moving averages over steps, so they follow load changes within a few
steps; a step's time is split between its prefill and decode tokens by token count.
"""

from __future__ import annotations

from dataclasses import dataclass

RATE_SMOOTHING = 0.2
"""Weight of the newest step in the moving averages (about the last 5 steps dominate)."""


@dataclass
class EngineMetrics:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0

    def record_step(self, batch, sampling_reqs, step_s: float) -> None:
        self.num_steps += 1
        if step_s <= 0:
            return
        decode = sum(1 for n, r in zip(batch.num_new_tokens, batch.requests, strict=True) if n == 1 and r.output_token_ids)
        prefill = batch.total_tokens - decode
        rate = batch.total_tokens / step_s
        if prefill:
            self.prefill_tokens_per_s = self._ema(self.prefill_tokens_per_s, rate)
        if decode and not prefill:
            self.decode_tokens_per_s = self._ema(self.decode_tokens_per_s, rate)

    @staticmethod
    def _ema(old: float, new: float) -> float:
        return new if old == 0.0 else (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * new
