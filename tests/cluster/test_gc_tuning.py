"""``cluster.gc_tuning``: the request path's young-generation threshold."""

from __future__ import annotations

import gc

import pytest

from cluster.gc_tuning import YOUNG_COLLECTION_ALLOCATIONS, collect_young_less_often


@pytest.fixture
def restored_threshold():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_young_objects_are_collected_less_often_and_the_older_ratios_kept(restored_threshold):
    gc.set_threshold(700, 10, 10)
    collect_young_less_often("test")
    assert gc.get_threshold() == (YOUNG_COLLECTION_ALLOCATIONS, 10, 10)
    # What it buys: a burst of surviving containers triggers far fewer young collections.
    counts = []

    def count(phase, info):
        if phase == "stop":
            counts.append(info["generation"])

    gc.callbacks.append(count)
    try:
        kept = [[i] for i in range(50_000)]
    finally:
        gc.callbacks.remove(count)
    assert len(kept) == 50_000 and len(counts) <= 50_000 // YOUNG_COLLECTION_ALLOCATIONS + 1


def test_a_higher_threshold_set_by_the_user_is_kept(restored_threshold):
    gc.set_threshold(10 * YOUNG_COLLECTION_ALLOCATIONS, 5, 5)
    collect_young_less_often("test")
    assert gc.get_threshold() == (10 * YOUNG_COLLECTION_ALLOCATIONS, 5, 5)
