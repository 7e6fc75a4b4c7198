"""The value types every prefix index shares: ``Match``, ``IndexUnavailableError``, ``ReplicaId``
and ``Clock``.

``router/index.py`` (the ``PrefixIndex`` protocol, ``FallbackIndex``, ``make_index``) imports
the backends (``embedded_index``, ``redis_index``) lazily, and the backends take these types
from here, never from ``router/index.py``, so no import cycle runs through the package.
Everything else imports them from here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ReplicaId = str
Clock = Callable[[], float]


class IndexUnavailableError(RuntimeError):
    """The index's store cannot be reached right now; route by load alone. ``timed_out``: it
    did not answer within its timeout (it may only be busy), as against refusing or failing."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Match:
    """How much of a request's prefix one replica can serve without prefill."""

    device_blocks: int
    """Leading consecutive blocks held on the device tier (speculative entries included)."""
    host_blocks: int = 0
    """Further leading blocks held right after the device ones, at least one of them only
    on the host tier (each priced as a host-to-device copy); 0 without a host tier."""

    @property
    def num_blocks(self) -> int:
        return self.device_blocks + self.host_blocks
