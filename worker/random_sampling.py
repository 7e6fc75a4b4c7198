"""The random draw of sampled rows, many rows at once, on the logits' device.

Owns how a row that is not greedy picks its token once penalties, ``logit_bias``, the
``min_tokens`` ban and a grammar's mask (``worker/sampler.py``) are applied: temperature,
then top-k, top-p and min-p, then one uniform draw ``u`` in (0, 1) per row, a function of
the row's key alone (``sampler.sampling_key``: request seed, output index, output position),
and the token where ``u`` falls in the cumulative distribution of what the filters kept.

- A row without filters (top-k off, top-p 1, min-p 0) takes its distribution over the whole
  vocabulary, in vocabulary order: a softmax, a cumulative sum and a binary search.
- A row with filters takes its ``CANDIDATES`` likeliest tokens, in a canonical order
  (probability descending, then token id ascending), keeps those the filters keep and draws
  among them in that order. When the filters could keep a token beyond those candidates
  (top-p 0.99 over a flat distribution, a top-k above it), the row is drawn again over its
  whole vocabulary in the same canonical order, which gives the same answer any row whose
  filters end within the candidates would get.

The key, and so ``u``, is computed on the host from integers; everything on the device is
row-wise (element-wise arithmetic, and per-row softmax, top-k, stable sort, cumulative sum
and binary search along the vocabulary), so a row's token does not depend on which rows
share its step, on their order or on their number: ``Sampler`` sends a row through here
alone (after penalties or a grammar on the host) or with every other plain drawn row of its
step, and both give the same token. No per-row generator and no per-row copy of logits to
the host: one pass serves the step, and only the token ids reach the host.

How it fails: it does not. Ties of probability at the candidates' edge may rank tokens
differently than the whole vocabulary would, which only moves a row's boundary token of
the filters where such a tie straddles it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

_NEG_INF = float("-inf")
CANDIDATES = 256
"""Likeliest tokens a filtered row draws among, unless its filters reach past them."""
CPU_ROWS = 16
"""Rows a CPU draws at once: 16 rows of a 49k vocabulary's float32 temporaries fit a core's
share of cache; a whole batch's do not, and the draw then runs at memory's speed."""
_UNIFORM_BITS = 53


def uniform(key: int) -> float:
    """The row's draw in (0, 1): a function of its 63-bit ``key`` only."""
    digest = xxhash.xxh64_intdigest(key.to_bytes(8, "little"))
    return ((digest >> (64 - _UNIFORM_BITS)) + 0.5) / (1 << _UNIFORM_BITS)


