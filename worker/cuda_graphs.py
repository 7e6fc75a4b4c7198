"""``StepGraphs``: engine steps replayed from CUDA graphs, one graph per size bucket.

A GPU runs a small model's step in about a millisecond, while launching its few hundred
kernels from Python takes tens. So a step is not launched kernel by kernel: its inputs are
written into static device buffers, padded to a bucket, and a graph captured for that bucket
is replayed. Two families of graphs:

- **decode**: every sequence computes one token and samples it. Buckets by sequence count:
  1, 2, 4, 8, 16, every 16 up to 128, every 32 beyond, and ``max_num_seqs``
  (``decode_buckets``). Rows past the batch are padding sequences of length 1.
- **mixed** (prefill chunks, with or without decodes): buckets by token count, 16, 32, 64,
  ..., doubling up to 512, then every 512 up to ``max_num_batched_tokens``
  (``token_buckets``), each over ``max_num_seqs`` sequence slots; slots past the batch are
  sequences of zero tokens (the attention kernel skips them) and tokens past the batch belong
  to none. Logits are taken for ``min(max_num_seqs, bucket)`` rows.

A step that fits neither (more tokens than the largest bucket, or more logits rows than its
bucket has, as prompt logprobs may want) runs eagerly. Graphs are captured largest first,
sharing one memory pool, when the runner starts, after the KV cache is allocated; that costs
seconds and some device memory, both logged. Every graph writes its logits into one static
buffer, so the graphs' own outputs are not kept.

Padding. Padding tokens are token 0 at position 0 with KV slot -1 (``store_kv`` skips it,
so the cache is never written); their logits, if any, are dropped. In deterministic mode
every kernel is batch-invariant (docs/design.md, "Determinism"), so each real row's logits
are bitwise those the unpadded eager step gives. ``tests/worker/test_cuda_graphs.py`` checks
that on the CPU, where the same padded buffers run eagerly (``capture=False``; the torch
kernels for decodes, the Triton interpreter for mixed steps). In fast mode cuBLAS may pick
another kernel for the padded row count, as in vLLM and SGLang.

The block-table buffer is ``max_num_seqs x max_blocks_per_seq`` wide; a step copies only the
columns its longest table needs (attention reads a sequence's blocks up to its length, never
past them), from a host copy that keeps each row's table between steps and writes only its new
block ids (``worker/block_tables.py``), so a step's host work grows with the batch, not with
the context.

How it fails: a capture error propagates out of the runner's construction, at startup, with
``--enforce-eager`` named as the way to run without graphs. The logits a step returns are a
view of the static buffer, valid until the next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from worker.block_tables import BlockTableRows
from worker.input_staging import InputStaging
from worker.parallel.step_message import StepInputs

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]
"""forward(input_ids, positions, meta, logits_indices) -> float32 logits [rows, vocab]."""


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a decode graph: 1, 2, 4, 8, 16, every 16 to 128, every 32
    beyond, and ``max_num_seqs`` itself; none above ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [1, 2, 4, 8, 16, *range(32, 129, 16), *range(160, max_num_seqs + 1, 32)]
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token counts that get a mixed-step graph: 16, 32, ... doubling to 512, every 512
    beyond, and ``max_num_batched_tokens`` itself; none above it."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
    sizes = [16, 32, 64, 128, 256, 512, *range(1024, max_num_batched_tokens + 1, 512)]
    return sorted({s for s in sizes if s <= max_num_batched_tokens} | {max_num_batched_tokens})


def is_plain_decode(inputs: StepInputs) -> bool:
    """Every sequence computes one token and samples it, and nothing else wants logits."""
    n = len(inputs.counts)
    return (
        n > 0
        and len(inputs.token_ids) == n
        and inputs.counts.count(1) == n
        and inputs.sampling_rows == list(range(n))
    )


def _smallest_holding(buckets: list[int], size: int) -> int | None:
    for b in buckets:
        if b >= size:
            return b
    return None


@dataclass(frozen=True)
class Shape:
    """One graph's sizes: tokens, sequence slots, logits rows; ``decode`` for the family."""

    decode: bool
    tokens: int
    seqs: int
    rows: int


