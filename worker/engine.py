"""``LLMEngine``: the synchronous core. Add requests, call ``step()``, read outputs.

One step = schedule -> run the model -> sample -> update requests (stop checks,
detokenisation, block caching) -> KV events. Bad input is rejected in ``add_request`` with a
``ValueError`` before the request touches any engine state, so it can never harm the others.
The async wrapper (``worker/async_engine.py``) drives ``step()`` from a background thread.

With ``tensor_parallel_size`` > 1 the engine is rank 0: it starts the other ranks through a
``WorkerLauncher`` (local processes unless the caller passes one, e.g. Ray actors), runs its
own shard, and sends each step to the others. A rank that dies makes ``step()`` raise and
``dead_tp_ranks()`` non-empty; ``shutdown()`` ends the workers. An engine that is garbage-
collected, or still open when the interpreter exits, ends them too (a ``weakref.finalize``
that stops the group quietly), so a script that never calls ``shutdown()`` exits cleanly.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Iterator, Sequence

import torch

from router.protocol import (
    BlockHash,
    KVEventBatch,
    ReplicaStats,
    adapter_namespace,
    cache_namespace,
)
from worker import kv_transfer
from worker.block_pool import BlockPool
from worker.config import EngineConfig
from worker.cpu_runtime import configure_cpu_allocator
from worker.loader import load_tokenizer, load_weights, resolve_engine_model
from worker.metrics import EngineMetrics, EngineMetricsSnapshot, HostTierMetrics
from worker.model_runner import ModelRunner
from worker.models.llama import ModelSpec
from worker.outputs import (
    EngineOverloadedError,
    FinishReason,
    OutputDelta,
    RequestOutput,
)
from worker.parallel.sharding import ShardPlan, load_shard, read_spec
from worker.parallel.workers import (
    LocalProcessLauncher,
    TensorParallelGroup,
    WorkerLauncher,
    threads_per_rank,
)
from worker.prompt_logprobs import prompt_logit_rows, record_prompt_logprobs
from worker.request import Request, Status
from worker.request_checks import check_resume, validate_request
from worker.sampler import SampledIds, Sampler, SampleResult
from worker.sampling_params import SamplingParams
from worker.scheduler import Scheduler
from worker.sim_model import load_profile
from worker.sim_runner import SimModelRunner, SimSampler
from worker.step_outputs import (
    AdvancedRequest,
    LaunchedStep,
    StepDelta,
    cumulative_output,
    decode_text,
    output_delta,
    output_deltas,
)
from worker.structured_output import GrammarCompiler
from worker.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

DEAD_RANK_GRACE_S = 1.0
"""After a failed tensor-parallel step, how long to wait for a worker's exit to show before
saying a rank stopped answering without naming it."""


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        replica_id: str = "replica-0",
        launcher: WorkerLauncher | None = None,
    ):
        """``launcher`` starts tensor-parallel ranks 1..N-1; default: local processes."""
        config = config.resolved()  # device/dtype "auto" made concrete here, where the engine runs
        tp = config.tensor_parallel_size
        if config.device == "cpu":
            configure_cpu_allocator()
        if tp > 1 and config.device == "cpu":
            torch.set_num_threads(threads_per_rank(config))  # the cores are split between ranks
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.tp: TensorParallelGroup | None = None
        self._tp_finalizer: weakref.finalize | None = None
        t0 = time.perf_counter()
        resolved = resolve_engine_model(config)
        self.config = config
        self.replica_id = replica_id
        self.model_id = config.model_id or resolved.model_id
        self.cache_namespace = cache_namespace(self.model_id, config.kv_cache_dtype)
        """What block hashes are seeded with: the model id, and an 8-bit KV format's name."""
        self.max_model_len = min(
            config.max_model_len or resolved.max_model_len, resolved.max_model_len
        )
        if config.max_model_len and config.max_model_len > resolved.max_model_len:
            raise ValueError(
                f"EngineConfig.max_model_len: {config.max_model_len} exceeds the model's context "
                f"({resolved.max_model_len})"
            )
        self.model_path = resolved.path
        self.tokenizer = load_tokenizer(config, model_path=resolved.path, chat_template=False)
        if self.tokenizer.token_text is None:  # built now, not inside a request's first step
            log.info("detokenizing by windows of decoded tokens (not a byte-level tokenizer)")
        simulated = config.engine == "sim"
        if simulated:
            spec = read_spec(resolved.path)
            self.runner = SimModelRunner(
                config,
                spec,
                self.max_model_len,
                load_profile(config.sim_profile),
                self.tokenizer.vocab_size,
            )
        elif tp == 1:
            spec, weights = load_weights(resolved.path, config.torch_dtype)
            self.runner = ModelRunner(config, spec, weights, self.max_model_len)
        else:
            spec = self._start_tensor_parallel(
                resolved.path, launcher or LocalProcessLauncher(), replica_id
            )
        self.spec = spec
        self.block_size = config.block_size
        self.pool = BlockPool(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        if self.runner.host_kv is not None:
            self.pool.attach_host(self.runner.num_host_blocks, self.runner)
        self.scheduler = Scheduler(config, self.pool)
        self.sampler = (SimSampler if simulated else Sampler)(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, spec.vocab_size)
        self.metrics = EngineMetrics()
        self._groups: dict[str, list[Request]] = {}
        self._event_seq = itertools.count()
        self.replica_epoch = time.time_ns()
        """Changes whenever an engine starts, so an index drops what a previous run announced."""
        self._kv_batches: list[KVEventBatch] = []
        self._unseeded = itertools.count()
        self._seqs_ended = 0
        """Sequences ended outside the sampling of the step they run in (aborts, and stop
        checks that ran while the next step was in flight), counted: a step in flight when
        it moved leaves the ended sequences out (``sample_step``)."""
        self.overlaps_outputs = config.overlap_outputs == "on" or (
            config.overlap_outputs == "auto" and (simulated or config.device.startswith("cuda"))
        )
        """Whether ``EngineLoop`` launches the next step before sending this one's outputs
        (``EngineConfig.overlap_outputs``)."""
        self.schedules_ahead = (
            self.overlaps_outputs
            and self.tp is None
            and (config.async_scheduling == "on" or config.async_scheduling == "auto" and simulated)
        )
        """Whether a step of plain greedy sequences lets the next one be scheduled and
        launched before its tokens reach the host (``EngineConfig.async_scheduling``)."""
        self._simulated = simulated
        on_cuda = config.device.startswith("cuda") and not simulated
        self._sampled_hosts = [
            torch.empty(config.max_num_seqs, dtype=torch.long, pin_memory=True)
            for _ in range(2 if self.schedules_ahead and on_cuda else 0)
        ]
        """Two page-locked buffers the sampled ids of consecutive steps are copied into."""
        self._steps_launched = 0
        log.info(
            "engine %s ready: %s in %.1fs, %d KV blocks (%d tokens), deterministic=%s%s",
            replica_id,
            self.model_id,
            time.perf_counter() - t0,
            self.pool.num_blocks,
            self.pool.num_blocks * self.block_size,
            config.deterministic,
            f", simulated ({self.runner.profile.name}: {self.runner.profile.description})"
            if simulated
            else "",
        )

    def _start_tensor_parallel(
        self, model_path: str, launcher: WorkerLauncher, replica_id: str
    ) -> ModelSpec:
        config = self.config
        ShardPlan.make(
            read_spec(model_path), 0, config.tensor_parallel_size
        )  # sizes fail before any worker starts
        self.tp = TensorParallelGroup.start(
            config, model_path, self.max_model_len, launcher, replica_id
        )
        # Stops the group when this engine is collected or at interpreter exit, if shutdown()
        # did not; the callback holds the group only, never the engine.
        self._tp_finalizer = weakref.finalize(self, self.tp.stop)
        try:
            spec, plan, weights = load_shard(
                model_path, config.torch_dtype, 0, config.tensor_parallel_size
            )
            self.runner = ModelRunner(
                config,
                plan.local_spec(spec),
                weights,
                self.max_model_len,
                self.tp.comm,
                plan.vocab_start,
                full_spec=spec,
                shard=plan,
            )
        except BaseException:
            self._tp_finalizer()
            raise
        return spec

    def dead_tp_ranks(self) -> list[int]:
        """Tensor-parallel ranks whose worker has ended; always empty without TP."""
        return self.tp.dead_ranks() if self.tp is not None else []

    def _tp_failure(self, exc: BaseException) -> str:
        # A killed worker's sockets close while it exits, a moment before the OS reports it
        # ended (measured on a 16-core machine): wait that moment for the name of the rank.
        deadline_s = time.monotonic() + DEAD_RANK_GRACE_S
        while not (dead := self.dead_tp_ranks()) and time.monotonic() < deadline_s:
            time.sleep(0.01)
        if dead:
            return f"worker rank(s) {dead} ended"
        detail = str(exc).split(". ", 1)[0][:200]  # gloo's first sentence names the peer
        return f"a worker rank stopped answering ({detail})"

    def shutdown(self) -> None:
        """Ends the tensor-parallel workers (nothing to do without TP). Idempotent."""
        if self._tp_finalizer is not None:
            self._tp_finalizer()  # runs tp.stop once; later calls (and the GC) do nothing

    # -- requests ----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(
            prompt_token_ids,
            params,
            vocab_size=self.spec.vocab_size,
            max_model_len=self.max_model_len,
            kv_capacity_tokens=self.pool.num_blocks * self.block_size,
        )
        if self.tp is not None and params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs is not supported with tensor parallelism "
                "(tensor_parallel_size > 1)"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        resume_token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> None:
        """Queues a request. ``resume_token_ids``: outputs another replica already streamed
        before it died (stream failover, ``n == 1``): the request goes on after them.
        ``lora_name``: the LoRA adapter it runs on (None: the base model); an adapter this
        engine does not know is a ``ValueError``."""
        self.validate(prompt_token_ids, params)
        lora_id = self._lora_id(lora_name)
        if resume_token_ids:
            check_resume(
                prompt_token_ids,
                params,
                resume_token_ids,
                vocab_size=self.spec.vocab_size,
                max_model_len=self.max_model_len,
            )
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self.scheduler.waiting) + params.n > self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"{len(self.scheduler.waiting)} requests waiting "
                f"(limit {self.config.max_waiting_requests})"
            )
        seed = (
            params.seed
            if params.seed is not None
            else hash((self.config.seed, next(self._unseeded)))
        )
        constraint = params.structured_output
        grammar = (
            self.grammars.matcher(constraint) if constraint is not None else None
        )  # compiles before any state changes
        group = []
        for i in range(params.n):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            req = Request(
                request_id=request_id,
                index=i,
                prompt_token_ids=list(prompt_token_ids),
                params=params,
                seed=seed,
                block_size=self.block_size,
                model_id=adapter_namespace(self.cache_namespace, lora_name),
                cache_salt=cache_salt,
                detokenizer=detok,
                max_total_tokens=self.max_model_len,
                lora_name=lora_name,
                lora_id=lora_id,
            )
            if constraint is not None:
                req.grammar = grammar if i == 0 else self.grammars.matcher(constraint)
            if resume_token_ids:
                req.resume(resume_token_ids)
            group.append(req)
            self.scheduler.add(req)
        self._groups[request_id] = group
        self.metrics.prompt_tokens_total += len(prompt_token_ids)

    # -- LoRA adapters (worker/lora.py) ------------------------------------------------------
    def _lora_id(self, lora_name: str | None) -> int:
        if lora_name is None:
            return 0
        manager = self.runner_lora
        lora_id = manager.id_of(lora_name) if manager is not None else None
        if lora_id is None:
            known = ", ".join(manager.names) if manager is not None else "LoRA is off"
            raise ValueError(f"unknown LoRA adapter {lora_name!r} (known: {known or 'none'})")
        return lora_id

    @property
    def runner_lora(self):
        """The runner's ``LoRAManager``, or None without ``enable_lora``."""
        return self.runner.lora

    def lora_adapters(self) -> dict[str, str]:
        """Every adapter this engine serves: name -> the folder it was read from."""
        manager = self.runner_lora
        if manager is None:
            return {}
        return {name: manager.adapter(name).path for name in manager.names}

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Registers adapter ``name`` from the PEFT folder ``path`` (host memory; a device
        slot when a request needs it). The same name and path again is a no-op."""
        manager = self.runner_lora
        if manager is None:
            raise ValueError("LoRA is off: start the engine with enable_lora")
        if self.tp is not None:
            raise ValueError(
                "loading adapters at runtime is not supported with tensor parallelism; "
                "list them in lora_modules"
            )
        if name == self.model_id:
            raise ValueError(f"adapter name {name!r} is the base model's name")
        manager.add(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Forgets adapter ``name``; refused while requests on it are queued or running."""
        manager = self.runner_lora
        if manager is None or manager.id_of(name) is None:
            raise KeyError(name)
        if self.tp is not None:
            raise ValueError("unloading adapters is not supported with tensor parallelism")
        busy = sum(1 for group in self._groups.values() if group and group[0].lora_name == name)
        if busy:
            raise ValueError(f"LoRA adapter {name!r} has {busy} request(s) in flight; retry later")
        manager.remove(name)

    def _own_namespace(self, model_id: str) -> bool:
        manager = self.runner_lora
        names = manager.names if manager is not None else ()
        return model_id == self.cache_namespace or any(
            model_id == adapter_namespace(self.cache_namespace, n) for n in names
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends ``request_id`` (its unfinished choices with ``FinishReason.ABORT``); its final
        cumulative output, or None when it is not running."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        self._end_group(group)
        return cumulative_output(request_id, group, {}, finished=True)

    def abort_delta(self, request_id: str) -> OutputDelta | None:
        """``abort`` for a streaming caller: the delta that ends the request's unfinished
        choices (None when it is not running)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        ended = self._end_group(group)
        return output_delta(request_id, group, {req: StepDelta() for req in ended}, finished=True)

    def _end_group(self, group: list[Request]) -> list[Request]:
        """Finishes the group's unfinished sequences with ``ABORT``; returns them."""
        ended = [req for req in group if not req.is_finished]
        self._seqs_ended += 1
        for req in ended:
            self.scheduler.finish(req)
            req.finish_reason = req.finish_reason or FinishReason.ABORT
        return ended

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; the cumulative output of every request it touched (offline callers)."""
        advanced = self._advance()
        self._decode_text(advanced)
        return [cumulative_output(*request) for request in advanced]

    def steps(self) -> Iterator[list[RequestOutput]]:
        """Steps until no request is unfinished, yielding what each step gives (as ``step``
        does) for offline callers that add no requests meanwhile. With ``overlaps_outputs``
        each step is launched before the outputs of the one before are built, so building
        them runs while the device computes."""
        if not self.overlaps_outputs:
            while self.has_unfinished():
                yield self.step()
            return
        in_flight = None
        while in_flight is not None or self.has_unfinished():
            advanced, in_flight = self.advance_overlapped(in_flight)
            self._decode_text(advanced)
            yield [cumulative_output(*request) for request in advanced]

    def advance_overlapped(
        self, in_flight: LaunchedStep | None
    ) -> tuple[list[AdvancedRequest], LaunchedStep | None]:
        """Samples ``in_flight`` (if a step is), then launches the next step if any request
        is unfinished: (what the sampled step did, its text not yet decoded; the step now in
        flight). Decoding and building that step's outputs after this call overlaps them
        with the next forward pass."""
        if in_flight is not None and in_flight.runs_ahead and self.has_unfinished():
            # Scheduled ahead: the next step takes this one's tokens on the device, and the
            # host appends them and checks stops while that step computes.
            launched = self.launch_step(ahead_of=in_flight)
            return self.sample_step(in_flight), launched
        advanced = self.sample_step(in_flight) if in_flight is not None else []
        return advanced, self.launch_step() if self.has_unfinished() else None

    def step_deltas(self) -> list[OutputDelta]:
        """One step; what it added to each request it advanced or ended (streaming callers:
        ``EngineLoop``). A prefill chunk that sampled nothing yields no delta."""
        return self.deltas_of(self._advance())

    @staticmethod
    def deltas_of(advanced: list[AdvancedRequest]) -> list[OutputDelta]:
        """The ``OutputDelta`` of each request in ``advanced`` (``sample_step``'s) that got a
        token or ended, its new tokens' text decoded first."""
        return output_deltas(advanced)

    def _advance(self) -> list[AdvancedRequest]:
        """Schedules and runs one step: (request id, its group, what the step added to each
        sampled sequence, whether the group is done) per request the step touched; the new
        tokens' text not yet decoded (``_decode_text``)."""
        launched = self.launch_step()
        return [] if launched is None else self.sample_step(launched)

    def launch_step(self, ahead_of: LaunchedStep | None = None) -> LaunchedStep | None:
        """Schedules a step and launches its forward pass: on a CUDA device (and the
        simulated one) the pass runs on while the host goes on, until ``sample_step`` waits
        for it. None when nothing is runnable. ``ahead_of``: a step in flight whose tokens
        the host has not seen (its ``runs_ahead``): its computed tokens are counted first,
        and each of its sequences' token in flight is fed from its sampled ids."""
        if ahead_of is not None:
            self._commit_ahead(ahead_of)
        batch = self.scheduler.schedule()
        if not batch:
            return None
        if ahead_of is not None:  # the simulated engine's "logits" hold its tokens
            batch.fed = ahead_of.sampled.ids if ahead_of.sampled is not None else ahead_of.logits
        started_s = time.perf_counter()
        try:
            prompt_rows, prompt_spans = prompt_logit_rows(batch)
            logits, sampling_idx = self.runner.execute(batch, prompt_rows)
        except RuntimeError as exc:
            if self.tp is None:
                raise
            raise RuntimeError(f"tensor-parallel step failed: {self._tp_failure(exc)}") from exc
        launched = LaunchedStep(
            batch, logits, sampling_idx, prompt_spans, started_s, self._seqs_ended
        )
        if self.schedules_ahead and not prompt_spans and self._all_plain(launched):
            launched.runs_ahead = True
            if not self._simulated:
                hosts = self._sampled_hosts
                host = hosts[self._steps_launched % 2] if hosts else None
                sampled = [batch.requests[i] for i in sampling_idx]
                launched.sampled = SampledIds(logits[: len(sampling_idx)], host, sampled)
        self._steps_launched += 1
        return launched

    @staticmethod
    def _all_plain(launched: LaunchedStep) -> bool:
        """Every sequence the step samples takes the argmax, or a draw by its temperature
        alone, and wants nothing else of its logits (no logprobs, penalties, bias, grammar or
        filters, ``min_tokens`` out). A filtered draw's answer may need the whole vocabulary
        (``worker/random_sampling.py``), which the host learns only by waiting for the
        device: such a step is sampled after its pass, not run ahead of."""
        requests = launched.batch.requests
        for i in launched.sampling_idx:
            req = requests[i]
            p = req.params
            if p.logprobs is not None or not (
                Sampler.plain_greedy(req) or (Sampler.plain_drawn(req) and not p.filters_tokens)
            ):
                return False
        return True

    def _commit_ahead(self, launched: LaunchedStep) -> None:
        """Before the step after ``launched`` is scheduled: counts ``launched``'s computed
        tokens and marks each sampling sequence as holding a token in flight, at its row of
        the step's sampled ids."""
        batch = launched.batch
        if self._seqs_ended != launched.seqs_ended:
            batch = batch.without_finished()
        self.scheduler.commit_computed(batch)
        launched.committed = True
        requests = launched.batch.requests
        for row, i in enumerate(launched.sampling_idx):
            req = requests[i]
            req.num_in_flight, req.in_flight_row = 1, row

    def sample_step(self, launched: LaunchedStep) -> list[AdvancedRequest]:
        """Waits for ``launched``'s forward pass, samples, appends each token with the stop
        checks and caches the blocks it filled: what the step did to each request, as
        ``_advance`` says. The text of a token is decoded here only for a sequence with stop
        strings (its stop check needs it); the others' waits for ``deltas_of``. A request
        that ended while the step was in flight (aborted, or stopped by the step before when
        this one was scheduled ahead of it) gets nothing from it."""
        batch = launched.batch
        logits, sampling_idx = launched.logits, launched.sampling_idx
        sampling_reqs = [batch.requests[i] for i in sampling_idx]
        if launched.prompt_spans:
            record_prompt_logprobs(logits[len(sampling_idx) :].cpu(), launched.prompt_spans)
            logits = logits[: len(sampling_idx)]
        if launched.sampled is not None:
            results = [SampleResult(token, None) for token in launched.sampled.tokens()]
        else:
            results = self.sampler.sample(logits, sampling_reqs)
        if launched.runs_ahead:
            for req in sampling_reqs:
                req.num_in_flight = 0
        if self._seqs_ended != launched.seqs_ended:  # a sequence ended while it ran
            batch = batch.without_finished()
            kept = [
                (req, res)
                for req, res in zip(sampling_reqs, results, strict=True)
                if req.status is not Status.FINISHED
            ]
            sampling_reqs, results = [req for req, _ in kept], [res for _, res in kept]
        if not launched.committed:
            self.scheduler.commit_computed(batch)
        now = time.monotonic()
        append = self._append
        added = {
            req: append(req, res, now) for req, res in zip(sampling_reqs, results, strict=True)
        }
        self.metrics.generation_tokens_total += len(added)
        self.metrics.record_step(batch, sampling_reqs, time.perf_counter() - launched.started_s)
        self._collect_events()
        return self._by_request(batch.requests, added)

    def _by_request(
        self, requests: list[Request], added: dict[Request, StepDelta]
    ) -> list[AdvancedRequest]:
        """What a step did to each request among ``requests`` (the batch's sequences), once
        per request in batch order; a request whose group is done leaves ``_groups``."""
        advanced = []
        groups = self._groups
        seen: set[str] = set()  # requests of several sequences already reported
        for req in requests:
            rid = req.request_id
            group = groups.get(rid)
            if group is None:  # ended while the step ran, or reported by a sibling
                continue
            if len(group) == 1:  # most requests: one sequence, once in the batch
                step = added.get(req)
                done = req.status is Status.FINISHED
                advanced.append((rid, group, {} if step is None else {req: step}, done))
            else:
                if rid in seen:
                    continue
                seen.add(rid)
                done = all(r.is_finished for r in group)
                advanced.append((rid, group, {r: added[r] for r in group if r in added}, done))
            if done:
                del groups[rid]
        return advanced

    @staticmethod
    def _decode_text(advanced: list[AdvancedRequest]) -> None:
        """Decodes the text of every new token ``sample_step`` left undecoded."""
        for _, _, new, _ in advanced:
            decode_text(new)

    def _append(self, req: Request, res: SampleResult, now: float) -> StepDelta:
        """Appends the sampled token to ``req``, applies the stop checks, returns the delta
        (its text still undecoded, None, unless a stop string needed it)."""
        token = res.token_id
        req.append_token(token)
        if res.logprob is not None:
            req.logprobs.append(res.logprob)
        is_first = req.first_token_time is None
        if is_first:
            req.first_token_time = now
        detokenizer = req.detokenizer
        stop_strings = detokenizer.has_stop_strings
        if stop_strings:
            detokenizer.add_token(token)
        self._check_stop(req, token)
        if req.grammar is not None and req.finish_reason is None and req.grammar.advance(token):
            req.finish_reason, req.stop_reason = FinishReason.STOP, None  # the grammar is complete
        if req.finish_reason is not None:
            self.scheduler.finish(req)
            self.metrics.record_finish(now - req.first_token_time)
            self._seqs_ended += 1  # a step scheduled ahead may hold it: it gets nothing
        if not stop_strings:
            return StepDelta([token], None, is_first)
        return StepDelta([token], detokenizer.take_delta(req.finish_reason is not None), is_first)

    def _check_stop(self, req: Request, token: int) -> None:
        """Sets ``finish_reason``/``stop_reason`` if ``token`` (just appended) ends ``req``.

        In order: EOS (unless ``ignore_eos``), a stop token id, a stop string (all three only
        once ``min_tokens`` are out), then ``max_tokens`` or the model's context.
        """
        p = req.params
        if len(req.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
                req.finish_reason, req.stop_reason = FinishReason.STOP, None
                return
            if token in p.stop_token_ids:
                req.finish_reason, req.stop_reason = FinishReason.STOP, token
                return
            if req.detokenizer.stop_reason is not None:
                req.finish_reason = FinishReason.STOP
                req.stop_reason = req.detokenizer.stop_reason
                return
        if req.max_tokens_reached():
            req.finish_reason = FinishReason.LENGTH

    # -- KV events and stats -----------------------------------------------------------------
    def _collect_events(self) -> None:
        events = self.pool.take_events()
        if events:
            self._kv_batches.append(
                KVEventBatch(
                    self.replica_id, next(self._event_seq), tuple(events), self.replica_epoch
                )
            )

    def drain_kv_events(self) -> list[KVEventBatch]:
        out, self._kv_batches = self._kv_batches, []
        return out

    # -- KV pulled from a peer replica (worker/kv_transfer.py) -------------------------------
    def export_prefix(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        shared_dir: str | None = None,
        lora_name: str | None = None,
    ) -> kv_transfer.KVPayload | None:
        """The leading blocks of this prefix held here (either tier), as a picklable payload;
        with ``shared_dir``, K/V in a shared-memory file there (``kv_transfer.SharedKV``).
        ``lora_name``: the adapter whose KV it is (None: the base model's)."""
        return kv_transfer.export_prefix(
            self.pool,
            self.runner,
            adapter_namespace(self.cache_namespace, lora_name),
            block_hashes,
            token_ids,
            cache_salt,
            shared_dir,
        )

    def export_device_prefix(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        shared_dir: str | None = None,
        lora_name: str | None = None,
    ) -> kv_transfer.KVPayload | None:
        """``export_prefix`` of the device pool alone, callable from another thread while this
        engine steps (``kv_transfer.export_device_prefix``)."""
        return kv_transfer.export_device_prefix(
            self.pool,
            self.runner,
            adapter_namespace(self.cache_namespace, lora_name),
            block_hashes,
            token_ids,
            cache_salt,
            shared_dir,
        )

    @property
    def has_host_tier(self) -> bool:
        return self.pool.host is not None

    def import_prefix(self, payload: kv_transfer.KVPayload) -> int:
        """Caches a peer's exported blocks as if computed here; returns how many were copied.
        Their ``stored`` events go out with the next drain. A payload of one of this engine's
        LoRA adapters is checked against that adapter's namespace."""
        model_id = getattr(payload, "model_id", None)
        namespace = model_id if self._own_namespace(model_id) else self.cache_namespace
        imported = kv_transfer.import_prefix(self.pool, self.runner, namespace, payload)
        self._collect_events()
        return imported

    def host_to_device_tokens_per_s(self) -> float:
        host = self.pool.host
        if host is None or not host.counters.blocks_loaded or self.runner.load_seconds_total <= 0:
            return 0.0
        return host.counters.blocks_loaded * self.block_size / self.runner.load_seconds_total

    def stats(self) -> ReplicaStats:
        lora = self.runner_lora
        return ReplicaStats(
            host_to_device_tokens_per_s=self.host_to_device_tokens_per_s(),
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_usage=self.pool.usage,
            prefill_tokens_per_s=self.metrics.prefill_tokens_per_s,
            decode_tokens_per_s=self.metrics.decode_tokens_per_s,
            num_queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            num_empty_kv_blocks=self.pool.num_empty_free_blocks,
            kv_lru_age=self.pool.lru_age,
            kv_cache_dtype=self.runner.kv_cache_dtype,
            lora_adapters=tuple(lora.loaded_names) if lora is not None else (),
            lora_load_s=lora.load_s_mean if lora is not None else 0.0,
            num_kv_blocks=self.pool.num_blocks,
            decode_s=self.metrics.decode_s,
        )

    def metrics_snapshot(self) -> EngineMetricsSnapshot:
        c = self.scheduler.counters
        return EngineMetricsSnapshot(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage_perc=self.pool.usage,
            prefix_cache_queries_total=c.prefix_cache_queries_tokens,
            prefix_cache_hits_total=c.prefix_cache_hits_tokens,
            num_preemptions_total=c.num_preemptions,
            prompt_tokens_total=self.metrics.prompt_tokens_total,
            generation_tokens_total=self.metrics.generation_tokens_total,
            num_free_blocks=self.pool.num_free_blocks,
            num_total_blocks=self.pool.num_blocks,
            host=self._host_metrics(),
            lora_requests=self._lora_requests() if self.runner_lora is not None else None,
        )

    def _lora_requests(self) -> dict[str, tuple[int, int]]:
        """Per adapter with requests: (running, waiting); vLLM's ``lora_requests_info``."""
        counts: dict[str, list[int]] = {}
        for column, queue in enumerate((self.scheduler.running, self.scheduler.waiting)):
            for req in queue:
                if req.lora_name is not None:
                    counts.setdefault(req.lora_name, [0, 0])[column] += 1
        return {name: (running, waiting) for name, (running, waiting) in counts.items()}

    def _host_metrics(self) -> HostTierMetrics | None:
        host = self.pool.host
        if host is None:
            return None
        per_block = self.runner.bytes_per_block
        return HostTierMetrics(
            host_cache_hits_total=self.scheduler.counters.host_cache_hits_tokens,
            host_kv_blocks_used=len(host),
            host_kv_blocks_total=host.num_slots,
            kv_offload_bytes_total=host.counters.blocks_saved * per_block,
            kv_onload_bytes_total=host.counters.blocks_loaded * per_block,
        )
