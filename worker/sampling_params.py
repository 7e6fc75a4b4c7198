"""``SamplingParams``: how one request's tokens are chosen, validated on construction.

Every check raises ``ValueError`` naming the field, so the HTTP layer can turn it into a 400
that says what to fix. Defaults match vLLM's: greedy when ``temperature == 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from worker.structured_output import StructuredOutputSpec

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    """None means: up to the model's context."""
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the sampled token's logprob plus k top alternatives."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: every prompt token's logprob (the first has none) plus k top ones.
    Such a request computes its whole prompt: it takes no prefix-cache hits."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias in [-100, 100] added to the logits before sampling (OpenAI's)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutputSpec | None = None
    """Constrained decoding: the output must match this grammar (see
    worker/structured_output.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name} {msg}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        need(
            is_int(self.n) and 1 <= self.n <= MAX_N,
            "n",
            f"must be an integer in [1, {MAX_N}], got {self.n!r}",
        )
        need(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        need(
            is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        need(
            is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be a number in [0, 100], got {self.temperature!r}",
        )
        need(
            is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        need(
            is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            f"must be an integer >= 0 (or -1 to disable), got {self.top_k!r}",
        )
        need(
            is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )
        need(
            is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"must be in (0, 2], got {self.repetition_penalty!r}",
        )
        need(
            is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty!r}",
        )
        need(
            is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty!r}",
        )
        need(
            self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            "seed",
            f"must be a 64-bit integer, got {self.seed!r}",
        )
        need(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
        )
        for s in self.stop:
            need(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS,
                "stop",
                f"entries must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters",
            )
        need(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        need(
            self.logprobs is None
            or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
            "logprobs",
            f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}",
        )
        need(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
            "prompt_logprobs",
            f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}",
        )
        if self.logit_bias is not None:
            need(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to biases")
            need(
                all(is_int(t) and t >= 0 for t in self.logit_bias),
                "logit_bias",
                "keys must be token ids (non-negative integers)",
            )
            need(
                all(
                    is_num(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                    for b in self.logit_bias.values()
                ),
                "logit_bias",
                f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        need(
            self.structured_output is None
            or isinstance(self.structured_output, StructuredOutputSpec),
            "structured_output",
            f"must be a StructuredOutputSpec, got {type(self.structured_output).__name__}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters_tokens(self) -> bool:
        """Top-k, top-p or min-p narrows the tokens a draw chooses among."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
