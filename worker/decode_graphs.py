"""``DecodeGraphs``: decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A GPU runs a small model's decode step in well under a millisecond, while launching its few
hundred kernels from Python takes tens. So a step in which every sequence decodes exactly one
token (no prefill chunk, no prompt logprobs) and that holds at most the largest bucket's
sequences is not launched kernel by kernel: its inputs are written into static device buffers
and the graph captured for the smallest bucket that holds the batch is replayed. Every other
step runs eagerly (``ModelRunner.run_inputs``).

Buckets: 1, 2, 4, 8, 16, then every 16 up to 128, then every 32, and ``max_num_seqs`` itself
(``decode_buckets``). Graphs are captured largest first, sharing one memory pool, when the
runner starts, after the KV cache is allocated; that costs seconds and some device memory,
both logged.

Padding. A batch of ``n`` sequences replays the graph of bucket ``b >= n``; rows ``n..b`` are
padding: token 0 at position 0, KV slot -1 (``store_kv`` skips it, so the cache is never
written), a sequence of length 1 whose block table is block 0. Their logits are computed and
dropped. In deterministic mode every kernel is batch-invariant (docs/design.md,
"Determinism"), so each real row's logits are bitwise those the unpadded eager step gives;
``tests/worker/test_decode_graphs.py`` checks that on the CPU, where the same padded buffers
run eagerly (``capture=False``). In fast mode cuBLAS may pick another kernel for the padded
row count, as in vLLM and SGLang.

The block-table buffer is ``max_num_seqs x max_blocks_per_seq`` wide; a step writes only the
columns its longest table needs (attention reads a sequence's blocks up to its length, never
past them), so a step's host work grows with the batch, not with the context limit.

How it fails: a capture error propagates out of the runner's construction, at startup, with
``--enforce-eager`` named as the way to run without graphs. The logits a replay returns are a
view of the graph's static output, valid until the next replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kernels.attention import AttentionMetadata
from worker.parallel.step_message import StepInputs

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]
"""forward(input_ids, positions, meta, logits_indices) -> float32 logits [rows, vocab]."""


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, every 16 to 128, every 32 beyond, and
    ``max_num_seqs`` itself; none above ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [1, 2, 4, 8, 16, *range(32, 129, 16), *range(160, max_num_seqs + 1, 32)]
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def is_plain_decode(inputs: StepInputs) -> bool:
    """Every sequence computes one token and samples it, and nothing else wants logits."""
    n = len(inputs.counts)
    return (
        n > 0
        and len(inputs.token_ids) == n
        and all(c == 1 for c in inputs.counts)
        and inputs.sampling_rows == list(range(n))
    )


class DecodeGraphs:
    """Static decode inputs padded to a bucket, replayed from CUDA graphs (or run eagerly).

    ``forward`` runs the model on the given tensors and the runner's KV cache. ``capture``:
    record one CUDA graph per bucket now (CUDA devices only); False runs the padded buffers
    eagerly, which is what the CPU tests exercise.
    """

    def __init__(
        self,
        forward: Forward,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        capture: bool,
    ):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self._forward = forward
        self.block_size = block_size
        self.buckets = decode_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        rows, dev = self.max_batch, device
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(rows, dtype=torch.long, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        if capture:
            self._capture_all()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences; None past the largest."""
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def fits(self, inputs: StepInputs) -> bool:
        return is_plain_decode(inputs) and len(inputs.counts) <= self.max_batch

    # -- one step -------------------------------------------------------------------------------
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [n, vocab] of a plain decode step of ``n`` sequences (``fits`` must hold)."""
        n = len(inputs.counts)
        bucket = self.bucket_for(n)
        lens = self._fill(inputs, bucket)
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph[0].replay()
            return graph[1][:n]
        return self._run_eager(bucket, lens)[:n]

    def _fill(self, inputs: StepInputs, bucket: int) -> list[int]:
        """Writes the step's rows and the padding rows of its bucket; returns the lengths."""
        n, bs = len(inputs.counts), self.block_size
        pad = bucket - n
        positions = list(inputs.starts)
        lens = [p + 1 for p in positions]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(inputs.tables, positions, strict=True)]
        host = torch.tensor(
            [
                inputs.token_ids + [0] * pad,
                positions + [0] * pad,
                slots + [-1] * pad,
                lens + [1] * pad,
            ],
            dtype=torch.long,
        ).to(self.input_ids.device)
        self.input_ids[:bucket].copy_(host[0])
        self.positions[:bucket].copy_(host[1])
        self.slot_mapping[:bucket].copy_(host[2])
        self.seq_lens[:bucket].copy_(host[3])
        width = max(-(-length // bs) for length in lens)
        tables = [t[:width] + [0] * (width - len(t[:width])) for t in inputs.tables]
        tables.extend([[0] * width] * pad)
        self.block_tables[:bucket, :width].copy_(torch.tensor(tables, dtype=torch.int32))
        return lens + [1] * pad

    def _meta(self, bucket: int, lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc_list=list(range(bucket + 1)),
            seq_lens_list=lens,
        )

    def _run_eager(self, bucket: int, lens: list[int]) -> torch.Tensor:
        return self._forward(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self._meta(bucket, lens),
            self.logits_indices[:bucket],
        )

    # -- capture --------------------------------------------------------------------------------
    def _capture_all(self) -> None:
        """One graph per bucket, largest first so the smaller ones reuse its pool's memory.
        Each bucket runs once eagerly first (kernel compilation, library handles), on padding
        rows only, so neither run writes the KV cache."""
        dev = self.input_ids.device
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        pool = None
        for bucket in reversed(self.buckets):
            lens = [1] * bucket
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._run_eager(bucket, lens)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    out = self._run_eager(bucket, lens)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"capturing the decode graph of batch {bucket} failed ({exc}); "
                    "--enforce-eager runs without CUDA graphs"
                ) from exc
            if pool is None:
                pool = graph.pool()
            self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before
        log.info(
            "CUDA graphs: %d decode buckets (%s) captured in %.1f s, %.0f MiB",
            len(self.buckets),
            ", ".join(map(str, self.buckets)),
            self.capture_seconds,
            self.pool_bytes / 2**20,
        )
