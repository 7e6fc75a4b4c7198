"""LoRA adapters: PEFT folders read into host memory, a fixed number of device slots, and the
per-step grouping the model adds their deltas with.

An adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) whose
targets are among the decoder's seven projections (``q/k/v/o_proj``, ``gate/up/down_proj``).
``read_adapter`` checks it against the model and fuses it the way the model fuses its weights:
per layer one A and one block-diagonal B for ``qkv`` and for ``gate_up``, one pair for ``o``
and for ``down``, the PEFT scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) folded
into B. Under tensor parallelism each rank keeps the slices its layers hold: B sharded like a
column-parallel weight's rows (q, k, v, gate, up), A like a row-parallel weight's columns
(o, down); a row-parallel delta is a partial sum that the layer's all-reduce completes.

``LoRAManager`` owns every adapter a replica knows (host memory) and ``max_loras`` device
slots, filled on demand and emptied least recently used first; the scheduler never runs more
distinct adapters in one step than there are slots. ``LoRABatch`` is one step's rows grouped
by adapter, in adapter-id order: each group's delta is ``linear(linear(x[rows], A), B)``
through the backend's own linear, which is batch-invariant in deterministic mode, then added
to those rows of the base output. A row's bits therefore depend only on its own tokens and its
own adapter, never on which adapters share the step.

Failures: a folder that is not a PEFT LoRA adapter for this model (missing files, other
targets, DoRA, a rank above ``max_lora_rank``, shapes that do not match) is a ``ValueError``
naming the folder and the problem, raised before the adapter is known.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.models.llama import ModelSpec

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""The model's fused linear layers and the PEFT target modules each one stands for."""

log = logging.getLogger(__name__)

_MODULE_PATH = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
TARGET_MODULES = tuple(_MODULE_PATH)
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module in ``spec`` (one rank's shard under TP)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter in host memory, fused per layer: ``layers[i][group] = (A, B)`` with A
    ``[rank_sum, in]`` and B ``[out, rank_sum]`` (block-diagonal across the group's targets,
    scaling folded in); a group the adapter does not target is absent."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for layer in self.layers
            for a, b in layer.values()
        )


def _read_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {folder}: no adapter_config.json (not a PEFT folder)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"LoRA adapter {folder}: adapter_config.json is not JSON ({exc})"
        ) from None
    kind = cfg.get("peft_type", "LORA")
    problems = []
    if kind != "LORA":
        problems.append(f"peft_type is {kind!r}, not 'LORA'")
    if cfg.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        problems.append("modules_to_save (fully trained modules) is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problems.append("per-module rank_pattern/alpha_pattern is not supported")
    if cfg.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out is not supported")
    if not isinstance(cfg.get("r"), int) or cfg["r"] <= 0:
        problems.append(f"r must be a positive integer, got {cfg.get('r')!r}")
    if problems:
        raise ValueError(f"LoRA adapter {folder}: " + "; ".join(problems))
    return cfg


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {folder}: no adapter_model.safetensors")
    from safetensors.torch import load_file

    return load_file(str(path))


def read_adapter(
    name: str,
    path: str,
    spec: ModelSpec,
    dtype: torch.dtype,
    *,
    max_rank: int,
    shard=None,
) -> AdapterWeights:
    """Reads the PEFT folder ``path`` as adapter ``name`` for the model ``spec`` (the full
    model's). ``shard``: this rank's ``ShardPlan`` under tensor parallelism (its slices are
    kept), or None."""
    folder = Path(path)
    cfg = _read_config(folder)
    rank = cfg["r"]
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {folder}: rank {rank} is above max_lora_rank={max_rank}; "
            "raise --max-lora-rank"
        )
    alpha = cfg.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(folder).items():
        match = _KEY.match(key)
        if match is None or match.group(3) not in _MODULE_PATH:
            raise ValueError(
                f"LoRA adapter {folder}: tensor {key!r} is not a LoRA A/B of a decoder "
                f"projection (supported targets: {', '.join(TARGET_MODULES)})"
            )
        layer, module = int(match.group(1)), match.group(3)
        if layer >= spec.num_layers:
            raise ValueError(
                f"LoRA adapter {folder}: {key!r} names layer {layer}; the model has "
                f"{spec.num_layers}"
            )
        pairs.setdefault((layer, module), {})[match.group(4)] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {folder}: adapter_model.safetensors holds no LoRA weights")
    full = module_shapes(spec)
    local_spec = shard.local_spec(spec) if shard is not None else spec
    local = module_shapes(local_spec)
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for layer in range(spec.num_layers):
        fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for group, modules in GROUPS.items():
            parts = []
            for module in modules:
                pair = pairs.get((layer, module))
                if pair is None:
                    continue
                if set(pair) != {"A", "B"}:
                    raise ValueError(
                        f"LoRA adapter {folder}: layer {layer} {module} lacks lora_"
                        f"{'B' if 'A' in pair else 'A'}"
                    )
                a, b = pair["A"], pair["B"]
                fan_in, fan_out = full[module]
                if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
                    raise ValueError(
                        f"LoRA adapter {folder}: layer {layer} {module} has A "
                        f"{tuple(a.shape)} and B {tuple(b.shape)}; this model needs "
                        f"({rank}, {fan_in}) and ({fan_out}, {rank})"
                    )
                if shard is not None:
                    where = shard.slice_of(
                        f"model.layers.{layer}.{_MODULE_PATH[module]}.weight", spec.head_dim
                    )
                    if where is not None and where[0] == 0:
                        b = b[where[1] : where[2]]
                    elif where is not None:
                        a = a[:, where[1] : where[2]]
                parts.append((module, a.to(torch.float32), b.to(torch.float32) * scaling))
            if parts:
                fused[group] = _fuse(modules, parts, local, dtype)
        per_layer.append(fused)
    targets = tuple(sorted({module for _, module in pairs}, key=TARGET_MODULES.index))
    return AdapterWeights(name, str(path), rank, targets, tuple(per_layer))


