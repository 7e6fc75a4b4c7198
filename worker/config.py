"""``EngineConfig``: every knob of one replica's engine, validated once, frozen afterwards.

Names follow vLLM's flags where the meaning is the same (``--block-size``,
``--max-model-len``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--enable-prefix-caching``). The KV cache is sized by exactly one of three knobs:

- ``num_kv_blocks``: an explicit number of blocks;
- ``kv_cache_bytes``: a byte budget, turned into blocks by the model's bytes per block;
- ``kv_cache_memory_fraction`` (the default, 0.2): a fraction of the memory *left after the
  weights and a profile run* (device memory on CUDA, available RAM on CPU).

Setting more than one is an error; the engine logs the blocks and tokens it ends up with.
With ``tensor_parallel_size`` > 1 the budgets are per rank (each rank holds its share of the
KV heads), and the ranks agree on the smallest block count any of them can hold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DEFAULT_MODEL = "smollm2"
MAX_TENSOR_PARALLEL_SIZE = 64
"""More ranks than any single node holds GPUs; a larger value is surely a typo."""
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    """A Hugging Face folder, a ``.gguf`` file, or the alias ``smollm2`` (bundled)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``model`` is a hub repo id."""
    download_dir: str | None = None
    """Where hub models are downloaded; defaults to the Hugging Face cache (``HF_HOME``)."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; defaults to the model's own."""
    chat_template: str | None = None
    """A Jinja chat template (a file path or the template itself) replacing the model's."""
    generation_config: str = "auto"
    """Sampling defaults: ``auto`` (the model's ``generation_config.json``), ``vllm`` (none),
    or a folder holding a ``generation_config.json``."""
    model_id: str | None = None
    """Name served in the API and mixed into block hashes; defaults to the model's name."""
    block_size: int = 16
    max_model_len: int | None = None
    """Context limit in tokens; defaults to the model's ``max_position_embeddings``."""
    max_num_seqs: int = 64
    """Most requests running (holding KV blocks) at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one step: prefill chunks and decodes share it."""
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    """Seed for requests that give none; sampling is keyed by (seed, position)."""
    deterministic: bool = True
    """Batch-invariant numerics: outputs independent of batch, cache hits and chunking."""
    kernel_backend: str = "auto"
    """``torch``, ``triton`` or ``auto`` (Triton on CUDA, torch on CPU): ``kernels/ops.py``."""
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    gpu_memory_utilization: float | None = None
    """vLLM's knob (CUDA only): fraction of the device's total memory for weights,
    activations and KV together; the KV cache gets what is left of it."""
    host_kv_cache_bytes: int | None = None
    """Second KV tier in host RAM for evicted prefix blocks (pinned on CUDA); None: off."""
    max_waiting_requests: int = 1024
    """Bound on the waiting queue; past it ``add_request`` raises ``EngineOverloadedError``."""
    max_logprobs: int = 20
    num_threads: int | None = None
    """torch intra-op threads on CPU; None keeps torch's default."""
    cache_dir: str | None = None
    """Where converted GGUF models are cached; defaults to ``~/.cache/prefixserve``."""
    tensor_parallel_size: int = 1
    """Ranks one replica's model is split over (``worker/parallel``); 1: no splitting."""

    def __post_init__(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"EngineConfig.{field}: {msg}")

        need(isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string")
        need(self.block_size in (8, 16, 32, 64, 128), "block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        need(self.max_model_len is None or self.max_model_len > 0, "max_model_len", f"must be positive, got {self.max_model_len}")
        need(self.max_num_seqs > 0, "max_num_seqs", f"must be positive, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= self.block_size, "max_num_batched_tokens",
             f"must be at least block_size ({self.block_size}), got {self.max_num_batched_tokens}")
        need(self.dtype in _DTYPES, "dtype", f"must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        need(self.device == "cpu" or self.device.startswith("cuda"), "device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        need(self.kernel_backend in ("auto", "torch", "triton"), "kernel_backend",
             f"must be 'auto', 'torch' or 'triton', got {self.kernel_backend!r}")
        knobs = [k for k in ("num_kv_blocks", "kv_cache_bytes", "kv_cache_memory_fraction", "gpu_memory_utilization") if getattr(self, k) is not None]
        need(len(knobs) <= 1, "num_kv_blocks", f"set only one of num_kv_blocks, kv_cache_bytes, kv_cache_memory_fraction, gpu_memory_utilization (got {', '.join(knobs)})")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks", f"must be at least 2, got {self.num_kv_blocks}")
        need(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes", f"must be positive, got {self.kv_cache_bytes}")
        frac = self.kv_cache_memory_fraction
        need(frac is None or 0.0 < frac <= 0.95, "kv_cache_memory_fraction", f"must be in (0, 0.95], got {frac}")
        gmu = self.gpu_memory_utilization
        need(gmu is None or 0.0 < gmu <= 1.0, "gpu_memory_utilization", f"must be in (0, 1], got {gmu}")
        need(isinstance(self.generation_config, str) and bool(self.generation_config), "generation_config",
             "must be 'auto', 'vllm' or a folder holding generation_config.json")
        need(self.host_kv_cache_bytes is None or self.host_kv_cache_bytes > 0, "host_kv_cache_bytes",
             f"must be positive, got {self.host_kv_cache_bytes}")
        need(self.max_waiting_requests > 0, "max_waiting_requests", f"must be positive, got {self.max_waiting_requests}")
        need(0 <= self.max_logprobs <= 20, "max_logprobs", f"must be in [0, 20], got {self.max_logprobs}")
        need(self.num_threads is None or self.num_threads > 0, "num_threads", f"must be positive, got {self.num_threads}")
        tp = self.tensor_parallel_size
        need(isinstance(tp, int) and not isinstance(tp, bool) and 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE,
             "tensor_parallel_size", f"must be an integer in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {tp!r}")
        need(tp == 1 or self.host_kv_cache_bytes is None, "host_kv_cache_bytes",
             "the host KV tier does not support tensor_parallel_size > 1 yet; leave it unset")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def memory_fraction(self) -> float:
        """The fraction knob in force when neither blocks nor bytes were given."""
        if self.num_kv_blocks is None and self.kv_cache_bytes is None and self.gpu_memory_utilization is None:
            return self.kv_cache_memory_fraction if self.kv_cache_memory_fraction is not None else 0.2
        return 0.0

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