class StepGraphs:
    """Static step inputs padded to a bucket, replayed from CUDA graphs (or run eagerly).

    ``forward`` runs the model on the given tensors and the runner's KV cache. ``capture``:
    record every bucket's graph now (CUDA devices only); False runs the padded buffers
    eagerly, which is what the CPU tests exercise. ``mixed``: also pad and capture steps
    that are not plain decodes.
    """

    def __init__(
        self,
        forward: Forward,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        capture: bool,
        mixed: bool = True,
    ):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self._forward = forward
        self.block_size = block_size
        self.max_seqs = max_num_seqs
        self.decode_buckets = decode_buckets(max_num_seqs)
        self.token_buckets = token_buckets(max_num_batched_tokens) if mixed else []
        tokens = max([max_num_seqs, *self.token_buckets])
        dev = device
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_num_seqs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(
            max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=dev
        )
        self.table_rows = BlockTableRows(max_num_seqs, max_blocks_per_seq, pin=dev.type == "cuda")
        """The tables' host side, kept between steps: a step writes only new block ids."""
        self._staging = InputStaging(3 * tokens + 5 * max_num_seqs + 1, dev)
        """The other inputs' host side: ids, positions, slots, lengths (and a mixed step's
        query starts and logits rows, and the rows of tokens in flight), packed, copied once."""
        self.query_start_loc = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=dev)
        self.decode_query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.zeros(max_num_seqs, dtype=torch.long, device=dev)
        self.decode_logits_indices = torch.arange(max_num_seqs, dtype=torch.long, device=dev)
        self.logits = torch.zeros(max_num_seqs, vocab_size, dtype=torch.float32, device=dev)
        self._graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        if capture:
            self._capture_all()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def shape_for(self, inputs: StepInputs) -> Shape | None:
        """The bucket a step runs in; None when it fits none (it then runs eagerly)."""
        num_seqs, num_tokens = len(inputs.counts), len(inputs.token_ids)
        if num_seqs == 0:
            return None
        if is_plain_decode(inputs):
            bucket = _smallest_holding(self.decode_buckets, num_seqs)
            if bucket is not None:
                return Shape(True, bucket, bucket, bucket)
        bucket = _smallest_holding(self.token_buckets, num_tokens)
        if bucket is None or num_seqs > self.max_seqs:
            return None
        rows = min(self.max_seqs, bucket)
        if len(inputs.sampling_rows) > rows:
            return None
        return Shape(False, bucket, self.max_seqs, rows)

    # -- one step -------------------------------------------------------------------------------
    def run(self, inputs: StepInputs, shape: Shape) -> torch.Tensor:
        """Logits [len(sampling_rows), vocab] of a step that ``shape_for`` placed in
        ``shape``."""
        self._fill(inputs, shape)
        graph = self._graphs.get(shape)
        if graph is not None:
            graph.replay()
        else:
            self._run_into_logits(shape, self._host_lists(shape))
        return self.logits[: len(inputs.sampling_rows)]

    def _fill(self, inputs: StepInputs, shape: Shape) -> None:
        """Writes the step's rows and its bucket's padding into the static buffers: packed
        on the host with numpy (``InputStaging``), one copy to the device, then spread."""
        bs = self.block_size
        num_seqs, num_tokens = len(inputs.counts), len(inputs.token_ids)
        tokens, seqs = shape.tokens, shape.seqs
        array = self._staging.begin()  # the host buffers are free to write from here
        rows = self.table_rows
        width = max(rows.write(inputs.tables), 1)
        starts = np.asarray(inputs.starts, dtype=np.int64)
        ids = array[:tokens]
        positions = array[tokens : 2 * tokens]
        slots = array[2 * tokens : 3 * tokens]
        lens = array[3 * tokens : 3 * tokens + seqs]
        ids[:num_tokens] = inputs.token_ids
        ids[num_tokens:] = 0
        if shape.decode:  # one token per sequence, at its start
            counts = 1
            seq_of_token = np.arange(num_seqs)
            positions[:num_tokens] = starts
        else:
            counts = np.asarray(inputs.counts, dtype=np.int64)
            seq_of_token = np.repeat(np.arange(num_seqs), counts)
            ends = np.cumsum(counts)
            offset_in_seq = np.arange(num_tokens) - np.repeat(ends - counts, counts)
            positions[:num_tokens] = np.repeat(starts, counts) + offset_in_seq
        used = positions[:num_tokens]
        block_ids = rows.array[seq_of_token, used // bs].astype(np.int64)
        slots[:num_tokens] = block_ids * bs + used % bs
        positions[num_tokens:] = 0
        slots[num_tokens:] = -1
        lens[:num_seqs] = starts + counts
        lens[num_seqs:] = 1 if shape.decode else 0
        length = 3 * tokens + seqs
        if not shape.decode:
            qsl = array[length : length + seqs + 1]
            qsl[0] = 0
            qsl[1 : num_seqs + 1] = ends
            qsl[num_seqs + 1 :] = num_tokens
            length += seqs + 1
            sampled = len(inputs.sampling_rows)
            logit_rows = array[length : length + shape.rows]
            logit_rows[:sampled] = inputs.sampling_rows
            logit_rows[sampled:] = 0
            length += shape.rows
        fed = len(inputs.fed_rows)
        if fed:  # tokens in flight: rows of the step's ids and where in the last sample
            array[length : length + fed] = inputs.fed_rows
            array[length + fed : length + 2 * fed] = inputs.fed_src
        staged = self._staging.send(length + 2 * fed)
        self.input_ids[:tokens].copy_(staged[:tokens])
        if fed:
            fed_rows, fed_src = staged[length : length + fed], staged[length + fed :]
            self.input_ids[fed_rows] = inputs.fed_ids[fed_src]
        self.positions[:tokens].copy_(staged[tokens : 2 * tokens])
        self.slot_mapping[:tokens].copy_(staged[2 * tokens : 3 * tokens])
        self.seq_lens[:seqs].copy_(staged[3 * tokens : 3 * tokens + seqs])
        if not shape.decode:
            at = 3 * tokens + seqs
            self.query_start_loc.copy_(staged[at : at + seqs + 1])
            self.logits_indices[: shape.rows].copy_(staged[at + seqs + 1 : length])
        if shape.decode:
            rows.clear(range(num_seqs, seqs))
        table_rows = seqs if shape.decode else num_seqs
        self.block_tables[:table_rows, :width].copy_(
            rows.host[:table_rows, :width], non_blocking=True
        )
        self._staging.sent()

    def _host_lists(self, shape: Shape) -> tuple[list[int], list[int]]:
        """The (query start, sequence length) lists the torch kernels read on the host, from
        what ``_fill`` just packed (an eager run only: a replayed graph reads none)."""
        array, tokens, seqs = self._staging.array, shape.tokens, shape.seqs
        lens = array[3 * tokens : 3 * tokens + seqs].tolist()
        if shape.decode:
            return list(range(seqs + 1)), lens
        at = 3 * tokens + seqs
        return array[at : at + seqs + 1].tolist(), lens

    def _meta(self, shape: Shape, qsl: list[int], lens: list[int]) -> AttentionMetadata:
        query_start_loc = self.decode_query_start_loc if shape.decode else self.query_start_loc
        return AttentionMetadata(
            query_start_loc=query_start_loc[: shape.seqs + 1],
            seq_lens=self.seq_lens[: shape.seqs],
            block_tables=self.block_tables[: shape.seqs],
            slot_mapping=self.slot_mapping[: shape.tokens],
            query_start_loc_list=qsl,
            seq_lens_list=lens,
        )

    def _run_into_logits(self, shape: Shape, meta_lists: tuple[list[int], list[int]]) -> None:
        indices = self.decode_logits_indices if shape.decode else self.logits_indices
        out = self._forward(
            self.input_ids[: shape.tokens],
            self.positions[: shape.tokens],
            self._meta(shape, *meta_lists),
            indices[: shape.rows],
        )
        self.logits[: shape.rows].copy_(out)

    # -- capture --------------------------------------------------------------------------------
    def _shapes(self) -> list[Shape]:
        decode = [Shape(True, b, b, b) for b in self.decode_buckets]
        mixed = [Shape(False, t, self.max_seqs, min(self.max_seqs, t)) for t in self.token_buckets]
        return decode + mixed

    def _capture_all(self) -> None:
        """One graph per bucket, largest first so the smaller ones reuse its pool's memory.
        Each bucket runs once eagerly first (kernel compilation, library handles), on
        padding only, so neither run writes the KV cache."""
        dev = self.input_ids.device
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        pool = None
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.logits_indices.zero_()
        for shape in sorted(self._shapes(), key=lambda s: (s.tokens, s.rows), reverse=True):
            lens = [1 if shape.decode else 0] * shape.seqs
            qsl = list(range(shape.seqs + 1)) if shape.decode else [0] * (shape.seqs + 1)
            self.seq_lens[: shape.seqs].copy_(torch.tensor(lens, dtype=torch.int32))
            if not shape.decode:
                self.query_start_loc.zero_()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._run_into_logits(shape, (qsl, lens))
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self._run_into_logits(shape, (qsl, lens))
            except RuntimeError as exc:
                raise RuntimeError(
                    f"capturing the step graph {shape} failed ({exc}); "
                    "--enforce-eager runs without CUDA graphs"
                ) from exc
            if pool is None:
                pool = graph.pool()
            self._graphs[shape] = graph
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before
        log.info(
            "CUDA graphs: decode batches %s and mixed steps of %s tokens captured in %.1f s, "
            "%.0f MiB",
            ",".join(map(str, self.decode_buckets)),
            ",".join(map(str, self.token_buckets)) or "none",
            self.capture_seconds,
            self.pool_bytes / 2**20,
        )
