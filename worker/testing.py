"""Tiny random-weight models for fast tests: real configs, real tokenizer, random weights.

``make_tiny_model(folder, arch)`` writes a Hugging Face folder (config.json, safetensors,
tokenizer files copied from the bundled SmolLM2) that both transformers and our engine load,
so tests compare the two on the same weights in well under a second per model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from worker.loader import resolve_model
from worker.lora import TARGET_MODULES, module_shapes

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def make_tiny_model(
    folder: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    rope_scaling: dict | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    vocab_size: int = 49152,
) -> str:
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok_src = Path(resolve_model("smollm2").path)
    for f in tok_src.iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            shutil.copy(f, folder / f.name)
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=64 // num_heads * 2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=arch != "mistral",
        bos_token_id=1,
        eos_token_id=2,
    )
    if rope_scaling:
        kwargs["rope_scaling"] = rope_scaling
    if arch == "mistral":
        kwargs["sliding_window"] = None
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(str(folder))
    return str(folder)


def make_tiny_adapter(
    model_folder: str | Path,
    folder: str | Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = TARGET_MODULES,
    seed: int = 0,
    use_rslora: bool = False,
) -> str:
    """A random LoRA adapter for the model in ``model_folder``, saved by ``peft`` as a PEFT
    folder (``adapter_config.json`` + ``adapter_model.safetensors``). B is random too (PEFT
    starts it at zero), so the adapter changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora
    )
    model = get_peft_model(base, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(folder))
    return str(folder)


def write_random_adapter(
    model_folder: str | Path,
    folder: str | Path,
    *,
    rank: int = 16,
    alpha: int = 32,
    targets: tuple[str, ...] = TARGET_MODULES,
    seed: int = 0,
    std: float = 0.02,
) -> str:
    """A random LoRA adapter in PEFT's file format for the model in ``model_folder``, written
    without ``peft`` (for machines that lack it, such as a GPU check's): the
    ``adapter_config.json`` and ``adapter_model.safetensors`` PEFT saves, normal(0, ``std``)
    A and B."""
    import json

    from safetensors.torch import save_file

    from worker.models.llama import ModelSpec

    spec = ModelSpec.from_hf_config(json.loads((Path(model_folder) / "config.json").read_text()))
    shapes = module_shapes(spec)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            kind = (
                "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": str(model_folder),
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return str(folder)
