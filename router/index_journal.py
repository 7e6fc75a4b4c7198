"""Copies of one embedded prefix index in other processes: ``JournaledIndex`` and
``IndexMirror``.

A routing decision that asks a shared index across processes pays a round trip, and at
dozens of replicas on a busy node that round trip is most of the decision. So the shared
index keeps a journal and each router keeps a copy it reads locally:

- ``JournaledIndex`` is an ``EmbeddedIndex`` that numbers every change it makes (a batch of
  KV events applied, a heartbeat, a speculative entry, a replica removed, a sweep) and keeps
  the newest ``max_changes`` of them with the clock reading each used
  (``embedded_index.Change``). ``changes_since(instance_id, cursor)`` answers with the changes
  after ``cursor``, or with a copy of the whole state when the cursor belongs to another
  instance (a re-created index) or is older than the journal reaches.
- ``IndexMirror`` is an ``EmbeddedIndex`` brought up to date from such an answer
  (``catch_up``). Replaying the same changes with the same clock readings on the same
  state gives the same state, so after a catch-up the mirror's ``match`` answers what the
  journaled index answered at the moment it replied (liveness compared with this process's
  clock, which on another node is only as close as the clocks are).

How it fails: nothing here does I/O. An answer for an unknown cursor is a full copy, never an
error; a malformed change is a ``ValueError`` from ``EmbeddedIndex.replay``.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import deque
from dataclasses import dataclass

from router.embedded_index import Change, EmbeddedIndex, IndexState
from router.index_types import Clock

MAX_JOURNAL_CHANGES = 8192
"""Changes a ``JournaledIndex`` keeps: a mirror further behind gets a full copy instead."""


@dataclass(frozen=True)
class JournalAnswer:
    """What ``JournaledIndex.changes_since`` answers: exactly one of ``changes`` and ``state``."""

    instance_id: str
    cursor: int
    """The number of the next change: the mirror asks from here next time."""
    changes: tuple[Change, ...] | None = None
    state: IndexState | None = None


class JournaledIndex(EmbeddedIndex):
    """An ``EmbeddedIndex`` that journals its changes for mirrors; thread-safe."""

    def __init__(
        self,
        heartbeat_timeout_s: float = 10.0,
        clock: Clock = time.time,
        max_changes: int = MAX_JOURNAL_CHANGES,
    ) -> None:
        super().__init__(heartbeat_timeout_s, clock)
        self.instance_id = uuid.uuid4().hex
        self._journal: deque[Change] = deque(maxlen=max_changes)
        self._next_change = 0

    def _changed(self, change: Change) -> None:
        self._journal.append(change)
        self._next_change += 1

    def changes_since(self, instance_id: str | None, cursor: int | None) -> JournalAnswer:
        """The changes after ``cursor`` of this instance, or the whole state when the journal
        cannot answer that (``instance_id`` not this one's, or ``cursor`` out of its reach);
        either taken under one hold of the lock, so the answer and its cursor agree."""
        with self._lock:
            first = self._next_change - len(self._journal)
            reachable = cursor is not None and first <= cursor <= self._next_change
            if instance_id == self.instance_id and reachable:
                changes = tuple(itertools.islice(self._journal, cursor - first, None))
                return JournalAnswer(self.instance_id, self._next_change, changes=changes)
            return JournalAnswer(self.instance_id, self._next_change, state=self._export_locked())


class IndexMirror(EmbeddedIndex):
    """A local copy of a ``JournaledIndex`` elsewhere: an ``EmbeddedIndex`` that
    ``catch_up`` brings up to date. One catch-up at a time (each answer is replayed onto the
    cursor it was asked from); reads any time."""

    def __init__(self, heartbeat_timeout_s: float, clock: Clock = time.time) -> None:
        super().__init__(heartbeat_timeout_s, clock)
        self.instance_id: str | None = None
        self.cursor: int | None = None

    def catch_up(self, answer: JournalAnswer) -> None:
        """Applies ``changes_since``'s answer to the cursor this mirror asked from."""
        if answer.state is not None:
            self.import_state(answer.state)
        else:
            self.replay(answer.changes or ())
        self.instance_id, self.cursor = answer.instance_id, answer.cursor
