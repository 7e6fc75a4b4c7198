"""``EngineConfig``: every knob of one replica's engine, validated once, frozen afterwards.

Names follow vLLM's flags where the meaning is the same (``--block-size``,
``--max-model-len``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--enable-prefix-caching``). The KV cache is sized by exactly one of four knobs:

- ``num_kv_blocks``: an explicit number of blocks;
- ``kv_cache_bytes``: a byte budget, turned into blocks by the model's bytes per block;
- ``kv_cache_memory_fraction`` (the default, 0.2): a fraction of the memory *left after the
  weights and a profile run* (device memory on CUDA, available RAM on CPU);
- ``gpu_memory_utilization`` (vLLM's knob, CUDA only): a fraction of the device's *total*
  memory for weights, activations and KV together; the KV cache gets that budget minus the
  weights and the profile run's peak activations. ``0.9`` on an 80 GiB GPU with 16 GiB of
  weights and 2 GiB of activations leaves 72 - 18 = 54 GiB of KV. On CPU it is an error naming
  ``kv_cache_memory_fraction``/``kv_cache_bytes``.

The two fraction knobs differ in what they are a fraction of: ``kv_cache_memory_fraction`` of
what is *free* after loading (the other processes' use is respected whatever they hold), and
``gpu_memory_utilization`` of the *whole device* (a budget for this engine alone, vLLM's
meaning; two engines on one GPU need fractions that sum to under 1).

Setting more than one is an error; the engine logs the blocks and tokens it ends up with.
With ``tensor_parallel_size`` > 1 the budgets are per rank (each rank holds its share of the
KV heads), and the ranks agree on the smallest block count any of them can hold.

``device`` and ``dtype`` default to ``auto``: CUDA when a GPU is visible, else CPU; bfloat16 on
CUDA devices that support it (compute capability 8.0 and up), float16 on older ones, float32
on CPU. ``resolved()`` turns ``auto`` into concrete values; the engine calls it once where it
runs (the replica's engine process, never the driver) and logs the result, and
``torch_dtype`` refuses ``auto`` so nothing reads an unresolved value.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernels import KV_CACHE_DTYPES

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
MAX_TENSOR_PARALLEL_SIZE = 64
"""More ranks than any single node holds GPUs; a larger value is surely a typo."""
_DTYPES = ("float32", "float16", "bfloat16")
"""The dtypes an engine computes in, by their torch names (torch is imported where the engine
runs, not where a configuration is checked)."""
AUTO = "auto"
PREFILL_ORDERS = ("shortest_first", "fcfs")
ENGINES = ("model", "sim")
BF16_MIN_CAPABILITY = (8, 0)
"""Ampere and later compute bfloat16 natively; older GPUs emulate it slowly, so float16 there."""


AUTO_ENGINE_NICE = -5
"""The nice value ``engine_nice="auto"`` asks for, for an engine that leaves cores to others."""


def parse_engine_nice(value: str) -> int | str:
    """A ``--engine-nice`` argument: ``auto`` or an integer."""
    return value if value == "auto" else int(value)


def resolve_engine_nice(
    engine_nice: int | str | None, device: str, num_threads: int, num_cores: int
) -> int | None:
    """The nice value the engine process asks for: ``engine_nice`` itself, or for ``auto``
    ``AUTO_ENGINE_NICE`` when the engine leaves cores to other processes (``device`` cuda, or
    ``num_threads`` torch threads below ``num_cores``) and None (keep) when it fills them."""
    if engine_nice != "auto":
        return engine_nice
    if device.startswith("cuda") or num_threads < num_cores:
        return AUTO_ENGINE_NICE
    return None


def resolve_device(device: str, cuda_available: bool) -> str:
    """``auto``: ``cuda`` when a GPU is visible, else ``cpu``; anything else unchanged."""
    if device != AUTO:
        return device
    return "cuda" if cuda_available else "cpu"


def resolve_dtype(dtype: str, device: str, cuda_capability: tuple[int, int] | None) -> str:
    """``auto``: float32 on CPU; on CUDA bfloat16 from capability 8.0 up, else float16."""
    if dtype != AUTO:
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    if cuda_capability is not None and tuple(cuda_capability) >= BF16_MIN_CAPABILITY:
        return "bfloat16"
    return "float16"


_CPU_GMU_MESSAGE = (
    "is for CUDA devices (a fraction of the GPU's total memory); on CPU size the KV cache with "
    "kv_cache_memory_fraction (--kv-cache-memory-fraction, of the RAM left after loading) or "
    "kv_cache_bytes (--kv-cache-bytes)"
)


def parse_lora_modules(modules) -> tuple[tuple[str, str], ...]:
    """``lora_modules`` as (name, path) pairs from a mapping, pairs, ``name=path`` strings or
    vLLM's ``{"name": ..., "path": ...}`` objects; an empty or repeated name is a ``ValueError``."""
    items = modules.items() if isinstance(modules, dict) else modules
    pairs: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(
                    f"EngineConfig.lora_modules: {item!r} is not name=path (e.g. sql=/adapters/sql)"
                )
        elif isinstance(item, dict):
            if "name" not in item or "path" not in item:
                raise ValueError(
                    f"EngineConfig.lora_modules: {item!r} needs the keys 'name' and 'path'"
                )
            name, path = item["name"], item["path"]
        else:
            name, path = item
        name, path = str(name).strip(), str(path).strip()
        if not name or not path:
            raise ValueError(f"EngineConfig.lora_modules: empty name or path in {item!r}")
        if name in (n for n, _ in pairs):
            raise ValueError(f"EngineConfig.lora_modules: adapter name {name!r} is given twice")
        pairs.append((name, path))
    return tuple(pairs)


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    """A Hugging Face folder, a hub repo id (``org/name``, downloaded: ``worker/hub.py``), a
    ``.gguf`` file, or the alias ``smollm2`` (bundled)."""
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
    prefill_order: str = "shortest_first"
    """Which prefill work gets a step's budget first: ``shortest_first`` (fewest tokens left,
    the oldest guaranteed half a step) or ``fcfs`` (arrival order): ``worker/scheduler.py``."""
    enable_prefix_caching: bool = True
    dtype: str = AUTO
    """``float32``, ``float16``, ``bfloat16`` or ``auto`` (see the module docstring)."""
    device: str = AUTO
    """``cpu``, ``cuda[:N]`` or ``auto`` (CUDA when visible)."""
    seed: int = 0
    """Seed for requests that give none; sampling is keyed by (seed, position)."""
    deterministic: bool = True
    """Batch-invariant numerics: outputs independent of batch, cache hits and chunking."""
    kernel_backend: str = "auto"
    """``torch``, ``triton`` or ``auto`` (Triton on CUDA, torch on CPU): ``kernels/ops.py``."""
    enforce_eager: bool = False
    """vLLM's flag: run every step eagerly on CUDA. Off (the default), steps replay CUDA
    graphs captured at start (``worker/cuda_graphs.py``); CPU always runs eagerly."""
    overlap_outputs: str = AUTO
    """``on``: the engine loop launches step N+1's forward pass before it decodes step N's text
    and builds and sends its outputs, so that host work runs while the device computes
    (``worker/engine_core.py``'s ``EngineLoop``); ``off``: each step's outputs are sent before
    the next is scheduled. ``auto``: on where a launch returns before the pass ends (CUDA, the
    simulated engine), off on the CPU, where the pass runs inside the launch and overlapping
    would only hold each step's tokens until the next pass ends. Tokens are the same either
    way; only when they leave differs."""
    async_scheduling: str = AUTO
    """``on`` (with ``overlap_outputs``): when every sequence that samples in step N is greedy
    or drawn by its temperature alone (no logprobs, penalties, bias, grammar, top-k, top-p or
    min-p, ``min_tokens`` out), N's tokens are taken on the device at its launch, and step N+1 is
    scheduled and launched before they reach the host; its inputs take them on the device,
    and N's stop checks run while N+1 computes. A sequence that N ends computes one more token in
    N+1, which is dropped; the tokens never change. ``off``: each step is scheduled after the
    last one's tokens were appended. ``auto``: on for the simulated engine; off on CUDA until
    the GPU check has run its token-for-token tests there (``on`` opts in). Never with tensor
    parallelism (whose workers take token ids in the step message)."""
    kv_cache_dtype: str = "auto"
    """``auto`` (K/V in the model's dtype), ``int8`` or ``fp8_e4m3``: 8-bit K/V with a scale
    per token and KV head (``kernels/kv_quant.py``), about 4x the blocks of float32 and 2x
    those of bfloat16 in the same bytes."""
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
    engine_nice: int | str | None = None
    """The nice value the engine process asks for at start (Linux; lower runs first). ``auto``:
    ``AUTO_ENGINE_NICE`` when this engine leaves cores to the processes that relay its tokens
    (a CUDA engine's host loop, or fewer torch threads than the cores it may use), so its loop
    goes before them; an engine whose threads fill every core keeps its priority, sharing the
    cores with the request path as an equal. Only for one engine per node's cores: ``auto``
    sees its own threads, not its neighbours', and engines that fill a node's cores between
    them would starve the request path that admits their requests. Below the inherited value
    it needs ``CAP_SYS_NICE`` (root outside a container, or a root container with
    ``--cap-add SYS_NICE``; the Helm chart's non-root pods lack it); refused, the engine logs
    so and keeps its priority. None (the default): leave it."""
    claim_cpus: int = 0
    """At most this many CPUs the engine process may claim for itself on its node
    (``worker/cpu_claims.py``: pinned there, the node's other serving processes kept off them,
    granted only while one CPU stays unclaimed): one for the simulated engine's loop, its
    ``num_threads`` for a CPU engine; never for a CUDA engine or one whose torch threads span
    every core. The cluster sets it from the CPUs a replica reserves in Ray
    (``ClusterConfig.engine_cpu_affinity``); 0 (the default): never pinned."""
    cache_dir: str | None = None
    """Where converted GGUF models are cached; defaults to ``~/.cache/prefixserve``."""
    tensor_parallel_size: int = 1
    """Ranks one replica's model is split over (``worker/parallel``); 1: no splitting."""
    engine: str = "model"
    """``model`` runs the model; ``sim`` keeps the whole engine but replaces its forward pass
    with a timing model and pseudo-tokens (``worker/sim_runner.py``): a device of
    ``sim_profile``'s speed at no compute cost, for load and host-overhead tests."""
    enable_lora: bool = False
    """Serve LoRA adapters beside the base model (``worker/lora.py``); implied by
    ``lora_modules``."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """Adapters known from the start, as (name, PEFT folder) pairs; a mapping or
    ``name=path`` strings are accepted too. The name is what requests put in ``model``."""
    max_loras: int = 8
    """Adapters on the device at once (slots): one step runs at most this many distinct
    adapters; the rest wait in host memory."""
    max_lora_rank: int = 16
    """Highest adapter rank accepted."""
    sim_profile: str = "gpu"
    """With ``engine="sim"``: a preset of ``worker/sim_profiles.json`` (``cpu``, ``gpu``) or a
    JSON file of one profile (``worker/sim_model.py``)."""

    def __post_init__(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"EngineConfig.{field}: {msg}")

        modules = parse_lora_modules(self.lora_modules)
        object.__setattr__(self, "lora_modules", modules)  # normalised once, still frozen
        if modules:
            object.__setattr__(self, "enable_lora", True)
        need(
            isinstance(self.max_loras, int) and self.max_loras >= 1,
            "max_loras",
            f"must be a positive integer, got {self.max_loras!r}",
        )
        need(
            isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512,
            "max_lora_rank",
            f"must be an integer in [1, 512], got {self.max_lora_rank!r}",
        )

        need(
            isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string"
        )
        need(
            self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            f"must be one of 8, 16, 32, 64, 128, got {self.block_size}",
        )
        need(
            self.max_model_len is None or self.max_model_len > 0,
            "max_model_len",
            f"must be positive, got {self.max_model_len}",
        )
        need(self.max_num_seqs > 0, "max_num_seqs", f"must be positive, got {self.max_num_seqs}")
        need(
            self.max_num_batched_tokens >= self.block_size,
            "max_num_batched_tokens",
            f"must be at least block_size ({self.block_size}), got {self.max_num_batched_tokens}",
        )
        need(
            self.prefill_order in PREFILL_ORDERS,
            "prefill_order",
            f"must be one of {', '.join(PREFILL_ORDERS)}, got {self.prefill_order!r}",
        )
        need(
            self.dtype in _DTYPES or self.dtype == AUTO,
            "dtype",
            f"must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}",
        )
        need(
            isinstance(self.device, str)
            and (self.device in ("cpu", AUTO) or self.device.startswith("cuda")),
            "device",
            f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        need(
            self.overlap_outputs in (AUTO, "on", "off"),
            "overlap_outputs",
            f"must be 'auto', 'on' or 'off', got {self.overlap_outputs!r}",
        )
        need(
            self.async_scheduling in (AUTO, "on", "off"),
            "async_scheduling",
            f"must be 'auto', 'on' or 'off', got {self.async_scheduling!r}",
        )
        need(
            not (self.async_scheduling == "on" and self.overlap_outputs == "off"),
            "async_scheduling",
            "'on' needs overlap_outputs 'on' or 'auto' (a step scheduled ahead is one in flight)",
        )
        need(
            self.kernel_backend in ("auto", "torch", "triton"),
            "kernel_backend",
            f"must be 'auto', 'torch' or 'triton', got {self.kernel_backend!r}",
        )
        need(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )
        knobs = [
            k
            for k in (
                "num_kv_blocks",
                "kv_cache_bytes",
                "kv_cache_memory_fraction",
                "gpu_memory_utilization",
            )
            if getattr(self, k) is not None
        ]
        need(
            len(knobs) <= 1,
            "num_kv_blocks",
            "set only one of num_kv_blocks, kv_cache_bytes, kv_cache_memory_fraction, "
            f"gpu_memory_utilization (got {', '.join(knobs)})",
        )
        need(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            "num_kv_blocks",
            f"must be at least 2, got {self.num_kv_blocks}",
        )
        need(
            self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
            "kv_cache_bytes",
            f"must be positive, got {self.kv_cache_bytes}",
        )
        frac = self.kv_cache_memory_fraction
        need(
            frac is None or 0.0 < frac <= 0.95,
            "kv_cache_memory_fraction",
            f"must be in (0, 0.95], got {frac}",
        )
        gmu = self.gpu_memory_utilization
        need(
            gmu is None or 0.0 < gmu <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {gmu}",
        )
        need(gmu is None or self.device != "cpu", "gpu_memory_utilization", _CPU_GMU_MESSAGE)
        need(
            isinstance(self.generation_config, str) and bool(self.generation_config),
            "generation_config",
            "must be 'auto', 'vllm' or a folder holding generation_config.json",
        )
        need(
            self.host_kv_cache_bytes is None or self.host_kv_cache_bytes > 0,
            "host_kv_cache_bytes",
            f"must be positive, got {self.host_kv_cache_bytes}",
        )
        need(
            self.max_waiting_requests > 0,
            "max_waiting_requests",
            f"must be positive, got {self.max_waiting_requests}",
        )
        need(
            0 <= self.max_logprobs <= 20,
            "max_logprobs",
            f"must be in [0, 20], got {self.max_logprobs}",
        )
        nice = self.engine_nice
        need(
            nice is None
            or nice == "auto"
            or (isinstance(nice, int) and not isinstance(nice, bool) and -20 <= nice <= 19),
            "engine_nice",
            f"must be 'auto', null or an integer in [-20, 19], got {nice!r}",
        )
        need(
            isinstance(self.claim_cpus, int) and self.claim_cpus >= 0,
            "claim_cpus",
            f"must be an integer >= 0, got {self.claim_cpus!r}",
        )
        need(
            self.num_threads is None or self.num_threads > 0,
            "num_threads",
            f"must be positive, got {self.num_threads}",
        )
        tp = self.tensor_parallel_size
        need(
            isinstance(tp, int)
            and not isinstance(tp, bool)
            and 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE,
            "tensor_parallel_size",
            f"must be an integer in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {tp!r}",
        )
        need(
            self.engine in ENGINES,
            "engine",
            f"must be one of {', '.join(ENGINES)}, got {self.engine!r}",
        )
        need(
            self.engine != "sim" or tp == 1,
            "engine",
            "the simulated engine runs one rank; leave tensor_parallel_size at 1",
        )
        need(
            self.engine != "sim"
            or (self.kv_cache_memory_fraction is None and self.gpu_memory_utilization is None),
            "engine",
            "the simulated engine sizes its KV cache from its profile (kv_capacity_tokens); "
            "set num_kv_blocks or kv_cache_bytes instead of a memory fraction",
        )
        need(
            self.engine != "sim" or self.kv_cache_dtype == "auto",
            "kv_cache_dtype",
            "the simulated engine prices K/V in its profile's bytes per token; leave "
            "kv_cache_dtype at auto",
        )
        need(
            tp == 1 or self.host_kv_cache_bytes is None,
            "host_kv_cache_bytes",
            "the host KV tier does not support tensor_parallel_size > 1 yet; leave it unset",
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == AUTO:
            raise ValueError(
                "EngineConfig.dtype is 'auto': call EngineConfig.resolved() where the engine runs"
            )
        import torch

        return getattr(torch, self.dtype)

    def resolved(self) -> EngineConfig:
        """A copy with ``auto`` device and dtype made concrete for this process's hardware."""
        import torch

        cuda_available = torch.cuda.is_available()
        device = resolve_device(self.device, cuda_available)
        if device.startswith("cuda") and not cuda_available:
            raise ValueError(
                f"EngineConfig.device: {device!r} but this process sees no CUDA device "
                f"(torch {torch.__version__}); use 'auto' or 'cpu', or a CUDA build of torch"
            )
        capability = None
        if self.dtype == AUTO and device.startswith("cuda"):
            capability = torch.cuda.get_device_capability(torch.device(device))
        dtype = resolve_dtype(self.dtype, device, capability)
        if device == "cpu" and self.gpu_memory_utilization is not None:
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization: {_CPU_GMU_MESSAGE} "
                "(device 'auto' found no GPU)"
            )
        if (device, dtype) != (self.device, self.dtype):
            log.info(
                "engine config: device %s -> %s, dtype %s -> %s%s",
                self.device,
                device,
                self.dtype,
                dtype,
                f" (compute capability {capability[0]}.{capability[1]})" if capability else "",
            )
        return self.replace(device=device, dtype=dtype)

    @property
    def memory_fraction(self) -> float:
        """The fraction knob in force when neither blocks nor bytes were given."""
        if (
            self.num_kv_blocks is None
            and self.kv_cache_bytes is None
            and self.gpu_memory_utilization is None
        ):
            return (
                self.kv_cache_memory_fraction if self.kv_cache_memory_fraction is not None else 0.2
            )
        return 0.0

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
