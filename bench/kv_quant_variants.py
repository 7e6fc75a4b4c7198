"""Candidate 8-bit KV row formats, simulated to measure their quality before building them.

``bench.kv_quality --variants NAME,...`` runs the float32 engine with its KV store replaced
by one that quantizes each new K and V row under a variant's numerics and stores the value
read back (quantize, then dequantize, in float32). Attention then sees exactly the values a
real kernel of that format would dequantize, so greedy agreement and teacher-forced
log-probabilities measure the format's quality; speed and bytes are not measured (the
capacity column is computed from the row's bytes, ``row_bytes``).

Every variant keeps the determinism contract's condition: a row's stored values depend on
that row alone (its own token, layer and KV head), never on the batch or the chunking.

- ``int8-sim``: today's ``int8`` (``kernels/kv_quant.py``: one float16 scale per row) through
  this simulation: the control, which must match the real ``int8`` run;
- ``int8-g32`` / ``int8-g16``: a float16 scale per group of 32 / 16 channels of the row, so
  one outlier channel coarsens only its group;
- ``int8-asym``: unsigned 8-bit values with a float16 scale and a float16 offset (the row's
  minimum), so a row whose values are not centred on zero uses all 256 levels;
- ``k16-v8``: K kept in float16, V in today's int8 rows (K's outlier channels are the usual
  suspect for int8 KV's errors: this says how much of the loss is K's);
- ``int8-ksmooth``: today's int8 rows, but each K channel divided by a per-layer, per-head,
  per-channel constant before quantizing (its largest magnitude over a fixed calibration
  text, ``CALIBRATION_TEXT``), and the query multiplied by the same constant, so that
  ``q . k`` is unchanged while no channel dominates a row's scale. The constants belong to
  the model, like its weights: a row still depends on that row alone. A real kernel needs no
  new read path (it scales the query once); the rows keep today's 66 bytes.

How it fails: ``variant`` raises ``ValueError`` for a name it does not know.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.kv_quant import MIN_SCALE, SCALE_BYTES, dequantize_rows, kv_format, quantize_rows

INT8 = kv_format("int8")


def per_row_int8(x: torch.Tensor) -> torch.Tensor:
    """Today's int8 row, quantized and read back in float32."""
    return dequantize_rows(quantize_rows(x, INT8), INT8, torch.float32)


