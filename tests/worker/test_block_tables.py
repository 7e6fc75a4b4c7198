"""``BlockTableRows``: rows always read as the tables written, whatever moved between steps,
and a row holding the same list as before writes only the ids that list gained."""

from __future__ import annotations

import random

import pytest

from worker.block_tables import BlockTableRows


def _rows_match(rows: BlockTableRows, tables: list[list[int]]) -> bool:
    return all(rows.host[i, : len(t)].tolist() == t for i, t in enumerate(tables))


def test_a_grown_list_writes_only_its_new_ids_and_a_new_list_is_written_whole():
    rows = BlockTableRows(4, 8)
    a, b = [3, 4], [7]
    assert rows.write([a, b]) == 2
    rows.host[0, 0] = -1  # a marker: rewriting row 0 from its start would overwrite it
    a += [5, 6]
    assert rows.write([a, b]) == 4
    assert rows.host[0, :4].tolist() == [-1, 4, 5, 6]
    a2 = [3, 4, 5, 6]  # equal ids, another list (a preemption and a recompute): written whole
    assert rows.write([a2, b]) == 4
    assert rows.host[0, :4].tolist() == [3, 4, 5, 6]


def test_lists_that_change_rows_are_written_whole():
    rows = BlockTableRows(3, 8)
    a, b, c = [1, 2, 3], [4], [5, 6]
    rows.write([a, b, c])
    b.append(9)
    assert rows.write([c, a, b]) == 3
    assert _rows_match(rows, [c, a, b])
    assert rows.write([b]) == 2  # a shorter batch: the other rows are left as they were
    assert _rows_match(rows, [b])


def test_a_list_shorter_than_its_row_is_written_whole():
    """Tables only grow in place; one that is shorter than what its row wrote is not trusted."""
    rows = BlockTableRows(1, 8)
    a = [1, 2, 3]
    rows.write([a])
    rows.host[0, 0] = -1
    del a[1:]
    rows.write([a])
    assert rows.host[0, 0].item() == 1
    a += [8, 9]
    rows.write([a])
    assert rows.host[0, :3].tolist() == [1, 8, 9]


def test_clear_zeroes_padding_rows_first_id_and_forgets_them():
    rows = BlockTableRows(3, 4)
    b = [7, 3]
    rows.write([[5, 6], b, [8, 9]])
    rows.clear(range(1, 3))
    assert rows.host[1:, 0].tolist() == [0, 0]
    rows.write([[5, 6], b])  # row 1 mirrors nothing any more: written whole
    assert rows.host[1, :2].tolist() == [7, 3]
    with pytest.raises(ValueError, match="4 tables for 3 rows"):
        rows.write([[1]] * 4)


def test_random_steps_keep_every_row_equal_to_its_table():
    """Steps as a scheduler makes them: tables grow in place, sequences leave and join, the
    batch is reordered, a preempted sequence comes back with a new list."""
    rng = random.Random(0)
    rows = BlockTableRows(16, 64)
    live = [[rng.randrange(1000)] for _ in range(8)]
    for _ in range(400):
        for table in live:
            if rng.random() < 0.3 and len(table) < 64:
                table.append(rng.randrange(1000))
        if rng.random() < 0.2 and live:
            live.pop(rng.randrange(len(live)))
        if rng.random() < 0.2 and len(live) < 16:
            live.append([rng.randrange(1000) for _ in range(rng.randrange(1, 20))])
        if rng.random() < 0.1 and live:
            i = rng.randrange(len(live))
            live[i] = list(live[i])  # recomputed: same ids, a new list
        if rng.random() < 0.3:
            rng.shuffle(live)
        width = rows.write(live)
        assert width == max((len(t) for t in live), default=0)
        assert _rows_match(rows, live)
