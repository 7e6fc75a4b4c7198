"""Per-replica bookkeeping of KV event streams: epochs, sequence numbers, staleness.

Answers one question for every incoming ``KVEventBatch``: apply it, drop the replica's
entries first, or ignore it. The embedded index calls :func:`decide` directly; the Redis
index runs the same rules inside its Lua apply script (``redis_index._APPLY_LUA``), and the
shared contract tests hold both to them.

Rules (``state`` is what the index remembers of the replica, ``None`` if nothing):

* A batch of an older epoch is void (the engine that wrote it is gone): ignore it.
* A newer epoch, or a replica never seen, or a gap in ``seq``: the index may have missed
  removals, so every entry of the replica is dropped. The batch is still applied when it
  starts the stream cleanly: its first event is ``cleared`` (a re-announce), or it is
  ``seq == 0`` of a new stream (a fresh engine holds nothing it did not announce).
  Otherwise the replica is *stale*: its batches are ignored until it re-announces.
* ``seq == 0`` within a known epoch means the engine restarted without a new epoch (its
  counter starts at 0 again): old entries are dropped and the batch opens the new stream.
* Any other duplicate or reordered batch (``seq`` not above the last one) is ignored.

A replica learns that it must re-announce from :class:`ApplyOutcome.STALE`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from router.protocol import EventKind, KVEventBatch


class ApplyOutcome(str, enum.Enum):
    """What the index did with one batch; ``STALE`` asks the replica to re-announce."""

    APPLIED = "applied"
    IGNORED = "ignored"
    STALE = "stale"


class Action(enum.Enum):
    APPLY = "apply"
    DROP_THEN_APPLY = "drop_then_apply"
    DROP_THEN_STALE = "drop_then_stale"
    IGNORE = "ignore"
    STILL_STALE = "still_stale"


@dataclass(frozen=True)
class StreamState:
    """What the index remembers of one replica's event stream."""

    epoch: int
    last_seq: int | None
    """``None`` until a batch of this epoch was seen (e.g., after a heartbeat announced it)."""
    stale: bool = False


def starts_clean(batch: KVEventBatch) -> bool:
    """True if the batch re-announces (leading ``cleared``) or opens a fresh stream."""
    return batch.seq == 0 or (bool(batch.events) and batch.events[0].kind == EventKind.CLEARED)


def decide(state: StreamState | None, batch: KVEventBatch) -> tuple[Action, StreamState | None]:
    """The action for ``batch`` and the replica's state afterwards (unchanged on IGNORE)."""
    if state is not None and batch.replica_epoch < state.epoch:
        return Action.IGNORE, state
    clean = starts_clean(batch)
    if state is None or batch.replica_epoch > state.epoch or state.last_seq is None:
        new_state = StreamState(batch.replica_epoch, batch.seq, stale=not clean)
        # A heartbeat-announced epoch with no batch yet has no entries to drop, but dropping
        # is idempotent and keeps one code path.
        return (Action.DROP_THEN_APPLY if clean else Action.DROP_THEN_STALE), new_state
    if batch.seq == 0:
        return Action.DROP_THEN_APPLY, StreamState(state.epoch, 0, stale=False)
    if batch.seq <= state.last_seq:
        return Action.IGNORE, state
    gap = batch.seq != state.last_seq + 1
    new_state = StreamState(state.epoch, batch.seq, stale=(state.stale or gap) and not clean)
    if clean and (gap or state.stale):
        return Action.DROP_THEN_APPLY, new_state
    if new_state.stale:
        return (Action.DROP_THEN_STALE if gap else Action.STILL_STALE), new_state
    return Action.APPLY, new_state


def outcome_of(action: Action) -> ApplyOutcome:
    if action in (Action.APPLY, Action.DROP_THEN_APPLY):
        return ApplyOutcome.APPLIED
    if action == Action.IGNORE:
        return ApplyOutcome.IGNORED
    return ApplyOutcome.STALE


def heartbeat_state(state: StreamState | None, epoch: int) -> tuple[bool, StreamState]:
    """On a heartbeat of ``epoch`` >= the known one: (drop the replica's entries?, new state)."""
    if state is not None and epoch < state.epoch:
        raise ValueError(f"epoch {epoch} is older than the known epoch {state.epoch}")
    if state is None or epoch > state.epoch:
        return True, StreamState(epoch, None, stale=False)
    return False, state
