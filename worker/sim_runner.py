"""The simulated engine's forward pass: ``SimModelRunner`` and ``SimSampler``.

With ``EngineConfig.engine = "sim"`` the ``LLMEngine`` is the real one (scheduler, block pool
and its token-compared prefix cache, host tier, KV events, stats, preemption, in-flight
dedup, KV export and import, stop checks, detokenizing); only the model is simulated, the way
NVIDIA Dynamo's mocker and llm-d's inference simulator stand in for a GPU:

- **Time.** ``execute`` builds the step's inputs as the real runner does and returns; the
  sampler then waits until the forward pass has taken what the profile predicts
  (``worker/sim_model.py``) since the launch, so the engine sees a device of the profile's
  speed, host work between the launch and the sampling overlaps the pass as it does on a GPU,
  and the rest costs what it costs.
- **Tokens.** The simulated model is certain of one next token, ``pseudo_token``: a hash of
  the prompt and the position (and, for a sampled request, of its seed and choice index, as
  the real sampler's key is). Greedy outputs are therefore the same in any batch, after any
  preemption, with or without cache hits, and on any replica, so a stream resumed elsewhere
  goes on with the same tokens. ``SimSampler`` takes that token as it is for every plain row;
  a row with a grammar, logprobs, a logit bias, penalties or an unmet ``min_tokens`` gets a
  logits row certain of it (``SIM_LOGIT`` for the token, 0 for the rest) and the real
  sampler's treatment.
- **KV.** A real cache tensor of one layer, one head and one element per token, in the block-
  major layout: K holds each slot's token id, V its position. Export, import and the host tier
  move these bytes with the real code (a payload from a real engine is refused by its shape);
  ``kv_bytes_per_token`` of the profile sizes the cache in the simulated model's bytes.
- **LoRA.** Adapters are read and checked against the served model's shape as the real
  engine does, and take device slots the same way (``worker/lora.py``); filling a slot waits
  the adapter's bytes over the profile's host-to-device rate, and an adapter's requests get
  their own pseudo-tokens. The adapters' arithmetic in a step is not priced.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from array import array
from dataclasses import dataclass

import torch
import xxhash

from worker.config import EngineConfig
from worker.lora import AdapterWeights, make_manager
from worker.model_runner import explicit_kv_blocks, host_kv_blocks
from worker.models.llama import ModelSpec
from worker.parallel.communicator import SINGLE_RANK
from worker.parallel.step_message import inputs_of
from worker.request import Request
from worker.sampler import Sampler, SampleResult, sampling_key
from worker.scheduler import ScheduledBatch
from worker.sim_model import SimProfile

SIM_LOGIT = 30.0
"""The logit of the simulated model's token in a materialized row (the rest are 0): certain
enough that every sampling setting picks it unless a mask, bias or penalty moves it."""


@dataclass(frozen=True)
class SimOps:
    """The part of a ``KernelBackend`` that KV transfer reads: the cache layout."""

    name: str = "sim"
    head_major_cache: bool = False


_prompt_digests: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()


def _prompt_digest(req: Request) -> int:
    digest = _prompt_digests.get(req)
    if digest is None:
        digest = xxhash.xxh64_intdigest(array("q", req.prompt_token_ids).tobytes())
        _prompt_digests[req] = digest
    return digest


def pseudo_token(req: Request, position: int, num_token_ids: int) -> int:
    """The simulated model's token at ``position`` (0-based over prompt and outputs) of
    ``req``: a function of the prompt and the position only, plus the LoRA adapter's name
    when it has one, and the seed and choice index for a sampled request."""
    key = _prompt_digest(req) ^ position
    if req.lora_name is not None:
        key ^= xxhash.xxh64_intdigest(req.lora_name.encode()) << 1
    if not req.params.greedy:
        key ^= sampling_key(req.seed, req.index, position) << 1
    return xxhash.xxh64_intdigest(key.to_bytes(16, "little", signed=False)) % num_token_ids


@dataclass
class SimLogits:
    """A step's "logits": the simulated model's token per sampling row, and materialized rows
    for the extra rows (prompt logprobs) that follow them."""

    tokens: list[int]
    extra: torch.Tensor | None
    vocab_size: int
    ready_at_s: float = 0.0
    """``time.perf_counter()`` at which the simulated forward pass ends: reading the tokens
    waits for it, as reading a GPU's logits waits for its step."""

    def __getitem__(self, rows: slice):
        """``[n:]`` the extra rows (a tensor), ``[:n]`` the sampling rows alone."""
        if rows.stop is None:
            return self.extra
        return SimLogits(self.tokens[rows], None, self.vocab_size, self.ready_at_s)

    def wait(self) -> None:
        """Sleeps until the simulated forward pass ends."""
        wait_s = self.ready_at_s - time.perf_counter()
        if wait_s > 0:
            time.sleep(wait_s)


