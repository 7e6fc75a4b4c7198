"""What the engine hands back: one ``RequestOutput`` per request per step it advanced.

Fields are cumulative (the whole text and token list so far), plus the ``new_token_ids`` and
``new_text`` of this step so a streaming server need not diff.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"
    """EOS, a stop token id or a stop string."""
    LENGTH = "length"
    """max_tokens reached, or the model's context is full."""
    ABORT = "abort"
    """Aborted by the caller (client gone, shutdown)."""
    ERROR = "error"
    """The engine failed while running this request; ``error`` says why."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the server answers 429 with Retry-After."""


class EngineDeadError(RuntimeError):
    """The engine loop has died; every pending request fails with this."""


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """Top alternatives as (token id, logprob), best first; empty unless asked for."""
    rank: int | None = None
    """1 + how many tokens are more likely than this one; filled for prompt logprobs only."""


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the output, if one did."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens)."""
    finished: bool = False
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    """Timing: arrival_time, first_scheduled_time, first_token_time, finished_time
    (time.monotonic seconds; None while not yet reached)."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Asked for with ``SamplingParams.prompt_logprobs``: one entry per prompt token (None for
    the first, which nothing predicts). Complete from the output with the first new tokens on;
    None before that and when not asked for."""

    @property
    def carries_first_tokens(self) -> bool:
        """Whether this output holds choice 0's first tokens: where a server that sends only
        what is new sends ``prompt_logprobs``, once."""
        first = next((c for c in self.outputs if c.index == 0), None)
        return first is not None and 0 < len(first.new_token_ids) == len(first.token_ids)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids
