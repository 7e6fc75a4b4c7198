"""The one communication interface tensor parallelism uses, over ``torch.distributed``.

A ``Communicator`` answers four questions for the model and the runner: the sum of a tensor
over the ranks (``all_reduce``), the concatenation of the ranks' shards (``all_gather``), the
smallest of one integer per rank (``min_int``, for agreeing on the KV block count), and what
rank 0 wants run next (``send_step`` / ``recv_step``). ``SINGLE_RANK`` is the trivial one
(world size 1, every collective the identity), so code paths never branch on "is TP on".

Groups are made directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a ``TCPStore``),
never through ``init_process_group``: there is no process-wide default group, so one process
can hold several engines (tests do) and nothing global needs a fixed name or port. The store
is hosted by rank 0 on a port the OS picks, so every replica gets its own.

- ``control``: a gloo group on the CPU for step messages and small integers.
- ``data``: the same gloo group on CPU; an NCCL group when the model runs on CUDA.

Determinism: with ``deterministic=True`` ``all_reduce`` gathers every rank's partial and adds
them on each rank in rank order 0, 1, ..., N-1. Gloo's ring all-reduce would sum an element
in an order that depends on where it falls in the buffer, i.e. on the batch size, for N > 2.
The fixed-order sum makes a row's result depend on that row alone, and every rank ends with
the same bits.

Failure: data collectives time out after ``COLLECTIVE_TIMEOUT_S`` and raise at once when a
peer's connection closes (a dead worker), so rank 0's step raises instead of hanging. A
worker waits for the next step for ``STEP_WAIT_TIMEOUT`` (an idle replica sends nothing) and
raises when rank 0's connection closes.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 60.0
"""A rank waits this long for its peers inside one collective. Ranks run the same step in
lockstep, so the wait is their skew: seconds on a loaded CPU, never a minute unless a peer
hangs."""
STEP_WAIT_TIMEOUT = datetime.timedelta(days=30)
"""A worker's wait for rank 0's next step: an idle replica may send nothing for a long time;
rank 0 dying closes the connection, which ends the wait at once."""
_STOP = -1
"""Length header of the message that tells workers to return (never a real length)."""


class Communicator:
    """World size 1: every collective is the identity. Subclassed for real groups."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's ``x`` along the last dimension, in rank order."""
        return x

    def min_int(self, value: int) -> int:
        return value

    def send_step(self, payload: torch.Tensor) -> None:
        raise RuntimeError("a single rank has nobody to send steps to")

    def recv_step(self) -> torch.Tensor | None:
        raise RuntimeError("a single rank receives no steps")

    def send_stop(self) -> None:
        pass


SINGLE_RANK = Communicator()


def _gloo(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))


class ProcessGroupCommunicator(Communicator):
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        deterministic: bool,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.deterministic = deterministic
        self.control = _gloo(dist.PrefixStore("control", store), rank, world_size, timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = datetime.timedelta(seconds=timeout_s)
            self.data = dist.ProcessGroupNCCL(
                dist.PrefixStore("data", store), rank, world_size, options
            )
        else:
            self.data = self.control
        self._header = torch.zeros(1, dtype=torch.int64)

    # -- collectives of the forward pass -------------------------------------------------------
    def _gather_list(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.data.allgather([parts], [x]).wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not self.deterministic:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            self.data.allreduce([x], options).wait()
            return x
        parts = self._gather_list(x)
        total = parts[0]
        for part in parts[1:]:  # rank order, on every rank: the same bits everywhere
            total += part
        return total

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._gather_list(x), dim=-1)

    def min_int(self, value: int) -> int:
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.control.allgather([parts], [torch.tensor([value], dtype=torch.int64)]).wait()
        return int(min(p.item() for p in parts))

    # -- step messages (rank 0 -> workers) -----------------------------------------------------
    def _broadcast(self, t: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if timeout is not None:
            options.timeout = timeout
        self.control.broadcast([t], options).wait()

    def send_step(self, payload: torch.Tensor) -> None:
        """Rank 0: one int64 message (``worker/parallel/step_message.py``) to every worker."""
        self._header[0] = payload.numel()
        self._broadcast(self._header)
        self._broadcast(payload)

    def send_stop(self) -> None:
        self._header[0] = _STOP
        self._broadcast(self._header)

    def recv_step(self) -> torch.Tensor | None:
        """Workers: the next step message, or None when rank 0 says stop."""
        self._broadcast(self._header, STEP_WAIT_TIMEOUT)
        length = int(self._header.item())
        if length == _STOP:
            return None
        payload = torch.empty(length, dtype=torch.int64)
        self._broadcast(payload)
        return payload
