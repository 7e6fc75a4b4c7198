"""router.load: the requests a router tracks, and the one rule that merges them with the
replicas' stats into each replica's load."""

from __future__ import annotations

import itertools

import pytest

from router import load as load_module
from router.load import LoadSnapshot, LoadTracker, ReplicaLoad, TrackedRequest, replica_load
from router.protocol import ReplicaStats


class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def tracker(clock: FakeClock, ttl_s: float = 60.0) -> LoadTracker:
    return LoadTracker(unconfirmed_ttl_s=ttl_s, clock=clock)


def tokens_on(t: LoadTracker, replica_id: str) -> list[int]:
    """Prefill tokens of the requests in flight on ``replica_id``, oldest decision first."""
    return [r.prefill_tokens for r in t.snapshot().on(replica_id) if r.in_flight]


def load_now(t: LoadTracker, replica_id: str, stats: ReplicaStats | None = None) -> ReplicaLoad:
    return t.loads({replica_id: stats or ReplicaStats()})[replica_id]


# --------------------------------------------------------------------------- the events


def test_a_decision_counts_on_its_replica_as_queued_prefill_until_completed():
    clock = FakeClock()
    t = tracker(clock)
    t.decided("r1", "a", 500)
    t.decided("r2", "a", 20)
    t.decided("r3", "b", 300)
    assert load_now(t, "a") == ReplicaLoad(2, 520, 0)
    t.routed("r1", "a")
    t.completed("r1", "a")
    assert tokens_on(t, "a") == [20] and tokens_on(t, "b") == [300]


def test_a_first_output_moves_the_request_from_the_queue_to_the_running_batch():
    clock = FakeClock()
    t = tracker(clock)
    t.decided("r1", "a", 400)
    t.decided("r2", "a", 80)
    t.routed("r1", "a")
    clock.advance(0.5)
    assert t.first_output("r1")
    load = load_now(t, "a")
    assert (load.num_queued, load.queued_prefill_tokens, load.num_running) == (1, 80, 1)
    assert not t.first_output("never-decided")


@pytest.mark.parametrize(
    "order", list(itertools.permutations(["routed", "first_output", "completed"]))
)
def test_events_after_the_decision_in_any_order_leave_nothing_in_flight(order):
    """A decision comes first (Serve sends nothing the router has not chosen); then Serve
    confirms, the ingress reports the first output and Serve completes, from different
    threads and loops: whatever order those arrive in, the request counts once until it
    finishes and nowhere after."""
    clock = FakeClock()
    t = tracker(clock)
    t.decided("r", "a", 120)
    events = {
        "routed": lambda: t.routed("r", "a"),
        "first_output": lambda: t.first_output("r"),
        "completed": lambda: t.completed("r", "a"),
    }
    for name in order:
        clock.advance(0.1)
        before = load_now(t, "a")
        assert before.num_requests == 1, (order, name)
        events[name]()
        if name == "completed":
            break  # what comes after a completion changes nothing (checked below)
    for name in order[order.index("completed") + 1 :]:
        events[name]()
    assert load_now(t, "a").num_requests == 0, order
    assert t.snapshot().num_in_flight == 0, order


def test_serve_falling_through_to_another_replica_moves_the_entry_keeping_its_order():
    t = tracker(FakeClock())
    t.decided("r1", "a", 500)
    t.decided("r2", "b", 40)
    t.routed("r1", "b")  # the chosen replica was full: Serve used b
    assert tokens_on(t, "b") == [500, 40] and tokens_on(t, "a") == []
    t.routed("r1", "a")  # a second confirmation changes nothing
    assert tokens_on(t, "b") == [500, 40]


def test_a_retried_decision_replaces_the_first():
    t = tracker(FakeClock())
    t.decided("r1", "a", 500)
    t.decided("r1", "b", 480)
    assert tokens_on(t, "a") == [] and tokens_on(t, "b") == [480]


def test_unconfirmed_decisions_expire_confirmed_ones_do_not():
    clock = FakeClock()
    t = tracker(clock, ttl_s=5.0)
    t.decided("gave-up", "a", 500)
    t.decided("sent", "a", 100)
    t.routed("sent", "a")
    clock.advance(6.0)
    assert tokens_on(t, "a") == [100]
    t.routed("late", "c")  # confirmed after its decision expired: counted, prefill unknown
    assert tokens_on(t, "c") == [0]
    t.completed("never-seen", "a")  # harmless
    t.completed("sent", "a")
    t.completed("late", "c")
    assert t.snapshot().num_in_flight == 0


