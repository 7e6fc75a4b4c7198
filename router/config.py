"""RouterConfig: every knob of the prefix index and the routing policy, validated once.

Owns the names and defaults of the router layer (docs/design.md, Configuration). Construction
fails with a ``ValueError`` naming the offending field; nothing downstream re-validates.
The dataclass is frozen and holds only plain values, so it pickles into Ray actors and
Serve's request-router kwargs unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlparse

POLICIES = ("prefix", "round_robin", "least_loaded", "pow2")
INDEX_BACKENDS = ("embedded", "redis")

# A modest single-GPU prefill rate for a small model; only used until a replica has measured
# its own rate, so being off by 2x merely delays good spill decisions by a few stats reports.
DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
# One decode step of a lightly loaded replica; a waiting request costs at least one step.
DEFAULT_DECODE_STEP_S = 0.02
# Host-to-device copies over PCIe run roughly an order of magnitude faster than prefill.
DEFAULT_HOST_TO_DEVICE_TOKENS_PER_S = 80000.0


def _check_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")


def _check_non_negative(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class RouterConfig:
    """How the router learns where prefixes live and how it picks a replica."""

    policy: str = "prefix"
    """One of ``prefix`` (predicted TTFT), ``round_robin``, ``least_loaded``, ``pow2``."""
    index_backend: str = "embedded"
    """``embedded`` (in-process, the default) or ``redis`` (needs ``redis_url``)."""
    redis_url: str | None = None
    block_size: int = 16
    """Tokens per hashed block; must equal the engines' ``--block-size``."""
    default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    default_decode_step_s: float = DEFAULT_DECODE_STEP_S
    default_host_to_device_tokens_per_s: float = DEFAULT_HOST_TO_DEVICE_TOKENS_PER_S
    speculative_ttl_s: float = 5.0
    """How long a routing decision counts as the chosen replica holding the request's blocks."""
    heartbeat_timeout_s: float = 10.0
    """A replica with no heartbeat for this long is dead: its entries stop counting at once."""
    redis_socket_timeout_s: float = 0.05
    """Connect and read timeout of each Redis call; a lookup slower than this routes by load."""
    redis_write_timeout_s: float = 1.0
    """Read timeout of event, heartbeat and sweep calls (a re-announce can be large)."""
    redis_retry_interval_s: float = 1.0
    """While Redis is unreachable, how often one call probes it again (others skip it)."""
    miss_cost_factor: float = 2.0
    """Weight of the prefill a miss causes, in the choice (not in the reported TTFT): 1 prices
    only the request's own wait; 2 also charges the delay that prefill adds for the requests
    queued behind it, so a prefix moves to another replica only when that pays for both."""
    max_load_ratio: float | None = 1.1
    """``prefix`` policy's load bound: a replica is a candidate only while the requests this
    router recently sent it stay within this multiple of the mean (+1); None turns it off."""
    load_window_per_replica: float = 64.0
    """How many recent decisions per replica the load bound counts (a decayed window)."""
    copy_pricing: bool = True
    """``prefix`` policy: charge a copy of a prefix another replica holds only its share of
    the prefix's recent requests (``router/prefix_policy.py``), so a popular prefix spreads
    when its holder queues; lower tail TTFT, fewer cached tokens. False: every miss pays its
    whole prefill and a prefix moves only when its holder's queue outweighs that."""
    tie_tolerance_s: float = 0.005
    """Predicted TTFTs this close count as a tie, settled by rendezvous hashing."""
    kv_pull_tokens_per_s: float | None = None
    """Rate at which a replica pulls a prefix's KV from a peer that holds it; the ``prefix``
    policy then prices a replica lacking a prefix a peer holds at the pull, not a prefill, and
    that replica performs the pull (``cluster/kv_pull.py``). None (the default): replicas do
    not pull, every miss is priced as a prefill. Setting it below the measured transfer rate
    makes copies dearer (each takes cache space that evicts other prefixes); the simulator uses
    1/40 of it (bench/sim/ours.py PULL_PRICE_FACTOR). Off by default: a served pull costs
    several times what the engine-side rate (``python -m bench.kv_pull``) predicts, by an
    amount that depends on the machine (``python -m bench.experiments.kv_pull_served``
    measures it; the figures are in bench/README.md), so no one rate fits as a default."""
    seed: int = 0
    """Seed of the ``pow2`` baseline's sampling, for reproducible comparisons."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.index_backend not in INDEX_BACKENDS:
            raise ValueError(
                f"index_backend must be one of {INDEX_BACKENDS}, got {self.index_backend!r}"
            )
        if self.index_backend == "redis" and not self.redis_url:
            raise ValueError("redis_url is required when index_backend is 'redis'")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                "redis_url must start with redis://, rediss:// or unix://, "
                f"got {redacted_url(self.redis_url)!r}"
            )
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool):
            raise ValueError(f"block_size must be an integer, got {self.block_size!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in (
            "default_prefill_tokens_per_s",
            "default_decode_step_s",
            "default_host_to_device_tokens_per_s",
            "speculative_ttl_s",
            "heartbeat_timeout_s",
            "redis_socket_timeout_s",
            "redis_write_timeout_s",
            "redis_retry_interval_s",
        ):
            _check_positive(name, getattr(self, name))
        _check_non_negative("tie_tolerance_s", self.tie_tolerance_s)
        if self.max_load_ratio is not None:
            _check_positive("max_load_ratio", self.max_load_ratio)
            if self.max_load_ratio < 1.0:
                raise ValueError(
                    f"max_load_ratio must be >= 1 or None, got {self.max_load_ratio!r}"
                )
        _check_positive("load_window_per_replica", self.load_window_per_replica)
        if not isinstance(self.copy_pricing, bool):
            raise ValueError(f"copy_pricing must be true or false, got {self.copy_pricing!r}")
        if self.kv_pull_tokens_per_s is not None:
            _check_positive("kv_pull_tokens_per_s", self.kv_pull_tokens_per_s)
        if (
            not isinstance(self.miss_cost_factor, (int, float))
            or not 1.0 <= self.miss_cost_factor <= 10.0
        ):
            raise ValueError(f"miss_cost_factor must be in [1, 10], got {self.miss_cost_factor!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


def redacted_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, fit for logs and errors."""
    parts = urlparse(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()