def grouped_int8(group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Symmetric int8 with one float16 scale per ``group`` channels of a row."""

    def fake(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        g = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group, group)
        scale = (g.abs().amax(-1, keepdim=True) / 127.0).clamp_min(MIN_SCALE).half().float()
        q = torch.round(g / scale).clamp_(-127, 127)
        return (q * scale).reshape(xf.shape)

    return fake


def asymmetric_int8(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 8-bit values over the row's [min, max]: float16 scale and offset per row."""
    xf = x.float()
    low = xf.amin(-1, keepdim=True).half().float()
    scale = ((xf.amax(-1, keepdim=True) - low) / 255.0).clamp_min(MIN_SCALE).half().float()
    q = torch.round((xf - low) / scale).clamp_(0, 255)
    return q * scale + low


def float16_row(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


CALIBRATION_TEXT = """\
The committee met on a wet Tuesday to decide where the new library would stand. Some wanted
the old railway yard, close to the station and cheap to buy; others argued for the hill above
the river, where the light was better and the noise of the trains could not reach. The
architect brought drawings of both: long reading rooms with tall windows, a children's wing
with low shelves, a courtyard planted with birch trees. Questions followed about parking,
about the cost of heating a glass roof in winter, about whether anyone still borrowed books
at all. A retired teacher stood up and said that every week she counted forty students at
the tables of the present library, most of them doing homework because their homes had no
quiet room. The vote, when it came, was seven to two for the hill. Construction began the
following spring and took three years, two more than the plan had promised.
"""
"""Text whose K rows set ``int8-ksmooth``'s channel constants (distinct from the texts the
quality run scores)."""


@dataclass(frozen=True)
class Variant:
    name: str
    fake_k: Callable[[torch.Tensor], torch.Tensor]
    fake_v: Callable[[torch.Tensor], torch.Tensor]
    k_row_bytes: Callable[[int], int]
    """Bytes of one token's K row of one KV head, from ``head_dim``."""
    v_row_bytes: Callable[[int], int]
    description: str
    smooth_k: bool = False
    """Divide K's channels by calibrated constants before quantizing (``int8-ksmooth``)."""

    def blocks_ratio_to_float32(self, head_dim: int) -> float:
        """KV blocks in the same bytes against float32 rows (4 bytes a channel)."""
        return 2 * 4 * head_dim / (self.k_row_bytes(head_dim) + self.v_row_bytes(head_dim))


def _int8_bytes(d: int) -> int:
    """Today's int8 row: ``kernels/kv_quant.py``'s values and float16 scale."""
    return INT8.row_bytes(d, torch.float32)


def _grouped(group: int) -> Variant:
    """Symmetric int8 with a float16 scale per ``group`` channels, for K and V alike."""

    def row_bytes(d: int) -> int:
        return d + SCALE_BYTES * (d // group)

    fake = grouped_int8(group)
    return Variant(
        f"int8-g{group}", fake, fake, row_bytes, row_bytes, f"int8, a scale per {group} channels"
    )


VARIANTS = {
    v.name: v
    for v in (
        Variant(
            "int8-sim",
            per_row_int8,
            per_row_int8,
            _int8_bytes,
            _int8_bytes,
            "int8, one scale a row",
        ),
        _grouped(32),
        _grouped(16),
        Variant(
            "int8-asym",
            asymmetric_int8,
            asymmetric_int8,
            lambda d: d + 2 * SCALE_BYTES,
            lambda d: d + 2 * SCALE_BYTES,
            "uint8 over [min, max], scale and offset a row",
        ),
        Variant(
            "k16-v8", float16_row, per_row_int8, lambda d: 2 * d, _int8_bytes, "K float16, V int8"
        ),
        Variant(
            "int8-ksmooth",
            per_row_int8,
            per_row_int8,
            _int8_bytes,
            _int8_bytes,
            "int8, K channels scaled by calibrated constants",
            smooth_k=True,
        ),
    )
}


def variant(name: str) -> Variant:
    found = VARIANTS.get(name)
    if found is None:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    return found


def k_channel_constants(llm, text_ids: list[int]) -> dict[int, torch.Tensor]:
    """Per layer (keyed by its K cache's address), each KV head's per-channel largest |K|
    over ``text_ids`` prefilled once by ``llm`` (floored at 1e-3 of the head's largest, so a
    silent channel is not blown up); the prefix cache is emptied afterwards."""
    from worker.sampling_params import SamplingParams

    runner = llm.engine.runner
    ops = runner.model.ops
    amax: dict[int, torch.Tensor] = {}

    def recording_store(k, v, k_cache, v_cache, slots):
        seen = k.float().abs().amax(dim=0)  # [Hkv, D]
        key = k_cache.data_ptr()
        amax[key] = torch.maximum(amax[key], seen) if key in amax else seen
        ops.store_kv(k, v, k_cache, v_cache, slots)

    runner.model.ops = dataclasses.replace(ops, store_kv=recording_store)
    try:
        llm.generate([text_ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        runner.model.ops = ops
    llm.engine.pool.reset_prefix_cache()
    return {key: a.clamp_min(1e-3 * a.amax(dim=-1, keepdim=True)) for key, a in amax.items()}


def simulate(llm, var: Variant, calibration_ids: list[int] | None = None) -> None:
    """Make ``llm`` (an ``LLM`` with a full-precision KV cache) store every new K and V row as
    ``var`` would read it back; ``calibration_ids`` (tokens of ``CALIBRATION_TEXT``) set
    ``int8-ksmooth``'s constants."""
    runner = llm.engine.runner
    if runner.ops.kv_format.quantized:
        raise ValueError("simulate a variant on a full-precision KV cache (kv_cache_dtype=auto)")
    store = runner.ops.store_kv
    constants = k_channel_constants(llm, calibration_ids or []) if var.smooth_k else {}

    def store_kv(k, v, k_cache, v_cache, slots):
        scale = constants.get(k_cache.data_ptr())
        if scale is None:
            fk = var.fake_k(k)
        else:  # what q . k sees: q * c against dequantized (k / c), i.e. dequantized k
            fk = var.fake_k(k.float() / scale) * scale
        store(fk.to(k.dtype), var.fake_v(v).to(v.dtype), k_cache, v_cache, slots)

    runner.model.ops = dataclasses.replace(runner.ops, store_kv=store_kv)
