"""Our serving-time decoder for the Llama family, Mistral, Qwen2/2.5 and Qwen3.

The four differ only in flags: Qwen2 adds a bias to the fused QKV projection, Qwen3 adds an
RMSNorm over each query/key head ("QK norm"), Llama 3 may scale rotary frequencies. The model
runs on a flat batch of tokens (no padding, no batch dimension) and reads and writes the
paged KV cache through ``kernels``; transformers' modules are never used at serving time.

Every kernel call goes through ``self.ops`` (``kernels/ops.py``): the torch CPU path or the
Triton kernels, each batch-invariant in deterministic mode.

Tensor parallelism: given one rank's shard (``worker/parallel/sharding.py``: its spec counts
only its heads and rows) and a communicator, the same forward pass all-reduces the partial
sums of ``o_proj`` and ``down_proj``, looks tokens up in its vocabulary rows only (a masked
lookup, then an all-reduce) and all-gathers the LM head's vocabulary shards into full logits.
With the single-rank communicator those calls are the identity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata
from kernels.ops import KernelBackend
from kernels.rotary import build_cos_sin_cache
from worker.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec
from worker.parallel.communicator import SINGLE_RANK, Communicator

if TYPE_CHECKING:
    from worker.lora import LoRABatch

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelSpec"]


class CausalLM:
    """Weights plus a forward pass over the paged cache. Not an nn.Module: nothing trains."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        ops: KernelBackend,
        max_positions: int,
        comm: Communicator = SINGLE_RANK,
        vocab_start: int = 0,
    ):
        """``spec`` is the shape this rank computes; ``vocab_start`` its first vocabulary row."""
        self.spec = spec
        self.ops = ops
        self.comm = comm
        self.vocab_start = vocab_start
        emb = weights["model.embed_tokens.weight"]
        self.cos_sin = build_cos_sin_cache(
            spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling, emb.dtype
        ).to(emb.device)
        self.scale = spec.head_dim**-0.5
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = ops.prepare_weight(
            self.embed if spec.tie_word_embeddings else weights["lm_head.weight"]
        )
        self.final_norm = weights["model.norm.weight"]
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]

    @staticmethod
    def _cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
        return None if any(t is None for t in ts) else torch.cat(ts).contiguous()

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        return {
            "input_norm": w[p + "input_layernorm.weight"],
            "post_norm": w[p + "post_attention_layernorm.weight"],
            "qkv": self.ops.prepare_weight(
                self._cat(w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"])
            ),
            "qkv_bias": self._cat(
                w.get(a + "q_proj.bias"), w.get(a + "k_proj.bias"), w.get(a + "v_proj.bias")
            ),
            "o": self.ops.prepare_weight(w[a + "o_proj.weight"]),
            "q_norm": w.get(a + "q_norm.weight"),
            "k_norm": w.get(a + "k_norm.weight"),
            "gate_up": self.ops.prepare_weight(
                self._cat(w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"])
            ),
            "down": self.ops.prepare_weight(w[p + "mlp.down_proj.weight"]),
        }

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(input_ids, self.embed)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.embed.shape[0])
        x = F.embedding(local_ids.masked_fill(outside, 0), self.embed)
        x.masked_fill_(outside.unsqueeze(1), 0.0)
        return self.comm.all_reduce(x)  # exactly one rank holds each row: x + 0 is exact

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Runs the flat batch; returns float32 logits for the rows in ``logits_indices``.
        ``lora``: the step's rows grouped by adapter (``worker/lora.py``), whose deltas are
        added to the projections' outputs (before a row-parallel layer's all-reduce)."""
        s, ops = self.spec, self.ops
        n = input_ids.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        x = self._embed(input_ids)
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h, residual = ops.rms_norm(x, layer["input_norm"], s.rms_norm_eps, residual)
            qkv = ops.linear(h, layer["qkv"], layer["qkv_bias"])
            if lora is not None:
                lora.add_delta(ops.linear, h, qkv, i, "qkv")
            q = qkv[:, :q_size].view(n, s.num_heads, s.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(n, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size :].view(n, s.num_kv_heads, s.head_dim)
            if s.qk_norm:
                q = ops.rms_norm(q.reshape(-1, s.head_dim), layer["q_norm"], s.rms_norm_eps)[
                    0
                ].view(n, s.num_heads, s.head_dim)
                k = ops.rms_norm(k.reshape(-1, s.head_dim), layer["k_norm"], s.rms_norm_eps)[
                    0
                ].view(n, s.num_kv_heads, s.head_dim)
            q, k = ops.rotary(q, k, positions, self.cos_sin)
            ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = ops.attention(q, k_cache, v_cache, meta, self.scale)
            attn = attn.reshape(n, q_size)
            x = ops.linear(attn, layer["o"])
            if lora is not None:
                lora.add_delta(ops.linear, attn, x, i, "o")
            x = self.comm.all_reduce(x)
            h, residual = ops.rms_norm(x, layer["post_norm"], s.rms_norm_eps, residual)
            gate_up = ops.linear(h, layer["gate_up"])
            if lora is not None:
                lora.add_delta(ops.linear, h, gate_up, i, "gate_up")
            inter = gate_up.shape[1] // 2
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            x = ops.linear(act, layer["down"])
            if lora is not None:
                lora.add_delta(ops.linear, act, x, i, "down")
            x = self.comm.all_reduce(x)
        h, _ = ops.rms_norm(x, self.final_norm, s.rms_norm_eps, residual)
        return self.comm.all_gather(ops.linear(h[logits_indices], self.lm_head)).float()