def test_a_confirmation_after_its_completion_is_ignored():
    """Serve runs the completion callback of a short request before the await on its
    acceptance returns: the late confirmation must not bring the request back."""
    t = tracker(FakeClock())
    t.decided("short", "a", 300)
    t.decided("long", "a", 40)
    t.completed("short", "a")
    t.routed("short", "a")
    assert tokens_on(t, "a") == [40]
    # A retry of a completed key (rejected, then routed again) is a new attempt and counts.
    t.decided("short", "b", 280)
    t.routed("short", "b")
    assert tokens_on(t, "b") == [280]


def test_completed_keys_are_forgotten_after_a_while():
    clock = FakeClock()
    t = tracker(clock)
    t.completed("old", "a")
    clock.advance(load_module.COMPLETED_KEY_MEMORY_S + 1.0)
    t.completed("new", "a")  # prunes "old"
    t.routed("old", "a")  # no longer remembered: counted as a late confirmation
    t.routed("new", "a")  # remembered: ignored
    assert tokens_on(t, "a") == [0]


def test_a_rejected_attempts_late_completion_leaves_the_retry_counted():
    # Replica a rejected the first attempt; the retry was decided for b before Serve's
    # completion of the rejected attempt (on a) came through.
    t = tracker(FakeClock())
    t.decided("r", "a", 300)
    t.decided("r", "b", 300)
    t.completed("r", "a")
    t.routed("r", "b")
    assert tokens_on(t, "b") == [300]
    t.completed("r", "b")
    assert t.snapshot().num_in_flight == 0


def test_a_fall_through_completed_before_its_confirmation_leaves_nothing():
    # Decided for a, Serve used b (a was full), and b's completion came first.
    t = tracker(FakeClock())
    t.decided("r", "a", 300)
    t.completed("r", "b")
    assert tokens_on(t, "a") == [300]  # until the confirmation says where it went
    t.routed("r", "b")
    assert t.snapshot().num_in_flight == 0


def test_every_event_tells_the_listeners():
    t = tracker(FakeClock())
    calls = []
    listener = lambda: calls.append(1)  # noqa: E731
    t.add_listener(listener)
    t.decided("r", "a", 1)
    t.routed("r", "a")
    t.first_output("r")
    t.completed("r", "a")
    assert len(calls) == 4
    t.remove_listener(listener)
    t.decided("s", "a", 1)
    assert len(calls) == 4


# ------------------------------------------------------------------------------ the rule


def test_the_stats_alone_are_the_load_when_nothing_is_tracked():
    stats = ReplicaStats(num_waiting=2, num_running=3, num_queued_prefill_tokens=700, as_of_s=50.0)
    assert replica_load(stats) == ReplicaLoad(2, 700, 3)
    assert replica_load(ReplicaStats()) == ReplicaLoad()


def test_a_request_that_finished_between_two_stats_reports_is_not_counted_twice():
    """The stats (at t=10) show two running; one of them finished at t=11. The load is one
    running request: not the stats' two, nor the stats' two plus a tracked one."""
    stats = ReplicaStats(num_running=2, as_of_s=10.0)
    requests = [
        TrackedRequest(8.0, 100, first_output_at_s=9.0, completed_at_s=11.0),
        TrackedRequest(9.0, 100, first_output_at_s=9.5),
    ]
    assert replica_load(stats, requests) == ReplicaLoad(0, 0, 1)


def test_stale_stats_lose_to_the_trackers_newer_events():
    """Stats at t=10 show three requests waiting with 900 tokens queued; since then all
    three produced their first output, and a fourth was sent (80 tokens)."""
    stats = ReplicaStats(num_waiting=3, num_queued_prefill_tokens=900, as_of_s=10.0)
    requests = [TrackedRequest(9.0, 300, first_output_at_s=10.5 + i) for i in range(3)]
    requests.append(TrackedRequest(12.0, 80))
    assert replica_load(stats, requests) == ReplicaLoad(1, 80, 3)


def test_requests_nobody_tracks_are_priced_at_the_stats_share():
    """The stats show four requests (2 waiting, 1200 tokens queued); the tracker follows two
    of them (a peer router's two are not on the board): the other two count at half the
    stats' queue."""
    stats = ReplicaStats(num_waiting=2, num_running=2, num_queued_prefill_tokens=1200, as_of_s=10.0)
    requests = [
        TrackedRequest(5.0, 50, first_output_at_s=6.0),
        TrackedRequest(9.0, 200),
    ]
    load = replica_load(stats, requests)
    assert (load.num_queued, load.queued_prefill_tokens, load.num_running) == (2, 800, 2)


def test_stats_without_a_time_are_taken_to_show_every_tracked_request():
    stats = ReplicaStats(num_running=2)  # as_of_s 0: unknown
    requests = [TrackedRequest(5.0, 50, first_output_at_s=6.0), TrackedRequest(9.0, 200)]
    assert replica_load(stats, requests) == ReplicaLoad(1, 200, 1)


