"""Engine cost rates for the routing simulator: the one place they live, and how they are recorded.

The simulator prices a request's prefill by its uncached prompt tokens and its decode by a
per-step time that grows with the running batch. Those rates come from ``EngineRates``:

- ``DEFAULT_RATES`` below are *labelled placeholders* for SmolLM2-135M on a 2-core CPU (prefill
  about 1500 tokens/s, one decode step about 25 ms at batch 1). They are not measurements of
  this project's engine; every result file records which rates it used and where they came from.
- ``record_rates`` writes measured rates to ``bench/results/calibration.json``; ``load_rates``
  prefers that file when it exists. ``rates_from_samples`` fits the decode-step line from
  (batch size, step seconds) samples so a calibration run only has to time a few steps.

``PullRates`` (``kv_pull`` in the same file) prices a KV pull from a peer replica; its source
says whether it is measured or an estimate.

Failure modes: a malformed calibration file raises ``ValueError`` naming the field, rather than
silently falling back to the defaults (a benchmark that quietly changes its cost model is worse
than one that stops).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.result_files import machine_name

CALIBRATION_PATH = Path(__file__).resolve().parents[1] / "results" / "calibration.json"


@dataclass(frozen=True)
class EngineRates:
    """Cost model of one replica's engine."""

    prefill_tokens_per_s: float
    decode_step_base_s: float
    """Time of one decode step at batch size 1."""
    decode_step_per_seq_s: float
    """Extra time per additional running sequence in a decode step."""
    max_num_batched_tokens: int
    """Prefill chunk size: each chunk shares its step with one decode of every running request."""
    host_to_device_tokens_per_s: float
    """Rate of bringing host-tier KV back to the device (only used with a host tier)."""
    source: str

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "host_to_device_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EngineRates.{name} must be positive")
        if not self.decode_step_base_s > 0:
            raise ValueError("EngineRates.decode_step_base_s must be positive")
        if self.decode_step_per_seq_s < 0:
            raise ValueError("EngineRates.decode_step_per_seq_s must be >= 0")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("EngineRates.max_num_batched_tokens must be positive")

    def decode_step_s(self, num_running: int) -> float:
        """Seconds of one engine step that decodes ``num_running`` sequences."""
        return self.decode_step_base_s + self.decode_step_per_seq_s * max(num_running - 1, 0)


# PLACEHOLDER rates (not measured here): SmolLM2-135M, float32, torch on a 2-core CPU.
# prefill ~1500 tok/s and a ~25 ms decode step at batch 1 growing ~3 ms per extra sequence are
# typical for a 135M model on two cores; the chunk of 512 matches EngineConfig's default
# max_num_batched_tokens; host->device is a memcpy in RAM, so ~20x faster than recomputing.
DEFAULT_RATES = EngineRates(
    prefill_tokens_per_s=1500.0,
    decode_step_base_s=0.025,
    decode_step_per_seq_s=0.003,
    max_num_batched_tokens=512,
    host_to_device_tokens_per_s=30000.0,
    source="default placeholder for SmolLM2-135M on a 2-core CPU (not measured)",
)


def rates_from_samples(
    prefill_tokens_per_s: float,
    decode_samples: Sequence[tuple[int, float]],
    *,
    max_num_batched_tokens: int = DEFAULT_RATES.max_num_batched_tokens,
    host_to_device_tokens_per_s: float = DEFAULT_RATES.host_to_device_tokens_per_s,
    source: str = "measured",
) -> EngineRates:
    """Fit ``step_s = base + per_seq * (batch - 1)`` by least squares to (batch, step_s) samples."""
    if not decode_samples:
        raise ValueError("decode_samples must hold at least one (batch, step_s) pair")
    xs = [float(b - 1) for b, _ in decode_samples]
    ys = [float(s) for _, s in decode_samples]
    if any(b < 1 for b, _ in decode_samples) or any(s <= 0 for s in ys):
        raise ValueError("decode_samples: batch must be >= 1 and step_s positive")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    slope = (
        0.0
        if var_x == 0
        else sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var_x
    )
    slope = max(slope, 0.0)
    base = max(mean_y - slope * mean_x, 1e-6)
    return EngineRates(
        prefill_tokens_per_s=prefill_tokens_per_s,
        decode_step_base_s=base,
        decode_step_per_seq_s=slope,
        max_num_batched_tokens=max_num_batched_tokens,
        host_to_device_tokens_per_s=host_to_device_tokens_per_s,
        source=source,
    )


def record_rates(rates: EngineRates, path: Path = CALIBRATION_PATH, *, note: str = "") -> Path:
    """Write ``rates`` with the machine and date they were measured on."""
    payload = {
        "rates": dataclasses.asdict(rates),
        "machine": machine_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": note,
    }
    if path.exists():  # keep the pull rate, which another benchmark measures
        try:
            kv_pull = json.loads(path.read_text()).get("kv_pull")
        except (AttributeError, json.JSONDecodeError):
            kv_pull = None
        if kv_pull is not None:
            payload["kv_pull"] = kv_pull
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class PullRates:
    """Cost of pulling KV blocks from a peer replica: ``tokens * kv_bytes_per_token /
    pull_bytes_per_s`` seconds (``calibration.json``'s ``kv_pull`` section)."""

    kv_bytes_per_token: float
    pull_bytes_per_s: float
    source: str

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "pull_bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"PullRates.{name} must be positive, got {value!r}")

    @property
    def pull_tokens_per_s(self) -> float:
        return self.pull_bytes_per_s / self.kv_bytes_per_token

    def pull_s(self, num_tokens: int) -> float:
        """Seconds to pull ``num_tokens`` tokens of KV from a peer."""
        return num_tokens * self.kv_bytes_per_token / self.pull_bytes_per_s


def load_pull_rates(path: Path = CALIBRATION_PATH) -> PullRates | None:
    """The ``kv_pull`` section of ``path``; None when the file or the section is absent."""
    if not path.exists():
        return None
    try:
        section = json.loads(path.read_text()).get("kv_pull")
        return None if section is None else PullRates(**section)
    except (AttributeError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration file {path}: malformed 'kv_pull' ({exc})") from None


def load_rates(path: Path = CALIBRATION_PATH) -> EngineRates:
    """Measured rates from ``path`` when it exists, else ``DEFAULT_RATES``."""
    if not path.exists():
        return DEFAULT_RATES
    try:
        fields = json.loads(path.read_text())["rates"]
        return EngineRates(**fields)
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration file {path}: malformed 'rates' ({exc})") from None
