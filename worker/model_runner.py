"""``ModelRunner``: owns the weights and the KV cache tensors, and runs one scheduled batch.

It turns a ``ScheduledBatch`` into the flat tensors the model reads (token ids, positions,
slot mapping, block tables, query start offsets) and returns logits for the requests whose
step reaches the end of their known tokens (those sample a token).

KV sizing happens here because it needs the model's shape: ``num_kv_blocks`` as given, or
``kv_cache_bytes`` divided by the bytes of one block, or a fraction of the memory left after
the weights and a profile run (``/proc/meminfo`` MemAvailable on CPU, free device memory on
CUDA), or, with ``gpu_memory_utilization`` (CUDA), that fraction of the device's total memory
less the weights and the profile run's peak activations (``kv_bytes_for_utilization``, vLLM's
arithmetic). Too little memory for two blocks is a ``ValueError`` that says which knob to raise.

Tensor parallelism: every rank runs a ``ModelRunner`` over its shard with the same config.
Rank 0's ``execute`` sends the step to the others (``worker/parallel/step_message.py``) before
running it; the others call ``execute_message`` in their loop (``worker/parallel/workers.py``).
The ranks agree on the smallest KV block count any of them can hold. A peer that dies makes
the step's collectives raise, and the exception propagates out of ``execute``.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import torch

from kernels.attention import AttentionMetadata, exact_tile_rows
from kernels.kv_quant import kv_format
from kernels.linear import log_tile_choices
from kernels.ops import select_backend
from worker.block_tables import BlockTableRows
from worker.config import EngineConfig
from worker.cuda_graphs import StepGraphs
from worker.lora import make_manager
from worker.models.llama import CausalLM, ModelSpec
from worker.parallel.communicator import SINGLE_RANK, Communicator
from worker.parallel.sharding import ShardPlan
from worker.parallel.step_message import StepDecoder, StepEncoder, StepInputs, inputs_of
from worker.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_bytes_for_utilization(
    total_bytes: int, weight_bytes: int, peak_activation_bytes: int, utilization: float
) -> int:
    """KV bytes under ``gpu_memory_utilization``: the engine may use ``utilization`` of the
    device's total memory; the weights and the profile run's peak activations come first.
    A budget that the weights and activations already exceed is a ``ValueError``."""
    budget_bytes = int(total_bytes * utilization)
    kv_bytes = budget_bytes - weight_bytes - peak_activation_bytes
    if kv_bytes <= 0:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {budget_bytes / gib:.2f} GiB "
            "of the device's "
            f"{total_bytes / gib:.2f} GiB, but the weights take {weight_bytes / gib:.2f} GiB "
            "and the profile run's "
            f"activations {peak_activation_bytes / gib:.2f} GiB: no room for the KV cache; raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens"
        )
    return kv_bytes


def kv_block_bytes(
    spec: ModelSpec, kv_cache_dtype: str, model_dtype: torch.dtype, block_size: int
) -> int:
    """K and V of one block across all layers and KV heads of ``spec`` (one rank's shard
    under tensor parallelism), stored as ``kv_cache_dtype`` (``kernels/kv_quant.py``)."""
    row_bytes = kv_format(kv_cache_dtype).row_bytes(spec.head_dim, model_dtype)
    return 2 * spec.num_layers * spec.num_kv_heads * row_bytes * block_size


def explicit_kv_blocks(config: EngineConfig, bytes_per_block: int) -> int | None:
    """The KV blocks ``num_kv_blocks`` or ``kv_cache_bytes`` ask for (the bytes divided by
    ``bytes_per_block``); None when neither is set. A budget under two blocks is a
    ``ValueError`` naming it."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_bytes is None:
        return None
    blocks = config.kv_cache_bytes // bytes_per_block
    if blocks < 2:
        raise ValueError(
            f"kv_cache_bytes={config.kv_cache_bytes} holds {blocks} blocks of "
            f"{bytes_per_block} bytes; need at least 2"
        )
    return int(blocks)