def certain_row(token: int, vocab_size: int) -> torch.Tensor:
    row = torch.zeros(vocab_size)
    row[token] = SIM_LOGIT
    return row


class SimSampler(Sampler):
    """The real sampler over the simulated model's certainty; see the module docstring."""

    def sample(self, logits: SimLogits, requests: list[Request]) -> list[SampleResult]:
        logits.wait()
        results = []
        for token, req in zip(logits.tokens, requests, strict=True):
            if self._plain(req):
                results.append(SampleResult(token, None))
            else:
                results.append(self._sample_row(certain_row(token, logits.vocab_size), req))
        return results

    @staticmethod
    def _plain(req: Request) -> bool:
        p = req.params
        return (
            req.grammar is None
            and p.logprobs is None
            and not p.logit_bias
            and not p.needs_penalties
            and len(req.output_token_ids) >= p.min_tokens
        )


class SimModelRunner:
    """``ModelRunner``'s interface over the timing model and a one-element-per-token cache."""

    def __init__(
        self,
        config: EngineConfig,
        spec: ModelSpec,
        max_model_len: int,
        profile: SimProfile,
        num_token_ids: int,
    ) -> None:
        """``spec``: the served model's shape (its vocabulary); ``num_token_ids``: how many
        ids the tokenizer knows (pseudo-tokens stay below it)."""
        self.config = config
        self.profile = profile
        self.vocab_size = spec.vocab_size
        self.num_token_ids = min(num_token_ids, spec.vocab_size)
        self.spec = dataclasses.replace(spec, num_layers=1, num_kv_heads=1, head_dim=1)
        """The cache's shape, which KV payloads carry and check."""
        self.comm = SINGLE_RANK
        self.ops = SimOps()
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_blocks = self._decide_num_blocks()
        self.kv = torch.zeros(1, 2, self.num_blocks, self.block_size, 1, 1)
        self.host_kv: torch.Tensor | None = None
        self.num_host_blocks = host_kv_blocks(config, self.bytes_per_block)  # simulated bytes
        if self.num_host_blocks:
            self.host_kv = torch.zeros(self.num_host_blocks, 1, 2, self.block_size, 1, 1)
        self._load_s = 0.0
        self._owed_load_s = 0.0
        """Host-tier and adapter loads since the last step: the next forward pass waits for
        them."""
        self.lora = make_manager(
            config, spec, torch.device("cpu"), lambda weight: weight, load_seconds=self._lora_load_s
        )
        self.waits_for_device = True
        """False: a step returns as soon as its host work is done, without waiting out the
        forward pass's predicted time (``bench/engine_host.py`` measures host work so)."""
        self._device_free_at_s = 0.0
        """When the simulated device ends the last pass launched (``time.perf_counter()``)."""

    def _lora_load_s(self, adapter: AdapterWeights) -> float:
        """A slot's fill on the simulated device: the adapter's bytes over the profile's
        host-to-device rate."""
        return adapter.num_bytes / self.profile.host_to_device_bytes_per_s

    kv_cache_dtype = "float32"
    """What the one-element-per-token cache holds (its sizing uses the profile's bytes)."""

    @property
    def bytes_per_block(self) -> int:
        """One block of the simulated model's KV (what the byte knobs are divided by)."""
        return self.profile.kv_bytes_per_token * self.block_size

    def _decide_num_blocks(self) -> int:
        """``num_kv_blocks`` or ``kv_cache_bytes`` (in the simulated model's bytes) as the
        real runner takes them; else the profile's capacity, no more than every running
        sequence could fill at full length (plus slack), as the real runner caps a fraction."""
        explicit = explicit_kv_blocks(self.config, self.bytes_per_block)
        if explicit is not None:
            return explicit
        blocks = self.profile.kv_capacity_tokens // self.block_size
        return int(min(blocks, self.config.max_num_seqs * self.max_blocks_per_seq + 64))

    # -- host tier (worker/host_cache.py's KVMover) --------------------------------------------
    def save(self, block_id: int, slot: int) -> None:
        self.host_kv[slot].copy_(self.kv[:, :, block_id])

    def load(self, slot: int, block_id: int) -> None:
        self.kv[:, :, block_id].copy_(self.host_kv[slot])
        seconds = self.bytes_per_block / self.profile.host_to_device_bytes_per_s
        self._load_s += seconds
        self._owed_load_s += seconds

    @property
    def load_seconds_total(self) -> float:
        """Simulated seconds spent bringing host-tier blocks onto the device, since start."""
        return self._load_s

    # -- the step --------------------------------------------------------------------------------
    def execute(
        self, batch: ScheduledBatch, extra_rows: list[int] | None = None
    ) -> tuple[SimLogits, list[int]]:
        """``ModelRunner.execute``: writes the step's tokens into the cache and returns the
        simulated model's tokens for the sampling rows (and certain rows for ``extra_rows``),
        ready when the forward pass's predicted time since the call has passed: sampling them
        waits for it (``SimLogits.wait``), as a GPU step's launch returns at once and the
        sampler's copy of its ids waits for the device."""
        start_s = time.perf_counter()
        inputs, sampling_idx = inputs_of(batch)
        if inputs.fed_rows:  # tokens in flight: the step before's, taken from its tokens
            before = inputs.fed_ids.tokens
            for row, src in zip(inputs.fed_rows, inputs.fed_src, strict=True):
                inputs.token_ids[row] = before[src]
        bs = self.block_size
        slots: list[int] = []
        positions: list[int] = []
        row_owner: list[tuple[Request, int]] = []  # flat row -> (request, its position)
        prefill_tokens = decode_seqs = decode_context = 0
        for req, table, begin, count in zip(
            batch.requests, inputs.tables, inputs.starts, inputs.counts, strict=True
        ):
            if count == 1:
                slots.append(table[begin // bs] * bs + begin % bs)
                positions.append(begin)
            else:
                span = range(begin, begin + count)
                slots.extend(table[p // bs] * bs + p % bs for p in span)
                positions.extend(span)
            if extra_rows:
                row_owner.extend((req, p) for p in range(begin, begin + count))
            if count == 1 and begin >= len(req.prompt_token_ids):
                decode_seqs += 1
                decode_context += begin + 1
            else:
                prefill_tokens += count
        if self.lora is not None and any(inputs.adapters):
            self.lora.slots_for(i for i in inputs.adapters if i)
            self._owed_load_s += sum(map(self._lora_load_s, self.lora.newly_loaded))
        flat = self.kv.view(2, -1)
        index = torch.tensor(slots, dtype=torch.long)
        flat[0].index_copy_(0, index, torch.tensor(inputs.token_ids, dtype=torch.float32))
        flat[1].index_copy_(0, index, torch.tensor(positions, dtype=torch.float32))
        tokens = [
            pseudo_token(batch.requests[i], batch.requests[i].num_known_tokens, self.num_token_ids)
            for i in sampling_idx
        ]
        extra = None
        if extra_rows:
            extra = torch.zeros(len(extra_rows), self.vocab_size)
            for row, flat_index in enumerate(extra_rows):
                req, position = row_owner[flat_index]
                extra[row, pseudo_token(req, position + 1, self.num_token_ids)] = SIM_LOGIT
        forward_s = self._owed_load_s + self.profile.step_seconds(
            prefill_tokens, decode_seqs, decode_context
        )
        self._owed_load_s = 0.0
        # One device: a pass launched while the last one runs (a step scheduled ahead of the
        # last one's tokens) starts when that one ends.
        ready_at_s = max(start_s, self._device_free_at_s) + forward_s
        self._device_free_at_s = ready_at_s
        ready_at_s = ready_at_s if self.waits_for_device else 0.0
        return SimLogits(tokens, extra, self.vocab_size, ready_at_s), sampling_idx
