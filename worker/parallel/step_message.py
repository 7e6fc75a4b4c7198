"""What rank 0 tells the other ranks about one step, and how little it sends to say it.

Workers keep no scheduler: they keep each running sequence's block table, keyed by a number
rank 0 gave the sequence, and rank 0 sends per step only what changed:

- per scheduled sequence: its key, where this step starts (``num_computed_tokens``), how many
  tokens it computes, whether it samples, its LoRA adapter's id (0: none), the token ids it
  computes (new tokens travel once: a prefill chunk's tokens, or a decode's one sampled token)
  and the block ids appended to its table since the last step, or, when the table changed in
  another way (preemption and recompute), the whole table again;
- the keys of sequences that finished, so workers forget them.

Positions, slot mapping, sequence lengths and the sampled rows follow from those, computed
the same way on every rank (``ModelRunner.run_inputs``).

Wire format: one flat int64 tensor,
``[num_dropped, *dropped_keys, num_seqs, *(key, start, num_new, samples, lora_id,
table_mode, num_block_ids, *block_ids, *token_ids) per sequence]``.
A malformed message is a bug on rank 0 and fails the worker loudly (``ValueError``).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.request import Request
from worker.scheduler import ScheduledBatch


class TableMode(enum.IntEnum):
    APPEND = 0
    """The block ids extend the table the worker holds."""
    REPLACE = 1
    """The block ids are the whole table (new sequence, or recomputed after preemption)."""


@dataclass
class StepInputs:
    """One step as every rank runs it: per sequence start, tokens, table, and who samples."""

    token_ids: list[int]
    starts: list[int]
    counts: list[int]
    tables: list[list[int]]
    """Per sequence, its block table: the sequence's own list, not a copy (rank 0: the
    request's ``block_ids``; a worker: its ``StepDecoder``'s). Such a list only grows in place;
    any other change makes a new list, which is what ``worker/block_tables.py`` relies on."""
    sampling_rows: list[int]
    """Rows of ``token_ids`` whose logits are returned (a sequence's last known token)."""
    adapters: list[int] = field(default_factory=list)
    """Per sequence, the id of its LoRA adapter (``worker/lora.py``; 0: the base model)."""
    fed_rows: list[int] = field(default_factory=list)
    """Rows of ``token_ids`` that hold a token still in flight (written as 0 here): the
    runner takes each from ``fed_ids[fed_src[i]]`` on the device (``async_scheduling``)."""
    fed_src: list[int] = field(default_factory=list)
    fed_ids: Any = None
    """The step before's sampled ids on the device (the simulated engine: its ``SimLogits``);
    None when no row is fed."""


def inputs_of(batch: ScheduledBatch) -> tuple[StepInputs, list[int]]:
    """Rank 0: the step's inputs, and the indices of the requests that sample."""
    token_ids: list[int] = []
    starts = [req.num_computed_tokens for req in batch.requests]
    sampling_rows: list[int] = []
    sampling_reqs: list[int] = []
    fed_rows: list[int] = []
    fed_src: list[int] = []
    for i, (req, start, num_new) in enumerate(
        zip(batch.requests, starts, batch.num_new_tokens, strict=True)
    ):
        tokens = req.all_token_ids
        known = len(tokens)
        if num_new == 1 and start < known:  # a decode: one token, no slice
            token_ids.append(tokens[start])
        elif start + num_new <= known:
            token_ids += tokens[start : start + num_new]
        else:  # ends with the token in flight: the device has it
            token_ids += tokens[start:known]
            fed_rows.append(len(token_ids))
            fed_src.append(req.in_flight_row)
            token_ids.append(0)
            known += 1
        if start + num_new == known:
            sampling_rows.append(len(token_ids) - 1)
            sampling_reqs.append(i)
    inputs = StepInputs(
        token_ids,
        starts,
        list(batch.num_new_tokens),
        [req.block_ids for req in batch.requests],
        sampling_rows,
        [req.lora_id for req in batch.requests],
        fed_rows,
        fed_src,
        batch.fed if fed_rows else None,
    )
    return inputs, sampling_reqs


class StepEncoder:
    """Rank 0's side: remembers which table each worker holds for each live sequence."""

    def __init__(self) -> None:
        self._keys = itertools.count()
        self._sent: dict[int, tuple[Request, int, list[int], int]] = {}
        """id(request) -> (request, key, the table list last sent, how many of its ids the
        workers hold); the request is kept so its id cannot be reused while the entry lives.
        A table list only grows in place (``StepInputs.tables``), so the same list with at
        least as many ids extends what the workers hold."""

    def encode(self, batch: ScheduledBatch, inputs: StepInputs) -> torch.Tensor:
        if inputs.fed_rows:
            raise ValueError("a step with tokens in flight cannot be sent to other ranks")
        dropped = [entry[1] for entry in self._sent.values() if entry[0].is_finished]
        self._sent = {k: v for k, v in self._sent.items() if not v[0].is_finished}
        body: list[int] = []
        offset = 0
        for req, start, num_new, table, lora_id in zip(
            batch.requests,
            inputs.starts,
            inputs.counts,
            inputs.tables,
            inputs.adapters,
            strict=True,
        ):
            entry = self._sent.get(id(req))
            if entry is not None and entry[2] is table and len(table) >= entry[3]:
                key, mode, block_ids = entry[1], TableMode.APPEND, table[entry[3] :]
            else:
                key = entry[1] if entry is not None else next(self._keys)
                mode, block_ids = TableMode.REPLACE, table
            self._sent[id(req)] = (req, key, table, len(table))
            samples = int(start + num_new == req.num_tokens)
            body += [key, start, num_new, samples, lora_id, int(mode), len(block_ids), *block_ids]
            body += inputs.token_ids[offset : offset + num_new]
            offset += num_new
        return torch.tensor([len(dropped), *dropped, len(batch.requests), *body], dtype=torch.int64)


class StepDecoder:
    """A worker's side: the block table of every live sequence, updated from each message."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def decode(self, message: torch.Tensor) -> StepInputs:
        words = message.tolist()
        pos = 0

        def take(n: int) -> list[int]:
            nonlocal pos
            if n < 0 or pos + n > len(words):
                raise ValueError(
                    f"malformed step message: wants {n} words at {pos} of {len(words)}"
                )
            pos += n
            return words[pos - n : pos]

        for key in take(take(1)[0]):
            self.tables.pop(key, None)
        inputs = StepInputs([], [], [], [], [])
        for _ in range(take(1)[0]):
            key, start, num_new, samples, lora_id, mode, num_block_ids = take(7)
            block_ids = take(num_block_ids)
            if TableMode(mode) is TableMode.REPLACE:
                self.tables[key] = block_ids
            elif key not in self.tables:
                raise ValueError(
                    f"malformed step message: sequence {key} appends to a table never sent"
                )
            else:
                self.tables[key].extend(block_ids)
            inputs.token_ids.extend(take(num_new))
            inputs.starts.append(start)
            inputs.counts.append(num_new)
            inputs.adapters.append(lora_id)
            inputs.tables.append(self.tables[key])
            if samples:
                inputs.sampling_rows.append(len(inputs.token_ids) - 1)
        if pos != len(words):
            raise ValueError(f"malformed step message: {len(words) - pos} words left over")
        return inputs
