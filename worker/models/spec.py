"""``ModelSpec``: the shape of a supported model, read from its ``config.json``.

Apart from the model's code (``worker/models/llama.py``) so that resolving a model and
checking its limits needs no torch (a server's HTTP ingress does both).
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a supported model, read from its ``config.json``."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelSpec:
        archs = cfg.get("architectures") or []
        family = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if family is None:
            family = {
                "llama": "llama",
                "mistral": "mistral",
                "qwen2": "qwen2",
                "qwen3": "qwen3",
            }.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        num_heads = cfg["num_attention_heads"]
        window = (
            cfg.get("sliding_window")
            if cfg.get("use_sliding_window", family == "mistral")
            else None
        )
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=window,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, in elements (multiply by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