def random_tokens(
    logits: torch.Tensor,
    keys: Sequence[int],
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """One drawn token id per row of ``logits`` (``[rows, vocab]``, any device and float
    dtype), int64 on that device; each per-row argument has one entry per row (``top_k`` 0
    or at least the vocabulary: off; ``top_p`` 1: off; ``min_p`` 0: off). On the CPU the
    rows go ``CPU_ROWS`` at a time, whose temporaries stay in cache."""
    rows, vocab_size = logits.shape
    if logits.device.type == "cpu" and rows > CPU_ROWS:
        return torch.cat(
            [
                random_tokens(
                    logits[start : start + CPU_ROWS],
                    *(
                        column[start : start + CPU_ROWS]
                        for column in (keys, temperature, top_k, top_p, min_p)
                    ),
                )
                for start in range(0, rows, CPU_ROWS)
            ]
        )
    ks = [k if 0 < k < vocab_size else 0 for k in top_k]
    filtered = [i for i in range(rows) if ks[i] or top_p[i] < 1.0 or min_p[i] > 0.0]
    if not filtered:
        return unfiltered_tokens(logits, keys, temperature)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if len(filtered) < rows:
        plain = [i for i in range(rows) if not (ks[i] or top_p[i] < 1.0 or min_p[i] > 0.0)]
        tokens[plain] = unfiltered_tokens(logits[plain], *_pick(plain, keys, temperature))
    width = min(CANDIDATES, vocab_size)
    chosen, resolved = _draw_filtered(
        logits[filtered], width, *_pick(filtered, keys, temperature, ks, top_p, min_p)
    )
    tokens[filtered] = chosen
    if width < vocab_size and not bool(resolved.all()):  # waits for the device
        again = [i for i, ok in zip(filtered, resolved.tolist(), strict=True) if not ok]
        chosen, _ = _draw_filtered(
            logits[again], vocab_size, *_pick(again, keys, temperature, ks, top_p, min_p)
        )
        tokens[again] = chosen
    return tokens


def unfiltered_tokens(
    logits: torch.Tensor, keys: Sequence[int], temperature: Sequence[float]
) -> torch.Tensor:
    """Every row of ``logits`` drawn by its temperature alone, as ``random_tokens`` draws a
    row without filters, with no wait for the device: its per-row values reach the device by
    asynchronous copies, and nothing is read back. What a step scheduled ahead of its tokens
    takes (``sampler.SampledIds``)."""
    device = logits.device
    scaled = logits.float() / device_column(temperature, torch.float32, device)
    cdf = torch.cumsum(torch.softmax(scaled, dim=-1), dim=-1)
    return _search(cdf, device_column([uniform(k) for k in keys], torch.float64, device))


def _pick(rows: list[int], *columns: Sequence) -> list[list]:
    return [[column[i] for i in rows] for column in columns]


def device_column(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``[n, 1]`` tensor on ``device``; to a GPU from page-locked memory,
    asynchronously (the copy waits for nothing the device is running)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    return host[:, None]


def _search(cdf: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row, the first position whose cumulative mass exceeds ``draw * total``
    (``draws``: a ``[rows, 1]`` float64 column)."""
    target = (draws * cdf[:, -1:].double()).float()
    hit = torch.searchsorted(cdf, target, right=True)[:, 0]
    return hit.clamp_(max=cdf.shape[-1] - 1)


def _draw_filtered(
    logits: torch.Tensor,
    width: int,
    keys: list[int],
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token per row, whether the row's filters ended within its ``width`` candidates)."""
    device = logits.device

    def column(values, dtype) -> torch.Tensor:
        return device_column(values, dtype, device)

    scaled = logits.float() / column(temperature, torch.float32)
    draws = column([uniform(k) for k in keys], torch.float64)
    if width == scaled.shape[-1]:  # the row is in id order: a stable sort is canonical
        values, ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    else:
        values, ids = torch.topk(scaled, width, dim=-1)
        by_id = torch.argsort(ids, dim=-1, stable=True)  # canonical: ties by token id
        values, ids = values.gather(1, by_id), ids.gather(1, by_id)
        by_value = torch.sort(values, dim=-1, descending=True, stable=True).indices
        values, ids = values.gather(1, by_value), ids.gather(1, by_value)
    resolved = torch.zeros(len(top_k), dtype=torch.bool, device=device)
    beyond = None  # rows whose top-k reaches past the candidates: the vocabulary decides
    if any(top_k):
        within = column([0 < k <= width for k in top_k], torch.bool)
        kth = values.gather(1, column([min(max(k, 1), width) - 1 for k in top_k], torch.int64))
        kth = torch.where(within, kth, torch.full_like(kth, _NEG_INF))
        scaled = scaled.masked_fill(scaled < kth, _NEG_INF)  # ties with the k-th stay
        resolved |= (within & (kth > values[:, -1:]))[:, 0]
        beyond = column([k > width for k in top_k], torch.bool)[:, 0]
    probs = torch.softmax(scaled, dim=-1).gather(1, ids)
    if any(p < 1.0 for p in top_p):
        cum = torch.cumsum(probs, dim=-1)
        limited = column([p < 1.0 for p in top_p], torch.bool)
        limit = column(top_p, torch.float32)
        probs = probs.masked_fill(((cum - probs) > limit) & limited, 0.0)
        resolved |= (limited & (cum[:, -1:] > limit))[:, 0]
    if any(m > 0.0 for m in min_p):
        floor = column(min_p, torch.float32) * probs[:, :1]
        probs = probs.masked_fill(probs < floor, 0.0)
        resolved |= (probs[:, -1:] < floor)[:, 0]
    if beyond is not None:
        resolved &= ~beyond
    if width == scaled.shape[-1]:
        resolved[:] = True
    chosen = _search(torch.cumsum(probs, dim=-1), draws)
    return ids.gather(1, chosen[:, None])[:, 0], resolved
