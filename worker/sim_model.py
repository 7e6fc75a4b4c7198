"""The simulated engine's timing model: how long a forward pass of a scheduled batch takes.

``EngineConfig.engine = "sim"`` keeps the whole engine (scheduler, block pool, prefix cache,
host tier, KV events, stats, preemption, KV export and import) and replaces the forward pass
with a wait of the time this model predicts (``worker/sim_runner.py``). A profile prices:

- prefill: ``prefill_tokens_per_s`` for every token computed for a prompt;
- decode: ``decode_step_base_s`` per step that decodes anything, plus
  ``decode_step_per_seq_s`` per decoding sequence and ``decode_step_per_context_token_s`` per
  token of their contexts (the KV the step's attention reads);
- the KV cache: ``kv_bytes_per_token`` of the simulated model (for ``kv_cache_bytes`` and the
  host tier's byte budget), ``kv_capacity_tokens`` when no KV knob is set,
  ``host_to_device_bytes_per_s`` for blocks brought back from the host tier, and
  ``kv_transfer_bytes_per_s`` for a prefix pulled from a peer replica (the network between
  replicas; ``transfer_seconds``, waited out by the pulling replica: ``cluster/kv_pull.py``).

Profiles are the presets in ``worker/sim_profiles.json`` (``cpu``: measured on a 2-core VM;
``gpu``: an 8B model on an H100 from first principles; each says its source) or a JSON file of
one profile's fields. A missing or malformed field is a ``ValueError`` naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

PRESETS_PATH = Path(__file__).resolve().parent / "sim_profiles.json"


@dataclass(frozen=True)
class SimProfile:
    """What the simulated engine's forward pass costs; see the module docstring."""

    name: str
    description: str
    source: str
    prefill_tokens_per_s: float
    decode_step_base_s: float
    decode_step_per_seq_s: float
    decode_step_per_context_token_s: float
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    host_to_device_bytes_per_s: float
    kv_transfer_bytes_per_s: float

    def __post_init__(self) -> None:
        for name in (
            "prefill_tokens_per_s",
            "kv_bytes_per_token",
            "kv_capacity_tokens",
            "host_to_device_bytes_per_s",
            "kv_transfer_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"sim profile {self.name!r}: {name} must be positive")
        for name in (
            "decode_step_base_s",
            "decode_step_per_seq_s",
            "decode_step_per_context_token_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"sim profile {self.name!r}: {name} must be >= 0")

    def step_seconds(
        self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int
    ) -> float:
        """Seconds of one forward pass: ``prefill_tokens`` prompt tokens computed, and
        ``decode_seqs`` sequences decoding one token each over ``decode_context_tokens`` tokens
        of context in all."""
        seconds = prefill_tokens / self.prefill_tokens_per_s
        if decode_seqs:
            seconds += (
                self.decode_step_base_s
                + self.decode_step_per_seq_s * decode_seqs
                + self.decode_step_per_context_token_s * decode_context_tokens
            )
        return seconds

    def transfer_seconds(self, num_tokens: int) -> float:
        """Seconds the KV of ``num_tokens`` tokens takes from a peer replica to this one."""
        return num_tokens * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s

    def decode_tokens_per_s(self, batch: int, context_tokens: int) -> float:
        """Tokens per second offered by decode steps of ``batch`` sequences of
        ``context_tokens`` each: what a profile promises a server."""
        return batch / self.step_seconds(0, batch, batch * context_tokens)


def preset_names() -> list[str]:
    return sorted(json.loads(PRESETS_PATH.read_text()))


def load_profile(name_or_path: str) -> SimProfile:
    """A preset by name, or the profile in a JSON file (one object of ``SimProfile``'s
    fields, ``name`` optional)."""
    presets = json.loads(PRESETS_PATH.read_text())
    if name_or_path in presets:
        raw, name = presets[name_or_path], name_or_path
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(
                f"sim_profile: {name_or_path!r} is neither a preset ({', '.join(sorted(presets))})"
                " nor a JSON file"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"sim_profile: {path} is not valid JSON: {exc}") from None
        name = raw.get("name", path.stem)
    wanted = {f.name for f in fields(SimProfile)} - {"name"}
    missing = sorted(wanted - raw.keys())
    if missing:
        raise ValueError(f"sim profile {name!r}: missing field(s) {', '.join(missing)}")
    unknown = sorted(raw.keys() - wanted - {"name"})
    if unknown:
        raise ValueError(f"sim profile {name!r}: unknown field(s) {', '.join(unknown)}")
    return SimProfile(name=name, **{k: raw[k] for k in wanted})