def test_a_decision_made_after_the_stats_counts_once():
    stats = ReplicaStats(num_running=1, as_of_s=10.0)
    requests = [TrackedRequest(5.0, 50, first_output_at_s=6.0), TrackedRequest(11.0, 64)]
    assert replica_load(stats, requests) == ReplicaLoad(1, 64, 1)


def test_loads_merge_the_peers_requests_and_forget_completions_the_stats_caught_up_with():
    clock = FakeClock(100.0)
    t = tracker(clock)
    t.decided("mine", "a", 40)
    t.routed("mine", "a")
    t.first_output("mine")
    clock.advance(1.0)
    t.completed("mine", "a")  # at 101
    peers = LoadSnapshot({"a": (TrackedRequest(99.0, 300),), "b": (TrackedRequest(99.5, 10),)})
    old = {"a": ReplicaStats(num_running=1, as_of_s=100.5), "b": ReplicaStats(as_of_s=100.5)}
    loads = t.loads(old, peers)
    # a: its stats show mine (done since) and not the peer's, which is queued: 1 queued.
    assert loads["a"] == ReplicaLoad(1, 300, 0)
    assert loads["b"].queued_prefill_tokens == 10
    assert t.snapshot().on("a")  # the completion is kept: these stats still show it
    newer = {"a": ReplicaStats(as_of_s=101.5), "b": ReplicaStats(as_of_s=101.5)}
    t.loads(newer, peers)
    assert t.snapshot().on("a") == ()  # stats taken after it no longer show it


def test_completed_requests_leave_the_snapshot_after_a_while_without_newer_stats():
    clock = FakeClock()
    t = tracker(clock)
    t.decided("r", "a", 40)
    t.completed("r", "a")
    assert [r.completed_at_s for r in t.snapshot().on("a")] == [clock.now_s]
    clock.advance(load_module.COMPLETED_SHOWN_S + 0.1)
    assert t.snapshot().on("a") == ()


def test_snapshots_merge_oldest_decision_first():
    own = LoadSnapshot({"a": (TrackedRequest(2.0, 200),), "c": (TrackedRequest(1.0, 16),)})
    peers = LoadSnapshot(
        {
            "a": (TrackedRequest(1.0, 500), TrackedRequest(3.0, 0, 3.5)),
            "b": (TrackedRequest(5.0, 80),),
        }
    )
    merged = own.merged(peers)
    assert [r.decided_at_s for r in merged.on("a")] == [1.0, 2.0, 3.0]
    assert merged.on("c") == (TrackedRequest(1.0, 16),)
    assert merged.num_in_flight == 5


def test_loads_equal_the_rule_over_the_merged_snapshot_on_random_events():
    """``loads`` keeps per-replica sums as events arrive and recounts only what new stats or
    new peer rows change; it must price exactly what ``replica_load`` over the snapshot
    merged with the peers' prices, whatever the events, with stats and peers kept across
    several events as well as replaced."""
    import random

    rng = random.Random(7)
    clock = FakeClock(100.0)
    t = tracker(clock, ttl_s=2.0)
    replicas = ["a", "b", "c"]

    def new_stats():
        return {
            rid: ReplicaStats(
                num_waiting=rng.randrange(4),
                num_running=rng.randrange(6),
                num_queued_prefill_tokens=rng.randrange(900),
                as_of_s=rng.choice([0.0, clock.now_s - rng.random() * 3]),
            )
            for rid in rng.sample(replicas, rng.randint(1, 3))
        }

    def new_peers():
        return LoadSnapshot(
            {
                rid: tuple(
                    TrackedRequest(
                        clock.now_s - rng.random() * 2,
                        rng.randrange(300),
                        *rng.choice([(None, None), (clock.now_s - 0.1, None), (None, clock.now_s)]),
                    )
                    for _ in range(rng.randrange(3))
                )
                for rid in replicas
            }
        )

    stats, peers = new_stats(), new_peers()
    for step in range(1500):
        key = f"k{rng.randrange(80)}"
        replica = rng.choice(replicas)
        event = rng.random()
        if event < 0.35:
            t.decided(key, replica, rng.randrange(0, 500))
        elif event < 0.55:
            t.routed(key, replica)
        elif event < 0.75:
            t.first_output(key)
        else:
            t.completed(key, replica)
        clock.advance(rng.choice([0.0, 0.01, 0.3]))
        if step % 5 == 0:
            stats = new_stats()
        if step % 7 == 0:
            peers = new_peers()
        t.loads(stats)  # let the tracker forget what these stats caught up with, first
        merged = t.snapshot().merged(peers)
        expected = {rid: replica_load(s, merged.on(rid)) for rid, s in stats.items()}
        assert t.loads(stats, peers) == expected, step
