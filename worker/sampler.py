"""``Sampler``: picks each sequence's next token from its logits row.

Every row is processed on its own (penalties, logit_bias, temperature, top-k, top-p, min-p), so a
row's result never depends on the rest of the batch. Random choices come from a counter-based
stream: a fresh generator keyed by ``(request seed, output index, output position)``, and the
Gumbel-style race ``argmax(p / E)`` with ``E ~ Exp(1)``. A seeded request therefore gets the
same tokens alone, in any batch, after any preemption, on any replica.

A request with a structured output (``req.grammar``) has every token its grammar forbids set
to -inf after penalties, logit_bias and the min_tokens ban, before temperature and the
filters; the mask depends on that request's own tokens only, so the contract above holds.
Unconstrained rows never touch the grammar code.

Logprobs are those of the model's distribution before sampling transforms (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from worker.outputs import TokenLogprob
from worker.request import Request

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None


def sampling_key(seed: int, index: int, position: int) -> int:
    """A 63-bit generator seed that depends only on the request's seed and the position."""
    data = b"%d/%d/%d" % (seed, index, position)
    return xxhash.xxh64_intdigest(data) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = eos_token_ids

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        """One result per row of ``logits`` (on any device). Rows that are a plain argmax
        share one call on the logits' device (argmax is exact and takes the first maximum
        anywhere), whose ids are the step's one copy to the host; only the other rows (and
        rows that want logprobs) are copied whole."""
        plain = [i for i, req in enumerate(requests) if self.plain_greedy(req)]
        if (
            plain
            and len(plain) == len(requests)
            and all(r.params.logprobs is None for r in requests)
        ):
            # The common decode step: one argmax over every row, one copy of the ids.
            return [SampleResult(t, None) for t in torch.argmax(logits, dim=-1).tolist()]
        greedy = {}
        if plain:
            rows = logits if len(plain) == len(requests) else logits[plain]
            greedy = dict(zip(plain, torch.argmax(rows, dim=-1).tolist(), strict=True))
        host = {}
        whole = [
            i
            for i, req in enumerate(requests)
            if i not in greedy or req.params.logprobs is not None
        ]
        if whole and logits.device.type != "cpu":
            host = dict(zip(whole, logits[whole].cpu(), strict=True))
        elif whole:
            host = {i: logits[i] for i in whole}
        return [self._sample_row(host.get(i), req, greedy.get(i)) for i, req in enumerate(requests)]

    @staticmethod
    def plain_greedy(req: Request) -> bool:
        """The row's token is its plain argmax: greedy, no penalties, bias or grammar, and
        ``min_tokens`` out (``Request.greedy_from``)."""
        return req.grammar is None and len(req.output_token_ids) >= req.greedy_from

    def _sample_row(
        self, row: torch.Tensor | None, req: Request, greedy_token: int | None = None
    ) -> SampleResult:
        """``greedy_token``: the row's argmax, already taken with other plain greedy rows
        (``row`` is then None unless the request wants logprobs)."""
        p = req.params
        token = self._choose(row, req) if greedy_token is None else greedy_token
        return SampleResult(
            token, self._logprob(row, token, p.logprobs) if p.logprobs is not None else None
        )

    def _choose(self, row: torch.Tensor, req: Request) -> int:
        """The next token of one row: penalties, the min_tokens ban, then argmax or a draw."""
        p = req.params
        raw = row
        if p.needs_penalties:
            row = self._apply_penalties(row.clone(), req)
        if p.logit_bias:
            row = self._apply_logit_bias(row.clone() if row is raw else row, p.logit_bias)
        if len(req.output_token_ids) < p.min_tokens:
            row = row.clone() if row is raw else row
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            if banned:
                row[torch.tensor(banned)] = _NEG_INF
        if req.grammar is not None:
            masked = req.grammar.mask_logits(row)
            if len(req.output_token_ids) < p.min_tokens and not torch.isfinite(masked).any():
                masked = req.grammar.mask_logits(
                    raw
                )  # min_tokens banned all it allows: the grammar wins
            row = masked
        return int(torch.argmax(row)) if p.greedy else self._random_choice(row, req)

    @staticmethod
    def _apply_penalties(row: torch.Tensor, req: Request) -> torch.Tensor:
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if req.output_counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(req.output_counts.keys()), dtype=torch.long)
            counts = torch.tensor(list(req.output_counts.values()), dtype=row.dtype)
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty
        return row

    @staticmethod
    def _apply_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
        """OpenAI's logit_bias: each listed token's logit plus its bias (ids past the row are
        refused at admission, so none is out of range here)."""
        ids = torch.tensor(list(bias.keys()), dtype=torch.long)
        row[ids] += torch.tensor(list(bias.values()), dtype=row.dtype)
        return row

    @staticmethod
    def _random_choice(row: torch.Tensor, req: Request) -> int:
        p = req.params
        logits = row / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, _NEG_INF)
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop_sorted = (cum - sorted_probs) > p.top_p  # keep the smallest prefix reaching top_p
            probs = probs.masked_fill(
                torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0
            )
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        gen = torch.Generator().manual_seed(
            sampling_key(req.seed, req.index, len(req.output_token_ids))
        )
        race = torch.empty_like(probs).exponential_(generator=gen)
        return int(torch.argmax(probs / race))

    @staticmethod
    def _logprob(raw: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
        lp = torch.log_softmax(raw.float(), dim=-1)
        top = []
        if num_top:
            vals, ids = torch.topk(lp, num_top)
            top = list(zip(ids.tolist(), vals.tolist(), strict=True))
        return TokenLogprob(token, float(lp[token]), top)


class SampledIds:
    """A step's plain-greedy tokens taken on the logits' device at the launch, with their copy
    to the host under way: ``ids`` can feed the next step's inputs there before the host has
    them (``EngineConfig.async_scheduling``); ``tokens`` waits for the copy.

    ``host``: a page-locked buffer of at least as many rows (CUDA), which must not be handed
    to another ``SampledIds`` before this one's ``tokens`` was read (the engine alternates
    two)."""

    def __init__(self, logits: torch.Tensor, host: torch.Tensor | None) -> None:
        self.ids = torch.argmax(logits, dim=-1)
        self._ready = None
        if self.ids.device.type == "cpu" or host is None:
            self._host = self.ids
            return
        self._host = host[: len(self.ids)]
        self._host.copy_(self.ids, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def tokens(self) -> list[int]:
        """The ids on the host, once the device has computed and copied them."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