def _fuse(
    modules: Sequence[str],
    parts: list[tuple[str, torch.Tensor, torch.Tensor]],
    local: dict[str, tuple[int, int]],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One A (the parts' A stacked) and one block-diagonal B over the group's whole output
    (rows of an untargeted module stay zero, so it gets an exact zero delta)."""
    offsets, out = {}, 0
    for module in modules:
        offsets[module] = out
        out += local[module][1]
    a = torch.cat([a for _, a, _ in parts]).to(dtype).contiguous()
    b = torch.zeros(out, a.shape[0], dtype=torch.float32)
    col = 0
    for module, part_a, part_b in parts:
        rows = offsets[module]
        b[rows : rows + part_b.shape[0], col : col + part_a.shape[0]] = part_b
        col += part_a.shape[0]
    return a, b.to(dtype).contiguous()


@dataclass
class LoRABatch:
    """One step's rows grouped by adapter: ``groups[k] = (rows, slot)`` in adapter-id order,
    ``slot[layer][group] = (A, B)`` prepared for the backend's linear.

    ``add_delta`` gathers every adapter row once (``order``: the groups' rows back to back),
    runs each group's two linears on its own contiguous slice of that gather, and adds all the
    deltas back in one ``index_add_``: one gather and one scatter per call rather than one of
    each per adapter. Each group's linears see exactly the rows they saw one group at a time,
    and every row is added to once, so a row's bits are unchanged."""

    groups: list[tuple[torch.Tensor, list[dict]]]
    order: torch.Tensor = None
    """Every group's rows back to back (built from ``groups`` when not given)."""
    starts: tuple[int, ...] = ()
    """Where each group's rows begin in ``order``, and its end."""

    def __post_init__(self):
        if self.order is None:
            self.order = torch.cat([rows for rows, _ in self.groups])
        if not self.starts:
            ends = [0]
            for rows, _ in self.groups:
                ends.append(ends[-1] + rows.shape[0])
            self.starts = tuple(ends)
        self._subsets: dict[tuple[int, ...], torch.Tensor] = {}

    def add_delta(self, linear, x: torch.Tensor, out: torch.Tensor, layer: int, group: str) -> None:
        """``out[rows] += linear(linear(x[rows], A), B)`` for each adapter targeting ``group``."""
        present = [
            (k, pair)
            for k, (_, slot) in enumerate(self.groups)
            if (pair := slot[layer].get(group)) is not None
        ]
        if not present:
            return
        gathered = x.index_select(0, self.order)
        starts = self.starts
        deltas = [
            linear(linear(gathered[starts[k] : starts[k + 1]], a), b) for k, (a, b) in present
        ]
        if len(present) == len(self.groups):
            rows = self.order
        else:
            key = tuple(k for k, _ in present)
            rows = self._subsets.get(key)
            if rows is None:
                rows = self._subsets[key] = torch.cat([self.groups[k][0] for k in key])
        out.index_add_(0, rows, deltas[0] if len(deltas) == 1 else torch.cat(deltas))


class LoRAManager:
    """Every adapter a replica knows (host memory) and the ``max_loras`` device slots."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        prepare_weight,
        *,
        max_loras: int,
        max_lora_rank: int,
        shard=None,
        load_seconds: Callable[[AdapterWeights], float] | None = None,
    ):
        """``spec`` is the full model's; ``shard`` this rank's plan under TP, or None.
        ``load_seconds``: what filling a slot with an adapter costs, when the clock does not
        say (the simulated engine's device); None measures the copy."""
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.prepare_weight = prepare_weight
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.shard = shard
        self.load_seconds = load_seconds
        self.newly_loaded: list[AdapterWeights] = []
        """The adapters the last ``slots_for`` put into a slot."""
        self._adapters: dict[int, AdapterWeights] = {}
        self._ids: dict[str, int] = {}
        self._paths: dict[str, str] = {}
        """Every name ever added and its folder: a name always means one adapter, so KV
        cached under it (its block-hash namespace) never meets another adapter's weights."""
        self._next_id = 1
        self._slots: OrderedDict[int, list[dict]] = OrderedDict()
        self.num_slot_loads = 0
        self.load_s_mean = 0.0
        """Seconds to fill a slot, averaged over recent loads (an EMA); 0 before the first."""

    def add(self, name: str, path: str) -> int:
        """Reads and registers adapter ``name`` from ``path``; its id. Adding a known name with
        the same path again is a no-op."""
        known = self._paths.get(name)
        if known is not None and known != str(path):
            raise ValueError(
                f"LoRA adapter name {name!r} was loaded from {known}; a different adapter "
                f"({path}) needs a new name"
            )
        if name in self._ids:
            return self._ids[name]
        weights = read_adapter(
            name, path, self.spec, self.dtype, max_rank=self.max_lora_rank, shard=self.shard
        )
        lora_id = self._ids[name] = self._next_id
        self._next_id += 1
        self._adapters[lora_id] = weights
        self._paths[name] = str(path)
        return lora_id

    def remove(self, name: str) -> None:
        """Forgets adapter ``name`` (its host and device copies); the caller checks that no
        request uses it."""
        lora_id = self._ids.pop(name)
        self._adapters.pop(lora_id)
        self._slots.pop(lora_id, None)

    def id_of(self, name: str) -> int | None:
        return self._ids.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._ids)

    @property
    def loaded_names(self) -> list[str]:
        """Adapters in a device slot now, least recently used first."""
        return [self._adapters[i].name for i in self._slots]

    def adapter(self, name: str) -> AdapterWeights:
        return self._adapters[self._ids[name]]

    def batch(self, seq_ids: Sequence[int], counts: Sequence[int]) -> LoRABatch | None:
        """The step's ``LoRABatch``: sequence ``k`` runs adapter ``seq_ids[k]`` (0: the base
        model) over its ``counts[k]`` consecutive rows; None when no row has an adapter."""
        rows: dict[int, list[int]] = {}
        start = 0
        for lora_id, count in zip(seq_ids, counts, strict=True):
            if lora_id:
                rows.setdefault(lora_id, []).extend(range(start, start + count))
            start += count
        if not rows:
            return None
        slots = self.slots_for(rows)
        return LoRABatch(
            [
                (torch.tensor(rows[i], dtype=torch.long, device=self.device), slots[i])
                for i in sorted(rows)
            ]
        )

    def slots_for(self, lora_ids: Iterable[int]) -> dict[int, list[dict]]:
        """Device weights of each adapter in ``lora_ids``, loading the missing ones into slots
        (least recently used others make room). More distinct ids than slots is a bug of the
        caller (``ValueError``)."""
        wanted = list(dict.fromkeys(lora_ids))
        self.newly_loaded = []
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step; max_loras={self.max_loras}")
        for lora_id in wanted:
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            while len(self._slots) >= self.max_loras:
                victim = next(i for i in self._slots if i not in wanted)
                del self._slots[victim]
            t0 = time.perf_counter()
            weights = self._adapters[lora_id]
            self._slots[lora_id] = self._to_device(weights)
            self.newly_loaded.append(weights)
            took_s = (
                time.perf_counter() - t0
                if self.load_seconds is None
                else self.load_seconds(weights)
            )
            self.load_s_mean = (
                took_s if not self.num_slot_loads else (0.8 * self.load_s_mean + 0.2 * took_s)
            )
            self.num_slot_loads += 1
        return {i: self._slots[i] for i in wanted}

    def _to_device(self, weights: AdapterWeights) -> list[dict]:
        return [
            {
                group: (
                    self.prepare_weight(a.to(self.device)),
                    self.prepare_weight(b.to(self.device)),
                )
                for group, (a, b) in layer.items()
            }
            for layer in weights.layers
        ]


def make_manager(
    config,
    spec: ModelSpec,
    device: torch.device,
    prepare_weight,
    *,
    shard=None,
    load_seconds: Callable[[AdapterWeights], float] | None = None,
) -> LoRAManager | None:
    """The engine's ``LoRAManager`` for ``config`` (an ``EngineConfig``) with its
    ``lora_modules`` registered in their given order, so every rank numbers them alike; None
    without ``enable_lora``. ``spec`` is the full model's shape."""
    if not config.enable_lora:
        return None
    manager = LoRAManager(
        spec,
        config.torch_dtype,
        device,
        prepare_weight,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        shard=shard,
        load_seconds=load_seconds,
    )
    for name, path in config.lora_modules:
        manager.add(name, path)
    log.info(
        "LoRA: %d adapter(s) registered (%s), %d device slots, rank <= %d",
        len(config.lora_modules),
        ", ".join(name for name, _ in config.lora_modules) or "none yet",
        config.max_loras,
        config.max_lora_rank,
    )
    return manager
