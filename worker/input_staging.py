"""``InputStaging``: a step's small integer inputs packed on the host and sent in one copy.

A graph step reads token ids, positions, KV slots, sequence lengths (and, for a mixed step,
query start offsets and the rows whose logits are kept) from static device buffers
(``worker/cuda_graphs.py``). Building each from its own Python list would cost a list, a
tensor and a blocking copy apiece, every step. Instead the step writes them with numpy into
one int64 host buffer (page-locked on CUDA), ``send`` moves the written prefix to a device
buffer of the same size in one asynchronous copy, and device-side copies spread it into the
static buffers (casting where those are int32).

How it fails: it does not, given the rule it relies on: the host buffer (and any other
page-locked buffer copied with it, such as the block tables' host rows) is rewritten only
after ``begin`` returns, and ``begin`` waits for the copies recorded by the last ``sent``.
On the engine's rank 0 that wait ends at once (sampling copied the last step's ids to the
host, which waited for the whole step); a tensor-parallel worker, which does not sample, may
run a step ahead of its device and waits there instead of overwriting a pending copy.
"""

from __future__ import annotations

import numpy as np
import torch


class InputStaging:
    """``capacity`` int64 values on the host, mirrored on ``device`` (on a CPU device the
    host buffer is the device buffer)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.long, pin_memory=cuda)
        self.array: np.ndarray = self.host.numpy()
        """The host buffer as numpy: where a step writes its inputs."""
        self._device = torch.zeros(capacity, dtype=torch.long, device=device) if cuda else None
        self._copied = torch.cuda.Event() if cuda else None
        self._pending = False

    def begin(self) -> np.ndarray:
        """The host buffer, once the copies the last ``sent`` recorded have finished."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False
        return self.array

    def send(self, length: int) -> torch.Tensor:
        """The first ``length`` values on the device (copied there without blocking the host
        on CUDA; the host buffer itself on the CPU)."""
        if self._device is None:
            return self.host[:length]
        target = self._device[:length]
        target.copy_(self.host[:length], non_blocking=True)
        return target

    def sent(self) -> None:
        """Marks the end of a step's copies from page-locked host memory: the next ``begin``
        waits for them."""
        if self._copied is not None:
            self._copied.record()
            self._pending = True
