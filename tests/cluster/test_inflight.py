"""cluster.inflight.InflightLedger: a request router's in-flight requests per replica."""

from __future__ import annotations

import time

from cluster.inflight import InflightLedger, first_output_arrived


def test_a_decision_counts_on_its_replica_until_completed():
    ledger = InflightLedger(ttl_s=60.0)
    ledger.decided("r1", "a", 500)
    ledger.decided("r2", "a", 20)
    ledger.decided("r3", "b", 300)
    assert ledger.snapshot() == {"a": (500, 20), "b": (300,)}
    ledger.routed("r1", "a")
    ledger.completed("r1", "a")
    assert ledger.snapshot() == {"a": (20,), "b": (300,)}


def test_serve_falling_through_to_another_replica_moves_the_entry_keeping_its_order():
    ledger = InflightLedger(ttl_s=60.0)
    ledger.decided("r1", "a", 500)
    ledger.decided("r2", "b", 40)
    ledger.routed("r1", "b")  # the chosen replica was full: Serve used b
    assert ledger.snapshot() == {"b": (500, 40)}
    ledger.routed("r1", "a")  # a second confirmation changes nothing
    assert ledger.snapshot() == {"b": (500, 40)}


def test_a_retried_decision_replaces_the_first():
    ledger = InflightLedger(ttl_s=60.0)
    ledger.decided("r1", "a", 500)
    ledger.decided("r1", "b", 480)
    assert ledger.snapshot() == {"b": (480,)}


def test_unconfirmed_decisions_expire_confirmed_ones_do_not():
    ledger = InflightLedger(ttl_s=0.05)
    ledger.decided("gave-up", "a", 500)
    ledger.decided("sent", "a", 100)
    ledger.routed("sent", "a")
    time.sleep(0.1)
    assert ledger.snapshot() == {"a": (100,)}
    ledger.routed("late", "c")  # confirmed after its decision expired: counted, prefill unknown
    assert ledger.snapshot() == {"a": (100,), "c": (0,)}
    ledger.completed("never-seen", "a")  # harmless
    ledger.completed("sent", "a")
    ledger.completed("late", "c")
    assert ledger.snapshot() == {}


def test_a_confirmation_after_its_completion_is_ignored():
    # Serve runs the completion callback of a short request before the await on its
    # acceptance returns: the late confirmation must not bring the request back.
    ledger = InflightLedger(ttl_s=60.0)
    ledger.decided("short", "a", 300)
    ledger.decided("long", "a", 40)
    ledger.completed("short", "a")
    ledger.routed("short", "a")
    assert ledger.snapshot() == {"a": (40,)}
    # A retry of a completed key (rejected, then routed again) is a new attempt and counts.
    ledger.decided("short", "b", 280)
    ledger.routed("short", "b")
    assert ledger.snapshot() == {"a": (40,), "b": (280,)}


def test_completed_keys_are_forgotten_after_a_while(monkeypatch):
    from cluster import inflight

    ledger = InflightLedger(ttl_s=60.0)
    monkeypatch.setattr(inflight, "COMPLETED_MEMORY_S", 0.0)
    ledger.completed("old", "a")
    time.sleep(0.01)
    ledger.completed("new", "a")  # prunes "old"
    ledger.routed("old", "a")  # no longer remembered: counted as a late confirmation
    ledger.routed("new", "a")  # remembered until the next completion prunes it
    assert ledger.snapshot() == {"a": (0,)}


def test_a_rejected_attempts_late_completion_leaves_the_retry_counted():
    # Replica a rejected the first attempt; the retry was decided for b before Serve's
    # completion of the rejected attempt (on a) came through.
    ledger = InflightLedger(ttl_s=60.0)
    ledger.decided("r", "a", 300)
    ledger.decided("r", "b", 300)
    ledger.completed("r", "a")
    ledger.routed("r", "b")
    assert ledger.snapshot() == {"b": (300,)}
    ledger.completed("r", "b")
    assert ledger.snapshot() == {}


def test_a_fall_through_completed_before_its_confirmation_leaves_nothing():
    # Decided for a, Serve used b (a was full), and b's completion came first.
    ledger = InflightLedger(ttl_s=60.0)
    ledger.decided("r", "a", 300)
    ledger.completed("r", "b")
    assert ledger.snapshot() == {"a": (300,)}  # until the confirmation says where it went
    ledger.routed("r", "b")
    assert ledger.snapshot() == {}


def test_a_first_output_marks_the_entry_in_whichever_ledger_holds_it():
    """The ingress reports a first output by key alone; the ledger holding it marks it (and
    says so to its router), the others ignore it; a completed key marks nothing."""
    changes = []
    mine = InflightLedger(ttl_s=60.0, on_change=lambda: changes.append("mine"))
    other = InflightLedger(ttl_s=60.0, on_change=lambda: changes.append("other"))
    mine.decided("first-output-r1", "a", 500)
    mine.decided("first-output-r2", "a", 20)
    other.decided("first-output-r3", "a", 64)
    assert not mine.marks_first_outputs
    first_output_arrived("first-output-r1")
    first_output_arrived("first-output-gone")
    assert changes == ["mine"]
    assert mine.marks_first_outputs and not other.marks_first_outputs
    assert [(tokens, awaiting) for _, tokens, awaiting in mine.timed_snapshot()["a"]] == [
        (500, False),
        (20, True),
    ]
    mine.routed("first-output-r1", "a")  # a confirmation after the first output keeps the mark
    assert not mine.timed_snapshot()["a"][0][2]
    mine.completed("first-output-r2", "a")
    assert not mine.first_output("first-output-r2")
