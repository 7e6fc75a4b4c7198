"""Sampling defaults from the model's ``generation_config.json`` (``--generation-config``).

As in vLLM: with ``auto`` (the default) the model's ``generation_config.json`` supplies the
value of a sampling field a request leaves unset (absent or null); the request's own value
always wins, and a field neither sets gets ``SamplingParams``' default. ``vllm`` ignores the
file; a folder reads that folder's ``generation_config.json`` instead of the model's.

Fields read: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (as ``max_tokens``). ``do_sample`` is not read (vLLM does not either): a
model whose file says ``temperature: 0.6`` samples at 0.6 unless the request says otherwise.
A missing file means no defaults; a file that is not JSON, or a value out of range, is a
``ValueError`` naming the file and the field. What applies is logged once at start-up.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch import for the ingress's protocol module, which uses apply_defaults
    from worker.config import EngineConfig

log = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
FIELD_MAP = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> SamplingParams field."""


def read_generation_defaults(folder: str | Path) -> dict[str, float | int]:
    """The SamplingParams defaults a folder's generation_config.json sets ({} without one)."""
    path = Path(folder) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(
            f"EngineConfig.generation_config: {path} is not valid JSON ({exc})"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"EngineConfig.generation_config: {path} must hold a JSON object")
    defaults: dict[str, float | int] = {}
    for key, field in FIELD_MAP.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"EngineConfig.generation_config: {path}: {key} must be a number, got {value!r}"
            )
        defaults[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    _check_ranges(defaults, path)
    return defaults


def _check_ranges(defaults: dict[str, float | int], path: Path) -> None:
    """The same checks SamplingParams makes, so a bad file fails at start-up, not per request."""
    from worker.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"EngineConfig.generation_config: {path}: {exc}") from None


def load_generation_defaults(config: EngineConfig, model_path: str) -> dict[str, float | int]:
    """The defaults ``config.generation_config`` asks for; ``model_path`` is the resolved model."""
    source = config.generation_config
    if source == "vllm":
        log.info("generation config: 'vllm', the model's generation_config.json is ignored")
        return {}
    if source == "auto":
        folder = Path(model_path)
    else:
        folder = Path(source)
        if not (folder / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(
                f"EngineConfig.generation_config: {source!r} must be 'auto', 'vllm' or a "
                "folder holding "
                f"{GENERATION_CONFIG_FILE}"
            )
    defaults = read_generation_defaults(folder)
    if defaults:
        log.info(
            "generation config %s: defaults for fields a request leaves unset: %s",
            folder / GENERATION_CONFIG_FILE,
            ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())),
        )
    return defaults


def apply_defaults(
    requested: dict[str, float | int | None], defaults: dict[str, float | int]
) -> dict[str, float | int]:
    """Request value if set, else the model's default; fields neither sets are left out."""
    merged = {k: v for k, v in defaults.items() if k in requested}
    merged.update({k: v for k, v in requested.items() if v is not None})
    return merged