def host_kv_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Blocks of the host tier ``host_kv_cache_bytes`` holds (0: no host tier); a budget
    under one block is a ``ValueError`` naming it."""
    if config.host_kv_cache_bytes is None:
        return 0
    blocks = config.host_kv_cache_bytes // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"host_kv_cache_bytes={config.host_kv_cache_bytes} is under one block "
            f"({bytes_per_block} bytes)"
        )
    return blocks


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        max_model_len: int,
        comm: Communicator = SINGLE_RANK,
        vocab_start: int = 0,
        *,
        full_spec: ModelSpec | None = None,
        shard: ShardPlan | None = None,
    ):
        """``spec`` is the shape this rank computes (its shard's, under tensor parallelism);
        ``full_spec`` and ``shard`` (the whole model's shape and this rank's plan) are needed
        only to slice LoRA adapters under tensor parallelism."""
        self.config = config
        self.spec = spec
        self.comm = comm
        self._encoder = StepEncoder() if comm.world_size > 1 and comm.rank == 0 else None
        self._decoder = StepDecoder() if comm.rank > 0 else None
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.device = torch.device(config.device)
        weights = {k: v.to(self.device) for k, v in weights.items()}
        self.ops = select_backend(
            config.kernel_backend, config.deterministic, config.device, config.kv_cache_dtype
        )
        kv_format(config.kv_cache_dtype, spec.head_dim)  # refuses a head size it cannot store
        self.model = CausalLM(
            spec, weights, self.ops, max_positions=max_model_len, comm=comm, vocab_start=vocab_start
        )
        log_tile_choices()  # what the CPU probes chose for this model's linear weights
        if self.ops.name == "torch":
            exact_tile_rows(
                spec.head_dim, config.torch_dtype
            )  # the attention's probe, logged now, not mid-step
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self._table_rows = BlockTableRows(
            config.max_num_seqs, self.max_blocks_per_seq, pin=self.device.type == "cuda"
        )
        """Eager steps' block tables, kept between steps (``worker/block_tables.py``)."""
        self.num_blocks = comm.min_int(self._decide_num_blocks())
        dtype = self.ops.kv_format.cache_dtype(config.torch_dtype)
        # One tensor [layers, K/V, (cache layout of the backend)]: a block's KV across all layers
        # moves in one copy. ``_block`` indexes one block in it. An 8-bit cache is bytes whose
        # rows end with their scale (``kernels/kv_quant.py``).
        self.kv = torch.zeros(
            spec.num_layers, 2, *self._cache_shape(self.num_blocks), dtype=dtype, device=self.device
        )
        self.kv_caches = [
            (self.kv[layer, 0], self.kv[layer, 1]) for layer in range(spec.num_layers)
        ]
        block_shape = tuple(self.kv[self._block(0)].shape[2:])
        self.host_kv: torch.Tensor | None = None
        self.num_host_blocks = host_kv_blocks(config, self.bytes_per_block)
        if self.num_host_blocks:
            self.host_kv = torch.zeros(
                self.num_host_blocks,
                spec.num_layers,
                2,
                *block_shape,
                dtype=dtype,
                pin_memory=self.device.type == "cuda",
            )
            log.info(
                "host KV tier: %d blocks (%.1f MiB)",
                self.num_host_blocks,
                self.num_host_blocks * self.bytes_per_block / 2**20,
            )
        self._load_s = 0.0
        self._pending_load_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, K/V as %s)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block / 2**20,
            self.kv_cache_dtype,
        )
        self.step_graphs = self._step_graphs()
        self.lora = make_manager(
            config, full_spec or spec, self.device, self.ops.prepare_weight, shard=shard
        )

    def _step_graphs(self) -> StepGraphs | None:
        """CUDA graphs for decode and mixed steps (``worker/cuda_graphs.py``): on for a single
        rank on CUDA with the Triton kernels, unless ``enforce_eager``; None runs every step
        eagerly."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if self.comm.world_size > 1 or self.ops.name != "triton":
            log.info(
                "CUDA graphs: off (%s); steps run eagerly",
                "tensor parallelism" if self.comm.world_size > 1 else "torch kernels",
            )
            return None
        return StepGraphs(
            lambda ids, positions, meta, rows: self.model.forward(
                ids, positions, self.kv_caches, meta, rows
            ),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_blocks_per_seq=self.max_blocks_per_seq,
            block_size=self.block_size,
            vocab_size=self.model.lm_head.shape[0],
            device=self.device,
            capture=True,
        )

    def _cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.spec
        width = self.ops.kv_format.row_width(s.head_dim)
        if self.ops.head_major_cache:
            return (s.num_kv_heads, num_blocks, self.block_size, width)
        return (num_blocks, self.block_size, s.num_kv_heads, width)

    def _block(self, block_id: int) -> tuple:
        """Index of one block (all layers, K and V) in ``self.kv``, in the backend's layout."""
        every = slice(None)
        return (
            (every, every, every, block_id)
            if self.ops.head_major_cache
            else (every, every, block_id)
        )

    # -- host tier (worker/host_cache.py's KVMover) --------------------------------------------
    def save(self, block_id: int, slot: int) -> None:
        self.host_kv[slot].copy_(self.kv[self._block(block_id)], non_blocking=False)

    def load(self, slot: int, block_id: int) -> None:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            self.kv[self._block(block_id)].copy_(self.host_kv[slot])
            self._load_s += time.perf_counter() - t0
            return
        # The copy is asynchronous (pinned host memory): the wall clock would time the enqueue
        # only. Events on the copy's stream time the transfer itself, read when asked for.
        stream = torch.cuda.current_stream(self.device)  # the stream the copy is queued on
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self.kv[self._block(block_id)].copy_(self.host_kv[slot], non_blocking=True)
        end.record(stream)
        self._pending_load_events.append((start, end))

    @property
    def load_seconds_total(self) -> float:
        """Seconds spent copying blocks from the host tier onto the device, since start."""
        for start, end in self._pending_load_events:
            end.synchronize()
            self._load_s += start.elapsed_time(end) / 1000.0  # elapsed_time is in milliseconds
        self._pending_load_events.clear()
        return self._load_s

    @property
    def kv_cache_dtype(self) -> str:
        """How K/V are stored: the model's dtype's name, or the 8-bit format's."""
        fmt = self.ops.kv_format
        return fmt.name if fmt.quantized else str(self.config.torch_dtype).removeprefix("torch.")

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers, in the cache's format."""
        return kv_block_bytes(
            self.spec, self.ops.kv_format.name, self.config.torch_dtype, self.block_size
        )

    def _decide_num_blocks(self) -> int:
        c = self.config
        explicit = explicit_kv_blocks(c, self.bytes_per_block)
        if explicit is not None:
            return explicit
        if c.gpu_memory_utilization is not None:
            budget = self._utilization_budget_bytes()
            knob = f"gpu_memory_utilization={c.gpu_memory_utilization}"
        else:
            self._profile_run()
            budget = int(available_memory_bytes(c.device) * c.memory_fraction)
            knob = f"kv_cache_memory_fraction={c.memory_fraction}"
        blocks = budget // self.bytes_per_block
        if blocks < 2:
            raise ValueError(
                f"{knob} leaves {budget} bytes: under 2 KV blocks; raise it or set --num-kv-blocks"
            )
        # No use holding more than every running sequence could fill at full length, plus slack.
        return int(min(blocks, c.max_num_seqs * self.max_blocks_per_seq + 64))

    def _utilization_budget_bytes(self) -> int:
        """KV bytes for ``gpu_memory_utilization``: measures the weights and the profile run."""
        if self.device.type != "cuda":
            raise ValueError(
                "gpu_memory_utilization is for CUDA devices; on CPU use kv_cache_memory_fraction "
                "or kv_cache_bytes"
            )
        dev = self.device
        gc.collect()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        weight_bytes = torch.cuda.memory_allocated(dev)  # weights and the model's own buffers
        torch.cuda.reset_peak_memory_stats(dev)
        self._profile_run()
        torch.cuda.synchronize(dev)
        peak_activation_bytes = max(0, torch.cuda.max_memory_allocated(dev) - weight_bytes)
        torch.cuda.empty_cache()
        free_bytes, total_bytes = torch.cuda.mem_get_info(dev)
        kv_bytes = kv_bytes_for_utilization(
            total_bytes, weight_bytes, peak_activation_bytes, self.config.gpu_memory_utilization
        )
        if kv_bytes > free_bytes:
            raise ValueError(
                f"gpu_memory_utilization={self.config.gpu_memory_utilization} asks for "
                f"{kv_bytes / 2**30:.2f} GiB of KV "
                f"but only {free_bytes / 2**30:.2f} GiB of {dev} is free "
                "(other processes hold the rest); lower it"
            )
        log.info(
            "gpu_memory_utilization=%s of %.2f GiB: weights %.2f GiB, activations %.2f GiB, "
            "KV %.2f GiB",
            self.config.gpu_memory_utilization,
            total_bytes / 2**30,
            weight_bytes / 2**30,
            peak_activation_bytes / 2**30,
            kv_bytes / 2**30,
        )
        return kv_bytes

    def _profile_run(self) -> None:
        """One forward of a full token budget, so its activations are counted as used memory."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        shape = self._cache_shape(blocks)
        dev, dtype = self.device, self.config.torch_dtype
        caches = [
            (
                torch.zeros(shape, dtype=dtype, device=dev),
                torch.zeros(shape, dtype=dtype, device=dev),
            )
            for _ in range(self.spec.num_layers)
        ]
        meta = self._metadata([list(range(blocks))], [0], [n])
        self.model.forward(
            torch.zeros(n, dtype=torch.long, device=dev),
            torch.arange(n, device=dev),
            caches,
            meta,
            torch.tensor([n - 1], device=dev),
        )
        del caches
        gc.collect()

    def _metadata(
        self, tables: list[list[int]], starts: list[int], counts: list[int]
    ) -> AttentionMetadata:
        bs = self.block_size
        qsl = [0]
        slots: list[int] = []
        for table, start, count in zip(tables, starts, counts, strict=True):
            qsl.append(qsl[-1] + count)
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + count))
        width = max(self._table_rows.write(tables), 1)
        block_tables = self._table_rows.host[: len(tables), :width]
        lens = [s + c for s, c in zip(starts, counts, strict=True)]
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev, copy=True).contiguous(),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc_list=qsl,
            seq_lens_list=lens,
        )

    def execute(
        self, batch: ScheduledBatch, extra_rows: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Runs the batch. Returns (logits [num_sampling + len(extra_rows), vocab] on the
        runner's device, indices into batch.requests of the sampling rows). ``extra_rows``: rows
        of the flat batch whose logits follow the sampling rows' (prompt logprobs; one rank
        only, the step message has no room). The logits are valid until the next step (a
        replayed graph returns a view of its static output)."""
        inputs, sampling_reqs = inputs_of(batch)
        if extra_rows:
            if self._encoder is not None:
                raise ValueError("prompt logprobs are not supported with tensor parallelism")
            inputs.sampling_rows.extend(extra_rows)
        if self._encoder is not None:
            self.comm.send_step(self._encoder.encode(batch, inputs))
        return self.run_inputs(inputs), sampling_reqs

    def execute_message(self, message: torch.Tensor) -> None:
        """Ranks 1..N-1: run the step rank 0 sent (its logits stay on rank 0)."""
        self.run_inputs(self._decoder.decode(message))

    def run_inputs(self, inputs: StepInputs) -> torch.Tensor:
        lora = (
            self.lora.batch(inputs.adapters, inputs.counts)
            if self.lora is not None and any(inputs.adapters)
            else None
        )
        if self.step_graphs is not None and lora is None:  # steps with adapters run eagerly
            shape = self.step_graphs.shape_for(inputs)
            if shape is not None:
                return self.step_graphs.run(inputs, shape)
        positions = [
            p
            for start, count in zip(inputs.starts, inputs.counts, strict=True)
            for p in range(start, start + count)
        ]
        meta = self._metadata(inputs.tables, inputs.starts, inputs.counts)
        dev = self.device
        token_ids = torch.tensor(inputs.token_ids, dtype=torch.long, device=dev)
        if inputs.fed_rows:  # tokens in flight: the step before's sampled ids, on the device
            rows = torch.tensor(inputs.fed_rows, dtype=torch.long, device=dev)
            src = torch.tensor(inputs.fed_src, dtype=torch.long, device=dev)
            token_ids[rows] = inputs.fed_ids[src]
        logits = self.model.forward(
            token_ids,
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            torch.tensor(inputs.sampling_rows, dtype=torch.long, device=dev),
            lora,
        )
        return logits
