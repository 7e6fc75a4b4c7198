"""What a KV pull carries between replicas: ``KVPayload`` and ``SharedKV``, and their pickling.

Apart from the export and import code (``worker/kv_transfer.py``, which needs torch and the
model runner) so that a replica that only relays a payload between its engine and a peer
unpickles it without loading them: a payload whose K/V travel as a shared-memory file
(``SharedKV``, same node) needs no torch at all; one that carries the bytes loads torch when
it is rebuilt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.protocol import BlockHash

if TYPE_CHECKING:
    import torch

KV_LAYOUT = "blocks,layers,kv,block_size,kv_heads,head_dim"
"""The payload's tensor layout, the same whatever the cache layout of either backend."""


class KVPayloadMismatchError(ValueError):
    """A payload this engine must not import (other model, block size, dtype, shape or tokens)."""


SHARED_KV_PREFIX = "prefixserve-kv-"
"""Name prefix of the shared-memory files that carry K/V between two engines of one node."""
SHARED_KV_TTL_S = 30.0
"""A ``SharedKV`` file its importer has not removed (it timed out or died first) is removed
this long after it was written: well past ``cluster.kv_pull.KV_PULL_TIMEOUT_S``."""


def default_shared_dir() -> str | None:
    """The node's shared-memory directory (``/dev/shm``), or None where there is none."""
    path = "/dev/shm"
    return path if os.path.isdir(path) and os.access(path, os.W_OK) else None


@dataclass(frozen=True)
class SharedKV:
    """K/V rows (``KV_LAYOUT``) in a file of a node-local shared-memory directory. Between two
    engines of one node a payload carries this name, not the bytes: the exporter writes the
    rows once, the importer maps them, and no process in between (the replicas, Ray) copies
    them. The importer removes the file (``load``); the exporting process removes it
    ``SHARED_KV_TTL_S`` after writing it in case nobody did (``write_shared``)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    """The rows' size, recorded by the writer: the replicas that pass the name on (and count
    its bytes) never import torch."""

    def load(self) -> torch.Tensor:
        """The rows, mapped from the file (not copied), which is removed: read once. Raises
        ``OSError`` when the file is gone (the exporter gave up on it)."""
        import torch

        numel = math.prod(self.shape)
        kv = torch.from_file(self.path, shared=False, size=numel, dtype=getattr(torch, self.dtype))
        remove_shared(self.path)
        return kv.view(self.shape)


def remove_shared(path: str) -> None:
    """Removes a ``SharedKV`` file; one already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass(frozen=True)
class KVPayload:
    model_id: str
    block_size: int
    dtype: str
    """How the K/V are stored (``ModelRunner.kv_cache_dtype``): a torch dtype name without the
    ``torch.`` prefix (``float32``), or an 8-bit format (``int8``, ``fp8_e4m3``: uint8 rows of
    ``head_dim + 2`` bytes, ``kernels/kv_quant.py``)."""
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_salt: str | None
    block_hashes: tuple[BlockHash, ...]
    token_ids: tuple[int, ...]
    """``block_size`` tokens per block, the blocks' stored tokens in chain order."""
    kv: torch.Tensor | SharedKV
    """CPU tensor in ``KV_LAYOUT``, or the shared-memory file holding it (same node)."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_bytes(self) -> int:
        if isinstance(self.kv, SharedKV):
            return self.kv.nbytes
        return self.kv.numel() * self.kv.element_size()

    def __reduce__(self):
        """Pickles the K/V as plain bytes: never through torch's shared-memory reductions, which
        ``multiprocessing`` connections would use and a peer process cannot open. A
        ``SharedKV`` pickles as its name."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "kv"}
        if isinstance(self.kv, SharedKV):
            return _rebuild_shared_payload, (fields, self.kv)
        import torch  # the K/V is a tensor: torch is loaded already

        kv = self.kv.detach().to("cpu").contiguous()
        raw = kv.view(torch.uint8).numpy().tobytes() if kv.numel() else b""
        return _rebuild_payload, (fields, raw, dtype_name(kv.dtype), tuple(kv.shape))


def _rebuild_shared_payload(fields: dict, kv: SharedKV) -> KVPayload:
    return KVPayload(**fields, kv=kv)


def _rebuild_payload(fields: dict, raw: bytes, dtype: str, shape: tuple[int, ...]) -> KVPayload:
    import torch

    torch_dtype = getattr(torch, dtype)
    if not raw:
        return KVPayload(**fields, kv=torch.empty(shape, dtype=torch_dtype))
    kv = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch_dtype).reshape(shape)
    return KVPayload(**fields, kv=kv)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
