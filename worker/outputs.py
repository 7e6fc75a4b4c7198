"""What the engine hands back, in two shapes.

``OutputDelta`` (``LLMEngine.step_deltas``): what one step added to one request, and only
that: each advanced choice's new token ids, new text and new logprobs, its finish once. This
is what a server streams: built once in the engine, it crosses the engine socket, the
replica and the replica-to-ingress hop as it is, and the ingress accumulates it once
(``cluster/responses.py``). A step's deltas never copy what earlier steps produced.

``RequestOutput`` (``LLMEngine.step``, ``LLM.generate``): the cumulative view offline
callers want (the whole text and token list so far, plus this step's ``new_token_ids`` and
``new_text``).
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


@dataclass(slots=True)
class ChoiceDelta:
    """What one step added to one choice (sequence) of a request."""

    index: int
    new_token_ids: list[int]
    new_text: str = ""
    new_logprobs: list[TokenLogprob] | None = None
    """The new tokens' logprobs, when the request asked for them."""
    finish_reason: FinishReason | None = None
    """Set in the delta that ends the choice, and in no other."""
    stop_reason: str | int | None = None
    text: str | None = None
    """The choice's whole text, in its finishing delta only: a stop string may cut what
    earlier deltas' ``new_text`` said."""

    # Pickled as a plain tuple, part of its delta's wire form (``deltas_to_wire``).
    def __getstate__(self) -> tuple:
        return (
            self.index,
            self.new_token_ids,
            self.new_text,
            self.new_logprobs,
            self.finish_reason,
            self.stop_reason,
            self.text,
        )

    def __setstate__(self, state: tuple) -> None:
        (
            self.index,
            self.new_token_ids,
            self.new_text,
            self.new_logprobs,
            self.finish_reason,
            self.stop_reason,
            self.text,
        ) = state

    def extend(self, later: ChoiceDelta) -> None:
        """Adds ``later`` (the same choice, a later step) to this delta."""
        self.new_token_ids += later.new_token_ids
        self.new_text += later.new_text
        if later.new_logprobs is not None:
            self.new_logprobs = (self.new_logprobs or []) + later.new_logprobs
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
            self.text = later.text


@dataclass(slots=True)
class OutputDelta:
    """What one engine step added to one request: the one shape a streamed token takes from
    the engine to the ingress. Emitted only for a request a step advanced (new tokens) or
    ended; a prefill chunk that produced no token emits nothing."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens)."""
    choices: list[ChoiceDelta]
    """The choices this step advanced or ended, by ``index``."""
    finished: bool = False
    """Every choice of the request has ended."""
    error: str | None = None
    """Why the engine failed this request (then ``finished``)."""
    metrics: dict | None = None
    """Engine timestamps (``RequestOutput.metrics``), in the request's first delta and its
    last only: what the replica's latency histograms need."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Once, in the delta with choice 0's first token, when asked for."""
    seq: int = 0
    """The delta's number in the replica's stream of this request (stamped by the replica:
    the ingress checks that none was lost)."""
    replica_id: str = ""
    """The replica that relayed it (stamped by the replica)."""

    def __getstate__(self) -> tuple:
        """The wire form (``deltas_to_wire``): a plain tuple, its choices plain tuples too."""
        return (
            self.request_id,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            [choice.__getstate__() for choice in self.choices],
            self.finished,
            self.error,
            self.metrics,
            self.prompt_logprobs,
            self.seq,
            self.replica_id,
        )

    def __setstate__(self, state: tuple) -> None:
        (
            self.request_id,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            choices,
            self.finished,
            self.error,
            self.metrics,
            self.prompt_logprobs,
            self.seq,
            self.replica_id,
        ) = state
        self.choices = [_choice_from_wire(choice) for choice in choices]

    def extend(self, later: OutputDelta) -> OutputDelta:
        """Adds ``later`` (the same request, a later step) to this delta; returns it."""
        by_index = {c.index: c for c in self.choices}
        for choice in later.choices:
            mine = by_index.get(choice.index)
            if mine is None:
                self.choices.append(choice)
            else:
                mine.extend(choice)
        if len(self.choices) > 1:
            self.choices.sort(key=lambda c: c.index)
        self.num_cached_tokens = later.num_cached_tokens
        self.finished, self.error = later.finished, later.error
        if later.metrics is not None:
            self.metrics = later.metrics
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        return self

    @property
    def new_token_ids(self) -> list[int]:
        """Choice 0's new token ids (empty when this delta has none)."""
        for choice in self.choices:
            if choice.index == 0:
                return choice.new_token_ids
        return []


_new = object.__new__


def _choice_from_wire(state: tuple) -> ChoiceDelta:
    choice = _new(ChoiceDelta)
    choice.__setstate__(state)
    return choice


def deltas_to_wire(deltas: list[OutputDelta]) -> list[tuple]:
    """``deltas`` as plain tuples, for ``pickle`` (``deltas_from_wire`` reads them back).

    Deltas cross two process boundaries per token (engine process to replica, replica to
    ingress), a step's worth at a time. Pickle writes and reads nested tuples of ints and
    strings in C; a pickled object costs it a reduce call, a class reference and a state call
    on each side, about three times as much per delta. So every hop that carries a step's
    deltas carries this form (``StepResult``, ``cluster/push_socket.py``)."""
    return [delta.__getstate__() for delta in deltas]


def deltas_from_wire(rows: list[tuple]) -> list[OutputDelta]:
    """The ``OutputDelta``s ``deltas_to_wire`` made ``rows`` of."""
    deltas = []
    for row in rows:
        delta = _new(OutputDelta)
        delta.__setstate__(row)
        deltas.append(delta)
    return deltas


def accumulate(
    deltas, prompt_token_ids: list[int], resume_token_ids: list[int] | tuple = ()
) -> RequestOutput:
    """The cumulative ``RequestOutput`` a request's deltas add up to (``resume_token_ids``
    lead choice 0, as when a stream resumed), for callers that want the whole answer of a
    streamed request."""
    completions: dict[int, CompletionOutput] = {}
    last = None
    prompt_logprobs = None
    for delta in deltas:
        last = delta
        if delta.prompt_logprobs is not None:
            prompt_logprobs = delta.prompt_logprobs
        for choice in delta.choices:
            c = completions.get(choice.index)
            if c is None:
                lead = list(resume_token_ids) if choice.index == 0 else []
                c = completions[choice.index] = CompletionOutput(choice.index, "", lead)
            c.text += choice.new_text
            c.token_ids += choice.new_token_ids
            c.new_text, c.new_token_ids = choice.new_text, choice.new_token_ids
            if choice.new_logprobs is not None:
                c.logprobs = (c.logprobs or []) + choice.new_logprobs
            if choice.finish_reason is not None:
                c.finish_reason, c.stop_reason = choice.finish_reason, choice.stop_reason
                if choice.text is not None:
                    c.text = choice.text
    if last is None:
        raise ValueError("no deltas to accumulate")
    return RequestOutput(
        last.request_id,
        list(prompt_token_ids),
        [completions[i] for i in sorted(completions)],
        last.num_cached_tokens,
        last.finished,
        last.error,
        last.metrics or {},
        prompt_logprobs,
    )
