"""``Sampler``: picks each sequence's next token from its logits row.

Every row is processed on its own (penalties, logit_bias, temperature, top-k, top-p, min-p), so a
row's result never depends on the rest of the batch. Random choices come from a counter-based
draw keyed by ``(request seed, output index, output position)`` (``sampling_key``): one
uniform per row, a hash of that key, and the token where it falls in the cumulative
distribution the row's filters keep (``worker/random_sampling.py``). A seeded request
therefore gets the same tokens alone, in any batch, after any preemption, on any replica.

Rows that need nothing but their logits (greedy, or drawn with temperature, top-k, top-p and
min-p: no penalties, bias, grammar, ``min_tokens`` out) are decided together on the logits'
device, and only their token ids are copied to the host; the others are copied row by row
and transformed on the host first, then drawn by the same ``random_tokens``.

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
from worker.random_sampling import device_column, random_tokens, unfiltered_tokens
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
        anywhere), and plain drawn rows one ``random_tokens``; their ids are what reaches the
        host. Only the other rows (and rows that want logprobs) are copied whole."""
        plain = [i for i, req in enumerate(requests) if self.plain_greedy(req)]
        if (
            plain
            and len(plain) == len(requests)
            and all(r.params.logprobs is None for r in requests)
        ):
            # The common decode step: one argmax over every row, one copy of the ids.
            return [SampleResult(t, None) for t in torch.argmax(logits, dim=-1).tolist()]
        decided = {}  # row -> token, decided on the logits' device
        if plain:
            rows = logits if len(plain) == len(requests) else logits[plain]
            decided = dict(zip(plain, torch.argmax(rows, dim=-1).tolist(), strict=True))
        drawn = [i for i, req in enumerate(requests) if self.plain_drawn(req)]
        if drawn:
            tokens = self.draw(logits[drawn], [requests[i] for i in drawn]).tolist()
            decided.update(zip(drawn, tokens, strict=True))
        host = {}
        whole = [
            i
            for i, req in enumerate(requests)
            if i not in decided or req.params.logprobs is not None
        ]
        if whole and logits.device.type != "cpu":
            host = dict(zip(whole, logits[whole].cpu(), strict=True))
        elif whole:
            host = {i: logits[i] for i in whole}
        return [
            self._sample_row(host.get(i), req, decided.get(i)) for i, req in enumerate(requests)
        ]

    @staticmethod
    def plain_greedy(req: Request) -> bool:
        """The row's token is its plain argmax: greedy, no penalties, bias or grammar, and
        ``min_tokens`` out (``Request.greedy_from``)."""
        return req.grammar is None and len(req.output_token_ids) >= req.greedy_from

    @staticmethod
    def plain_drawn(req: Request) -> bool:
        """The row's token is drawn from its logits by temperature and filters alone: no
        penalties, bias or grammar, ``min_tokens`` out (``Request.drawn_from``)."""
        return req.grammar is None and len(req.output_token_ids) >= req.drawn_from

    @staticmethod
    def draw(rows: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The drawn token of each row of ``rows`` (one per request, same order), on their
        device, each keyed by ``draw_key``."""
        params = [req.params for req in requests]
        return random_tokens(
            rows,
            [Sampler.draw_key(req) for req in requests],
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
        )

    @staticmethod
    def draw_key(req: Request) -> int:
        """The key of ``req``'s next draw (``sampling_key``): its outputs so far and the one
        in flight, when a step scheduled ahead draws it (``SampledIds``)."""
        return sampling_key(req.seed, req.index, len(req.output_token_ids) + req.num_in_flight)

    def _sample_row(
        self, row: torch.Tensor | None, req: Request, decided: int | None = None
    ) -> SampleResult:
        """``decided``: the row's token, already taken on the device with the other plain
        rows (``row`` is then None unless the request wants logprobs)."""
        p = req.params
        token = self._choose(row, req) if decided is None else decided
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
        return int(torch.argmax(row)) if p.greedy else int(self.draw(row[None], [req])[0])

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
    def _logprob(raw: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
        lp = torch.log_softmax(raw.float(), dim=-1)
        top = []
        if num_top:
            vals, ids = torch.topk(lp, num_top)
            top = list(zip(ids.tolist(), vals.tolist(), strict=True))
        return TokenLogprob(token, float(lp[token]), top)


class SampledIds:
    """A step's tokens taken on the logits' device at the launch, every row a plain argmax or
    a plain draw (``Sampler.plain_greedy``, ``plain_drawn``; the engine sends unfiltered
    draws only, whose answer needs no wait for the device), with their copy to the host
    under way: ``ids`` can feed the next step's inputs there before the host has them
    (``EngineConfig.async_scheduling``); ``tokens`` waits for the copy.

    ``requests``: each row's request, for the rows that are drawn (none: all argmax).
    ``host``: a page-locked buffer of at least as many rows (CUDA), which must not be handed
    to another ``SampledIds`` before this one's ``tokens`` was read (the engine alternates
    two)."""

    def __init__(
        self,
        logits: torch.Tensor,
        host: torch.Tensor | None,
        requests: list[Request] | None = None,
    ) -> None:
        self.ids = torch.argmax(logits, dim=-1)
        rows = requests or []
        drawn = [not req.params.greedy for req in rows]
        if any(req.params.filters_tokens for req in rows if not req.params.greedy):
            # A filtered draw may need the whole vocabulary: this waits for the device.
            idx = [i for i, d in enumerate(drawn) if d]
            self.ids[idx] = Sampler.draw(logits[idx], [rows[i] for i in idx])
        elif any(drawn):  # every draw unfiltered, nothing read back: the launch goes on
            temperature = [req.params.temperature or 1.0 for req in rows]
            keys = [Sampler.draw_key(req) for req in rows]
            mask = device_column(drawn, torch.bool, logits.device)[:, 0]
            self.ids = torch.where(mask, unfiltered_tokens(logits, keys, temperature), self.ids)
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
