"""This router's own ``prefix`` decisions that a lookup could not have seen in the index yet,
and the LoRA adapters it sent that the replicas' stats cannot list yet.

Owns ``RecentDecisions``, ``merge_matches`` and ``RecentAdapters``. Each decision's blocks go to
the index as a speculative entry (``routing.Router``), written from a background thread a round
trip later, while the lookups of a burst run concurrently: siblings decided in the same instant
(a burst sharing one system prompt, an agent's parallel calls) would each find the prefix
nowhere and be spread over the replicas by load, each prefilling it. So every decision is
numbered and kept here until its write has landed and no lookup that started before could still
need it; a lookup notes how far the writes had landed when it started (``landed_mark``, which
registers it until its ``match``), and at decision time the decisions after that mark are merged
into its matches (``match``): exactly what the index could not have told it.
Decisions the index already holds are left to the index, which also knows when their replica
died or restarted.

Thread-safe (one lock). Bounded: entries older than ``ttl_s`` (the speculative TTL: a write
that never landed, e.g. dropped from a full queue) stop counting and are dropped, as are the
registrations of lookups never matched (their caller was cancelled), and past ``max_blocks``
blocks over the kept decisions the oldest decisions go; either only means the index's answer
decides alone.

``RecentAdapters`` does for adapters what the speculative entries do for blocks: a replica
sent a request on adapter X loads X when it admits it, but its stats (``lora_adapters``) say
so only a stats period or more later, so a burst of X's requests would each find X nowhere
and be spread by load, each replica loading it. A replica this router sent X within
``ttl_s`` counts as holding it. It fails the way a speculative entry does: a replica that
has since evicted X (its slots taken by other adapters) still counts as holding it until the
entry expires. Thread-safe (one lock), bounded (recording an adapter drops its expired
entries; past ``max_adapters`` adapters, the least recently sent one's go).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence

from router.index_types import Match, ReplicaId
from router.protocol import BlockHash

DEFAULT_MAX_BLOCKS = 1 << 16
DEFAULT_MAX_ADAPTERS = 1 << 12


class RecentDecisions:
    """Block hash -> the replicas recent decisions sent it to, by decision number.

    Each decision is kept once, in order (``_decisions``), and indexed by block
    (``_holders``); pruning drops whole decisions from the oldest on, so recording one costs a
    dict write per block and nothing is ever reordered."""

    def __init__(
        self,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._max_blocks = max_blocks
        self._lock = threading.Lock()
        self._holders: dict[BlockHash, dict[ReplicaId, tuple[int, float]]] = {}
        """Block -> replica -> (number of the newest decision that sent it there, expiry)."""
        self._decisions: deque[tuple[int, float, ReplicaId, Sequence[BlockHash]]] = deque()
        """(number, expiry, replica, blocks) of every decision kept, oldest first."""
        self._num_entries = 0
        """Blocks over the kept decisions: what ``max_blocks`` bounds."""
        self._last_seq = 0
        self._landed_seq = 0
        self._open_marks: dict[int, tuple[int, float]] = {}
        """Mark -> (lookups holding it, when the last took it): started and not yet matched,
        so the entries after the mark must stay."""

    def record(self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash]) -> int:
        """A decision sent these blocks to ``replica_id``; returns its number, which the
        caller passes to ``landed`` once the index holds the decision."""
        expiry_s = self._clock() + self.ttl_s
        with self._lock:
            self._last_seq += 1
            seq = self._last_seq
            entry = (seq, expiry_s)
            holders = self._holders
            for block_hash in block_hashes:
                found = holders.get(block_hash)
                if found is None:
                    holders[block_hash] = {replica_id: entry}
                else:
                    found[replica_id] = entry
            self._decisions.append((seq, expiry_s, replica_id, block_hashes))
            self._num_entries += len(block_hashes)
            while self._num_entries > self._max_blocks:
                self._drop_oldest()
        return seq

    def landed(self, seq: int) -> None:
        """The index holds every decision up to number ``seq`` (writes land in order)."""
        with self._lock:
            self._landed_seq = max(self._landed_seq, seq)
            self._prune()

    def landed_mark(self) -> int:
        """The number up to which the index holds every decision: a lookup starting now sees
        those, and ``match(..., after=mark)`` adds the rest. Registers the lookup until its
        ``match`` (or, never matched, for ``ttl_s``)."""
        now_s = self._clock()
        with self._lock:
            mark = self._landed_seq
            count, _ = self._open_marks.get(mark, (0, now_s))
            self._open_marks[mark] = (count + 1, now_s)
            return mark

    def match(self, block_hashes: Sequence[BlockHash], after: int) -> dict[ReplicaId, Match]:
        """Per replica, the leading blocks of ``block_hashes`` that decisions numbered above
        ``after`` (and unexpired) sent there; releases the lookup that took mark ``after``."""
        now_s = self._clock()
        counts: dict[ReplicaId, int] = {}
        with self._lock:
            for i, block_hash in enumerate(block_hashes):
                holders = self._holders.get(block_hash) or {}
                live = {r for r, (seq, exp_s) in holders.items() if seq > after and exp_s > now_s}
                if i == 0:
                    counts = dict.fromkeys(live, 0)
                extended = False
                for replica_id, num_blocks in counts.items():
                    if num_blocks == i and replica_id in live:
                        counts[replica_id] = i + 1
                        extended = True
                if not extended:
                    break
            self._release(after)  # after reading: what it saw may go now
            self._prune()
        return {r: Match(n) for r, n in counts.items() if n > 0}

    def _release(self, mark: int) -> None:
        count, taken_s = self._open_marks.get(mark, (0, 0.0))
        if count > 1:
            self._open_marks[mark] = (count - 1, taken_s)
        else:
            self._open_marks.pop(mark, None)

    def _prune(self) -> None:
        """Drop the oldest decisions that every open lookup can see in the index already, or
        that expired; and the registrations older than the TTL (lookups never matched)."""
        now_s = self._clock()
        for mark, (_, taken_s) in list(self._open_marks.items()):
            if now_s - taken_s > self.ttl_s:
                del self._open_marks[mark]
        keep_after = min([self._landed_seq, *self._open_marks])
        decisions = self._decisions
        while decisions and (decisions[0][0] <= keep_after or decisions[0][1] <= now_s):
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Forgets the oldest decision: its blocks on its replica, unless a newer decision
        sent them there again."""
        seq, _, replica_id, block_hashes = self._decisions.popleft()
        self._num_entries -= len(block_hashes)
        holders = self._holders
        for block_hash in block_hashes:
            found = holders.get(block_hash)
            if found is not None and found.get(replica_id, (0,))[0] == seq:
                del found[replica_id]
                if not found:
                    del holders[block_hash]


