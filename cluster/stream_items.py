"""What an engine replica's stream carries to the ingress, and what the ingress makes of it.

``EngineReplica.generate`` streams ``worker.outputs.OutputDelta``s, numbered (``seq``) and
stamped with the replica's id, or, when the engine refuses the request, one ``Rejected``
instead: a typed refusal the ingress maps to its status code (``api_error``) without
unpickling engine exceptions or comparing message strings. ``check_item`` is the one place
the ingress turns a stream item into the ``APIError`` it stands for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cluster import errors
from cluster.errors import APIError
from worker.outputs import OutputDelta


class RejectKind(str, enum.Enum):
    INVALID = "invalid"
    """Bad input the engine found (prompt too long, token id out of range): 400."""
    OVERLOADED = "overloaded"
    """The engine's waiting queue is full: 429."""
    DEAD = "dead"
    """The engine loop died: 503 (Serve replaces the replica; the ingress may fail over)."""
    INTERNAL = "internal"
    """Anything else: 500."""
    UNKNOWN_MODEL = "unknown_model"
    """The request's LoRA adapter is not served there (unloaded since the ingress looked):
    404 ``model_not_found``, the ``message`` naming the adapter."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """The replica's refusal of a request, streamed in place of its outputs."""

    kind: RejectKind
    message: str
    replica_id: str = ""

    def api_error(self) -> APIError:
        """The HTTP error the client gets for this refusal."""
        if self.kind is RejectKind.INVALID:
            return errors.from_value_error(ValueError(self.message))
        if self.kind is RejectKind.OVERLOADED:
            return errors.overloaded("engine queue full")
        if self.kind is RejectKind.DEAD:
            return errors.unavailable(f"replica unavailable: {self.message}")
        if self.kind is RejectKind.UNKNOWN_MODEL:
            return errors.model_not_found(self.message)
        return errors.internal(self.message)


StreamItem = OutputDelta | Rejected


def check_item(item: StreamItem) -> OutputDelta:
    """``item`` as an output; raises the ``APIError`` it stands for when it is a refusal or
    an output the engine failed."""
    if isinstance(item, Rejected):
        raise item.api_error()
    if item.error:
        raise errors.internal(f"the engine failed this request: {item.error}")
    return item


def prefill_time_s(item: OutputDelta) -> float | None:
    """Seconds from the request's first scheduling to its first token, from the engine
    timestamps a request's first output carries; None when either is unknown."""
    times = item.metrics or {}
    scheduled_s = times.get("first_scheduled_time")
    first_token_s = times.get("first_token_time")
    if scheduled_s is None or first_token_s is None:
        return None
    return max(0.0, first_token_s - scheduled_s)
