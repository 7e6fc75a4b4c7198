"""What one engine step hands back for one request, built from its sequences' state.

``LLMEngine`` advances a request's group of sequences (one per choice) and records what each
sampled sequence got in a ``StepDelta``. From the group and those, ``output_delta`` makes the
``OutputDelta`` a server streams (only what is new; the timestamps with a first token or the
finish) and ``cumulative_output`` the ``RequestOutput`` offline callers read (everything so
far). Nothing here changes the requests. ``LaunchedStep`` is a step between the launch of
its forward pass and its sampling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from worker.outputs import ChoiceDelta, CompletionOutput, OutputDelta, RequestOutput
from worker.request import Request
from worker.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepDelta:
    """What one step added to one sequence: its new token ids and the text they completed."""

    token_ids: list[int] = field(default_factory=list)
    text: str | None = ""
    """None until the engine decodes it (``LLMEngine.deltas_of``)."""
    is_first: bool = False
    """The sequence's first token in this engine."""


AdvancedRequest = tuple[str, list[Request], dict[Request, StepDelta], bool]
"""What a step did to one request: its id, its group of sequences, what the step added to
each sampled sequence, whether the group is done."""


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward pass is launched (``LLMEngine.launch_step``): what sampling it
    needs (``LLMEngine.sample_step``)."""

    batch: ScheduledBatch
    logits: Any
    """The runner's logits, on its device; valid until the next step is launched."""
    sampling_idx: list[int]
    prompt_spans: list
    started_s: float
    """``time.perf_counter()`` at the launch."""
    seqs_ended: int
    """The engine's count of sequences ended outside the sampling of this step (aborts, and
    stop checks of the step before when this one ran ahead of them), at the launch."""
    sampled: Any = None
    """``SampledIds`` when the step's tokens were taken on the device at the launch (every
    sampling row a plain argmax): the next step may be launched before they reach the host."""
    runs_ahead: bool = False
    """The next step may be scheduled and launched before this one's tokens reach the host
    (``EngineConfig.async_scheduling``, every sampling row a plain argmax)."""
    committed: bool = False
    """Its computed tokens were counted (and filled blocks cached) when the next step was
    scheduled ahead of its sampling."""


def cumulative_output(
    request_id: str,
    group: list[Request],
    deltas: dict[Request, StepDelta],
    finished: bool,
) -> RequestOutput:
    """The group's ``RequestOutput``; ``deltas`` holds this step's new tokens per sequence
    (a sequence without one, e.g. a sibling still waiting, gets an empty delta)."""
    first = group[0]
    outs = []
    for req in group:
        delta = deltas.get(req, StepDelta())
        outs.append(
            CompletionOutput(
                index=req.index,
                text=req.detokenizer.text,
                token_ids=list(req.output_token_ids),
                new_text=delta.text,
                new_token_ids=delta.token_ids,
                logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
            )
        )
    metrics = group_timestamps(group, finished)
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=first.prompt_token_ids,
        outputs=outs,
        num_cached_tokens=first.num_cached_tokens or 0,
        finished=finished,
        error=None,
        metrics=metrics,
        prompt_logprobs=first.prompt_logprobs if not first.needs_prompt_logits else None,
    )


def output_deltas(advanced: list[AdvancedRequest]) -> list[OutputDelta]:
    """The ``OutputDelta`` of each request in ``advanced`` that got a token or ended, the
    text of its new tokens decoded first. Once per sampled sequence per step: a request of
    one sequence and one new token without logprobs (nearly every one) is built here with
    no call but the detokenizer's."""
    deltas = []
    for request_id, group, new, finished in advanced:
        if len(new) != 1 or len(group) != 1:
            if new or finished:
                decode_text(new)
                deltas.append(output_delta(request_id, group, new, finished))
            continue
        req = group[0]
        step = new[req]
        if req.params.logprobs is not None or (step.is_first and req.prompt_logprobs is not None):
            decode_text(new)
            deltas.append(output_delta(request_id, group, new, finished))
            continue
        text = step.text
        if text is None:
            detokenizer = req.detokenizer
            for token in step.token_ids:
                detokenizer.add_token(token)
            text = step.text = detokenizer.take_delta(req.finish_reason is not None)
        ended = req.finish_reason is not None
        choice = ChoiceDelta(
            req.index,
            step.token_ids,
            text,
            None,
            req.finish_reason,
            req.stop_reason,
            req.detokenizer.text if ended else None,
        )
        timestamps = group_timestamps(group, finished) if step.is_first or finished else None
        deltas.append(
            OutputDelta(
                request_id,
                len(req.prompt_token_ids),
                req.num_cached_tokens or 0,
                [choice],
                finished,
                metrics=timestamps,
            )
        )
    return deltas


def decode_text(added: dict[Request, StepDelta]) -> None:
    """Decodes the text of each new token in ``added`` that sampling left undecoded."""
    for req, step in added.items():
        if step.text is None:
            detokenizer = req.detokenizer
            for token in step.token_ids:
                detokenizer.add_token(token)
            step.text = detokenizer.take_delta(req.finish_reason is not None)


def output_delta(
    request_id: str,
    group: list[Request],
    added: dict[Request, StepDelta],
    finished: bool,
) -> OutputDelta:
    """The group's ``OutputDelta``: one ``ChoiceDelta`` per sequence in ``added`` (what
    the step gave it, its finish if it ended); the timestamps with a first token or the
    finish, the prompt logprobs with choice 0's first token."""
    first = group[0]
    if len(group) == 1 and len(added) == 1:  # most requests: one sequence, no loops
        step = added[first]
        choices = [choice_delta(first, step)]
        any_first = choice0_first_token = step.is_first
    else:
        choices = sorted(
            (choice_delta(req, step) for req, step in added.items()), key=lambda c: c.index
        )
        any_first = any(step.is_first for step in added.values())
        choice0_first_token = first in added and added[first].is_first
    return OutputDelta(
        request_id,
        len(first.prompt_token_ids),
        first.num_cached_tokens or 0,
        choices,
        finished,
        metrics=group_timestamps(group, finished) if any_first or finished else None,
        prompt_logprobs=first.prompt_logprobs if choice0_first_token else None,
    )


def choice_delta(req: Request, step: StepDelta) -> ChoiceDelta:
    """What ``step`` gave one sequence, with its logprobs, and its finish if it ended."""
    ended = req.finish_reason is not None
    logprobs = None
    if req.params.logprobs is not None:
        logprobs = req.logprobs[-len(step.token_ids) :] if step.token_ids else []
    return ChoiceDelta(
        req.index,
        step.token_ids,
        step.text,
        logprobs,
        req.finish_reason,
        req.stop_reason,
        req.detokenizer.text if ended else None,
    )


def group_timestamps(group: list[Request], finished: bool) -> dict:
    """``RequestOutput.metrics`` of the group: arrival, first scheduling and first token
    (the earliest of its sequences), and the finish once ``finished``."""
    first = group[0]
    if len(group) == 1:  # most requests: no earliest-of-the-group to find
        first_token_time = first.first_token_time
        first_scheduled_time = first.first_scheduled_time
    else:
        first_token_time = min(
            (r.first_token_time for r in group if r.first_token_time), default=None
        )
        first_scheduled_time = min(
            (r.first_scheduled_time for r in group if r.first_scheduled_time), default=None
        )
    metrics = {
        "arrival_time": first.arrival_time,
        "first_token_time": first_token_time or None,
        "first_scheduled_time": first_scheduled_time or None,
    }
    if finished:
        metrics["finished_time"] = time.monotonic()
    return metrics
