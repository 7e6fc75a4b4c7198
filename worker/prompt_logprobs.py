"""Prompt logprobs: which rows of a step's flat batch they need, and the entries they make.

A request with ``SamplingParams.prompt_logprobs`` needs, for every prompt token after the
first, the logits at the position before it. ``prompt_logit_rows`` names those rows of this
step (chunked prefill spreads them over several steps, in order); the runner returns their
logits after the sampling rows, and ``record_prompt_logprobs`` appends one ``TokenLogprob``
per row to the request. The scheduler gives such a request no prefix-cache hits until they
are all collected (a cached block carries no logits), as vLLM does; positions already
collected (recomputed after a preemption) are not collected twice. Each row is computed on
its own, so the entries do not depend on the batch, and the extra rows leave the sampling
rows' logits unchanged (the deterministic kernels never change a row's reduction with the
number of rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.outputs import TokenLogprob
from worker.request import Request
from worker.scheduler import ScheduledBatch


@dataclass(frozen=True)
class PromptSpan:
    """``num_rows`` consecutive logits rows of ``request``, from prompt position
    ``first_position``."""

    request: Request
    first_position: int
    num_rows: int


def prompt_logit_rows(batch: ScheduledBatch) -> tuple[list[int], list[PromptSpan]]:
    """Rows of the step's flat token list whose logits prompt logprobs need, and their spans."""
    rows: list[int] = []
    spans: list[PromptSpan] = []
    offset = 0
    for req, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
        start = req.num_computed_tokens
        if req.needs_prompt_logits:
            # Position p predicts token p + 1; the next token to collect is len(prompt_logprobs).
            first = max(start, len(req.prompt_logprobs) - 1)
            end = min(start + num_new, len(req.prompt_token_ids) - 1)
            if first == len(req.prompt_logprobs) - 1 and end > first:
                rows.extend(range(offset + first - start, offset + end - start))
                spans.append(PromptSpan(req, first, end - first))
        offset += num_new
    return rows, spans


def record_prompt_logprobs(logits: torch.Tensor, spans: list[PromptSpan]) -> None:
    """Appends each span's entries to its request; ``logits`` holds the spans' rows in order."""
    row = 0
    for span in spans:
        req = span.request
        block = torch.log_softmax(logits[row : row + span.num_rows].float(), dim=-1)
        row += span.num_rows
        start = span.first_position + 1
        targets = torch.tensor(
            req.prompt_token_ids[start : start + span.num_rows], dtype=torch.long
        )
        chosen = block.gather(1, targets[:, None]).squeeze(1)
        ranks = (block > chosen[:, None]).sum(dim=1) + 1
        num_top = req.params.prompt_logprobs
        tops: list[list[tuple[int, float]]] = [[] for _ in range(span.num_rows)]
        if num_top:
            values, ids = torch.topk(block, num_top, dim=-1)
            tops = [
                list(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        for token, logprob, rank, top in zip(
            targets.tolist(), chosen.tolist(), ranks.tolist(), tops, strict=True
        ):
            req.prompt_logprobs.append(TokenLogprob(token, logprob, top, rank))
