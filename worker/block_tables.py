"""``BlockTableRows``: a step's block tables kept from one step to the next.

A decode step at batch 256 and 2k tokens of context has 256 x 128 block ids in its tables.
Converting them from Python lists every step costs milliseconds of host time, while from one
step to the next at most one block per sequence is new (vLLM v1's persistent batch makes the
same observation). So the tables live in one int32 host tensor, a row per batch position, and
each row remembers which list it mirrors and how much of it is written: when a position holds
the same list as in the last step, only its new entries are written.

What makes that safe is the way tables change: a request's ``block_ids`` list only grows in
place while the request holds it, and any other change (preemption, a recompute, admission)
assigns a new list (``worker/request.py``, ``worker/scheduler.py``); a tensor-parallel
worker's tables follow the same rule (``worker/parallel/step_message.py``). A row keeps a
reference to the list it mirrors, so the list's identity cannot be reused while the row
remembers it.

Columns past a row's own table keep whatever an earlier table left there: attention reads a
sequence's blocks up to its length, never past them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockTableRows:
    """``max_rows`` x ``max_blocks`` int32 block ids on the host; ``pin``: page-locked (for
    copies to a GPU)."""

    def __init__(self, max_rows: int, max_blocks: int, pin: bool = False) -> None:
        self.host = torch.zeros(max_rows, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.array = self.host.numpy()
        """``host`` as numpy (what ``write`` writes)."""
        self._mirrors: list[list[int] | None] = [None] * max_rows
        self._written = [0] * max_rows

    def write(self, tables: Sequence[list[int]]) -> int:
        """Row ``i`` := ``tables[i]``, writing only what row ``i`` does not hold yet; returns
        the longest table's length (the columns a step needs)."""
        if len(tables) > len(self._mirrors):
            raise ValueError(f"{len(tables)} tables for {len(self._mirrors)} rows")
        array, mirrors, written = self.array, self._mirrors, self._written
        width = 0
        for row, table in enumerate(tables):
            length = len(table)
            if length > width:
                width = length
            if mirrors[row] is table:
                start = written[row]
                if start == length:  # most rows of most steps: nothing new
                    continue
                if start > length:  # cannot happen to a list that only grows: write it whole
                    start = 0
            else:
                mirrors[row] = table
                start = 0
            array[row, start:length] = table[start:]
            written[row] = length
        return width

    def clear(self, rows: range) -> None:
        """Rows of padding sequences: block id 0 in their first column, nothing mirrored."""
        self.array[rows.start : rows.stop, 0] = 0
        for row in rows:
            self._mirrors[row] = None
            self._written[row] = 0
