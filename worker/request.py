"""``Request``: one sequence's state inside the engine.

A request only knows how many of its tokens have KV computed (``num_computed_tokens``), in
the style of vLLM v1: a prefill chunk, a decode and a recompute after preemption are all
"compute the next k tokens". A user request with ``n > 1`` becomes ``n`` sequences that share
the prompt's blocks through the prefix cache; the scheduler's in-flight dedup holds siblings
after the first back until it has computed the prompt, so the shared blocks are computed once.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Sequence

from router.protocol import BlockHash, hash_blocks
from worker.block_pool import Block
from worker.sampling_params import SamplingParams
from worker.structured_output import GrammarMatcher
from worker.tokenizer import IncrementalDetokenizer


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (``a >= 0``, ``b > 0``): e.g. how many blocks ``a`` tokens fill."""
    return -(-a // b)


NEVER = 1 << 62
"""A count of outputs no sequence reaches."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    __slots__ = (
        "request_id", "index", "prompt_token_ids", "all_token_ids", "output_token_ids",
        "params", "lora_name", "lora_id", "seed", "block_size", "status",
        "num_computed_tokens", "num_cached_tokens", "num_cached_tokens_seen", "blocks",
        "block_ids", "detokenizer", "max_total_tokens", "output_counts", "_counts_outputs",
        "logprobs", "prompt_logprobs", "finish_reason", "stop_reason", "arrival_time",
        "first_token_time", "first_scheduled_time", "num_preemptions", "num_prefill_skips",
        "num_resumed_tokens", "grammar", "_salt", "block_hashes", "num_in_flight",
        "in_flight_row", "greedy_from", "drawn_from", "__weakref__",
    )  # fmt: skip
    """Every step reads a running request's fields: slots keep those reads short."""

    def __init__(
        self,
        *,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        block_size: int,
        model_id: str,
        cache_salt: str | None,
        detokenizer: IncrementalDetokenizer | None,
        max_total_tokens: int,
        lora_name: str | None = None,
        lora_id: int = 0,
    ):
        """``model_id`` is the block-hash namespace (the adapter's, for a LoRA request:
        ``router.protocol.adapter_namespace``); ``lora_id`` the adapter's id in the engine's
        ``LoRAManager`` (0: the base model)."""
        self.request_id = request_id
        self.index = index
        """Which of the user request's ``n`` outputs this is."""
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.seed = seed
        self.block_size = block_size
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        """Prompt tokens served by the prefix cache at first admission."""
        self.num_cached_tokens_seen = 0
        """While waiting: the prompt tokens the prefix cache held for it when the scheduler
        last ranked it (shortest-first order ranks the waiting requests it may admit); what
        the replica's stats leave out of its queued prefill tokens."""
        self.blocks: list[Block] = []
        self.block_ids: list[int] = []
        """``blocks``' ids, kept beside them by the scheduler (what each step's block table
        reads, without walking the blocks)."""
        self.detokenizer = detokenizer
        self.max_total_tokens = max_total_tokens
        self.output_counts: Counter[int] = Counter()
        """How often each token was sampled; kept only for the penalties that read it."""
        self._counts_outputs = bool(params.presence_penalty or params.frequency_penalty)
        self.logprobs: list = []
        self.prompt_logprobs: list | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None
        )
        """Entries for the prompt's tokens so far (None for the first), when asked for; only
        output 0 of a group collects them, the prompt being the same for all."""
        self.finish_reason = None
        self.stop_reason: str | int | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None
        """When the scheduler first admitted it (``time.monotonic()``); kept across preemption."""
        self.num_preemptions = 0
        self.num_prefill_skips = 0
        """Steps in which a younger request's prefill overtook this one (``scheduler.py``)."""
        self.num_resumed_tokens = 0
        """Outputs another replica streamed before it died (``resume``): a client is waiting
        mid-stream, so the scheduler puts it first, as it does its own preempted requests."""
        self.num_in_flight = 0
        """Tokens sampled on the device that the host has not appended yet (0 or 1): a step
        scheduled ahead of them (``EngineConfig.async_scheduling``) computes past them."""
        self.in_flight_row = 0
        """With a token in flight: its row in the sampled ids of the step that took it."""
        self.greedy_from = (
            params.min_tokens
            if params.greedy and not params.needs_penalties and not params.logit_bias
            else NEVER
        )
        """From this many outputs on (``min_tokens``, whose EOS ban ends there), a token of
        this sequence is its logits' plain argmax, unless a grammar (set later) constrains
        it: what ``Sampler.plain_greedy`` and a step taken on the device check."""
        self.drawn_from = (
            params.min_tokens
            if not params.greedy and not params.needs_penalties and not params.logit_bias
            else NEVER
        )
        """From this many outputs on, a token of this sequence is drawn from its logits by
        its temperature and filters alone, unless a grammar constrains it: such rows are
        drawn together on the logits' device (``Sampler.plain_drawn``)."""
        self.grammar: GrammarMatcher | None = None
        """Structured output: the grammar state, advanced by each appended token (rank 0 only)."""
        self._salt = (model_id, cache_salt)
        self.block_hashes: list[BlockHash] = hash_blocks(
            prompt_token_ids, block_size, model_id, cache_salt
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs still to collect: the prompt must be computed, not taken from the
        prefix cache (whose hits carry no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def resume(self, token_ids: Sequence[int]) -> None:
        """Takes ``token_ids`` as outputs already sampled and streamed elsewhere (by a replica
        that died mid-stream): appended as this request's own, so penalties, stop checks,
        ``max_tokens``, the grammar and the position-keyed sampler go on as if it had sampled
        them. Their text is taken out of the detokenizer: the client has it already."""
        self.num_resumed_tokens += len(token_ids)
        for token_id in token_ids:
            self.append_token(token_id)
            if self.detokenizer is not None:
                self.detokenizer.add_token(token_id)
            if self.grammar is not None:
                self.grammar.advance(token_id)
        if self.detokenizer is not None:
            self.detokenizer.take_delta(False)
        self.prompt_logprobs = None  # sent with the first stream's first output

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self._counts_outputs:
            self.output_counts[token_id] += 1
        if len(self.all_token_ids) % self.block_size == 0:
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        """Hash blocks that generated tokens have just filled, continuing the chain."""
        done = len(self.block_hashes)
        parent = self.block_hashes[-1] if done else None
        model_id, salt = self._salt
        self.block_hashes += hash_blocks(
            self.all_token_ids, self.block_size, model_id, salt, parent=parent, start_block=done
        )

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose KV a step may compute: those appended and the one in flight."""
        return len(self.all_token_ids) + self.num_in_flight

    def ends_with_in_flight(self) -> bool:
        """The token in flight is the last ``max_tokens`` or the context allows: no step
        needs to run past it."""
        if not self.num_in_flight:
            return False
        limit = self.params.max_tokens
        if limit is not None and len(self.output_token_ids) + 1 >= limit:
            return True
        return len(self.all_token_ids) + 1 >= self.max_total_tokens

    def max_tokens_reached(self) -> bool:
        limit = self.params.max_tokens
        if limit is not None and len(self.output_token_ids) >= limit:
            return True
        return len(self.all_token_ids) >= self.max_total_tokens