def merge_matches(
    index: Mapping[ReplicaId, Match], recent: Mapping[ReplicaId, Match]
) -> dict[ReplicaId, Match]:
    """The index's matches, with a replica's recent-decision run where it is longer than all
    the index counts there (device and host tiers)."""
    merged = dict(index)
    for replica_id, match in recent.items():
        known = merged.get(replica_id)
        if known is None or match.device_blocks > known.num_blocks:
            merged[replica_id] = match
    return merged


class RecentAdapters:
    """LoRA adapter name -> the replicas recent decisions sent its requests to, until when."""

    def __init__(
        self,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._max_adapters = max_adapters
        self._lock = threading.Lock()
        self._sent: OrderedDict[str, dict[ReplicaId, float]] = OrderedDict()
        """Adapter -> replica -> expiry; the adapters sent most recently last."""

    def record(self, replica_id: ReplicaId, lora_name: str) -> None:
        """A decision sent a request on ``lora_name`` to ``replica_id``."""
        now_s = self._clock()
        with self._lock:
            sent = self._sent.pop(lora_name, None) or {}
            sent = {r: exp_s for r, exp_s in sent.items() if exp_s > now_s}
            sent[replica_id] = now_s + self.ttl_s
            self._sent[lora_name] = sent
            while len(self._sent) > self._max_adapters:
                self._sent.popitem(last=False)

    def holders(self, lora_name: str) -> set[ReplicaId]:
        """The replicas sent a request on ``lora_name`` within the last ``ttl_s``."""
        now_s = self._clock()
        with self._lock:
            sent = self._sent.get(lora_name) or {}
            return {r for r, exp_s in sent.items() if exp_s > now_s}
