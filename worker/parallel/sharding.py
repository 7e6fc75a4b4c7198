"""Which slice of each weight a tensor-parallel rank holds, and loading only that slice.

Megatron-style layout, the one vLLM uses:

- column-parallel (output dimension split): ``q_proj`` by query heads, ``k_proj``/``v_proj``
  by KV heads, ``gate_proj``/``up_proj`` by intermediate rows. The model fuses each rank's
  q/k/v (and gate/up) shards as it fuses whole weights, so the fused layout stays
  ``[q | k | v]`` per rank.
- row-parallel (input dimension split): ``o_proj`` by the query heads its rank computed,
  ``down_proj`` by the intermediate rows; each rank's output is a partial sum that the model
  all-reduces.
- vocab-parallel: ``embed_tokens`` and ``lm_head`` by vocabulary rows; the embedding is a
  masked lookup plus an all-reduce, the LM head's logits are all-gathered.
- everything else (norms, QK-norm weights) is replicated.

When a model has fewer KV heads than ranks, each rank holds one KV head, the one its query
heads read (KV heads are replicated, ``world_size // num_kv_heads`` copies of each).

Sizes that do not divide are ``ValueError``s naming the size (``num_heads``, ``num_kv_heads``,
``vocab_size``, ``intermediate_size``). ``load_shard`` reads only the rank's slices from the
safetensors files (``safe_open(...).get_slice``), so a worker never holds the whole model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.models.llama import ModelSpec


@dataclass(frozen=True)
class ShardPlan:
    """One rank's share of a model: where its heads, rows and vocabulary start, and how many."""

    rank: int
    world_size: int
    num_heads: int
    """Query heads on this rank."""
    head_start: int
    num_kv_heads: int
    """KV heads on this rank (1 when they are replicated)."""
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_size: int
    vocab_start: int

    @classmethod
    def make(cls, spec: ModelSpec, rank: int, world_size: int) -> ShardPlan:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")

        def divides(size: int, name: str) -> int:
            if size % world_size:
                raise ValueError(f"tensor_parallel_size={world_size} does not divide {name}={size}")
            return size // world_size

        num_heads = divides(spec.num_heads, "num_heads")
        if spec.num_kv_heads >= world_size:
            num_kv_heads = divides(spec.num_kv_heads, "num_kv_heads")
            kv_head_start = rank * num_kv_heads
        else:  # fewer KV heads than ranks: each rank holds the one KV head its query heads read
            if world_size % spec.num_kv_heads:
                raise ValueError(
                    f"num_kv_heads={spec.num_kv_heads} does not divide "
                    f"tensor_parallel_size={world_size} "
                    "(KV heads are replicated when there are fewer than ranks)"
                )
            num_kv_heads = 1
            kv_head_start = rank * spec.num_kv_heads // world_size
        inter = divides(spec.intermediate_size, "intermediate_size")
        vocab = divides(spec.vocab_size, "vocab_size")
        return cls(
            rank,
            world_size,
            num_heads,
            rank * num_heads,
            num_kv_heads,
            kv_head_start,
            inter,
            rank * inter,
            vocab,
            rank * vocab,
        )

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The shape this rank computes: its heads, its intermediate rows, its vocabulary rows."""
        return dataclasses.replace(
            spec,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
        )

    def slice_of(self, name: str, head_dim: int) -> tuple[int, int, int] | None:
        """(dimension, start, stop) of ``name`` this rank holds, or None for replicated."""
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.vocab_start, self.vocab_start + self.vocab_size
        q = (self.head_start * head_dim, (self.head_start + self.num_heads) * head_dim)
        kv = (self.kv_head_start * head_dim, (self.kv_head_start + self.num_kv_heads) * head_dim)
        inter = (self.intermediate_start, self.intermediate_start + self.intermediate_size)
        rules = {
            "self_attn.q_proj": (0, *q),
            "self_attn.k_proj": (0, *kv),
            "self_attn.v_proj": (0, *kv),
            "self_attn.o_proj": (1, *q),
            "mlp.gate_proj": (0, *inter),
            "mlp.up_proj": (0, *inter),
            "mlp.down_proj": (1, *inter),
        }
        module, _, kind = name.rpartition(".")
        for suffix, (dim, start, stop) in rules.items():
            if module.endswith(suffix):
                if kind == "bias" and dim == 1:  # a row-parallel bias is added once, after the sum
                    return None
                return dim, start, stop
        return None


def read_spec(folder: str) -> ModelSpec:
    return ModelSpec.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))


def load_shard(
    folder: str, dtype: torch.dtype, rank: int, world_size: int
) -> tuple[ModelSpec, ShardPlan, dict[str, torch.Tensor]]:
    """The full model's spec, this rank's plan, and its weights (only its slices are read)."""
    from safetensors import safe_open

    spec = read_spec(folder)
    plan = ShardPlan.make(spec, rank, world_size)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                where = plan.slice_of(name, spec.head_dim)
                if where is None:
                    tensor = handle.get_tensor(name)
                elif where[0] == 0:
                    tensor = handle.get_slice(name)[where[1] : where[2]]
                else:
                    tensor = handle.get_slice(name)[:, where[1] : where[2]]
                weights[name] = tensor.to(dtype).contiguous()
    return spec, plan, weights
