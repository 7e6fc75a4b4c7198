"""The chaos benchmark's load: closed-loop streaming chat requests, and the extra storm streams.

``run_load`` keeps ``Load.concurrency`` streams busy for ``Load.duration_s``, sending the
prompts (chat messages) in turn, and awaits a clock hook every 0.5 s (where faults are
injected); ``storm`` opens many extra streams at once, each dropped after its first text or
read slowly. Every request goes through the benchmarks' client
(``bench.loadgen.client.send_request``: greedy, ``ignore_eos``) and is recorded as its
``RequestOutput``: ``conversation_id`` is the prompt's index, ``start_s`` the seconds since
the load began, ``start_s + latency_s`` when the stream ended, ``done`` whether it reached
``[DONE]``.

How it fails: it does not raise on the server's behalf. An HTTP error status, an ``error``
event, a transport error (connection reset, timeout after ``REQUEST_TIMEOUT_S``) or a stream
that ends before any text is written into the request's ``error``; a stream cut after some
text stays not ``done`` (counted as lost by ``bench.chaos.report``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import httpx

from bench.loadgen.client import RequestOutput, RequestSettings, request_body, send_request

MAX_TOKENS = 32
NUM_KV_BLOCKS = 1024
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Target:
    """A running cluster: where the load goes and which processes faults may touch."""

    url: str
    root_pid: int
    """Faults SIGKILL only descendants of this process (the server, or the test that started
    Ray), never another cluster on the same machine."""
    headers: dict = field(default_factory=dict)
    num_kv_blocks: int = NUM_KV_BLOCKS
    """KV blocks per engine replica, to turn ``kv_cache_usage_perc`` into blocks."""

    @property
    def settings(self) -> RequestSettings:
        """The chat requests the load sends here (greedy, ``ignore_eos``, the server's model)."""
        return RequestSettings(
            self.url, "", "/v1/chat/completions", ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S
        )


@dataclass(frozen=True)
class Load:
    """The steady load and the sizes of the client-side faults."""

    concurrency: int = 8
    duration_s: float = 60.0
    max_tokens: int = MAX_TOKENS
    storm_streams: int = 32
    storm_max_tokens: int = 256
    slow_streams: int = 8
    slow_read_s: float = 2.0


async def run_load(
    target: Target, prompts: list[list[dict]], load: Load, on_time=None
) -> list[RequestOutput]:
    """Closed loop: ``load.concurrency`` workers send ``prompts`` (chat messages) round-robin
    for ``load.duration_s``; ``on_time(elapsed_s)`` is awaited every 0.5 s (fault injection)."""
    settings = target.settings
    outputs: list[RequestOutput] = []
    counter = itertools.count()
    limits = httpx.Limits(max_connections=load.concurrency + 8)
    async with httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT_S, limits=limits, headers=target.headers
    ) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() - t0 < load.duration_s:
                i = next(counter) % len(prompts)
                out = RequestOutput(i, 0)
                outputs.append(out)
                body = request_body(settings, load.max_tokens, messages=prompts[i])
                await send_request(client, settings, body, out, t0)

        async def clock() -> None:
            while on_time is not None and time.perf_counter() - t0 < load.duration_s:
                await on_time(time.perf_counter() - t0)
                await asyncio.sleep(0.5)

        await asyncio.gather(clock(), *(worker() for _ in range(load.concurrency)))
    return outputs


async def storm(
    target: Target,
    prompts: list[list[dict]],
    n: int,
    max_tokens: int,
    *,
    drop_after_first: bool = False,
    slow_read_s: float = 0.0,
) -> list[RequestOutput]:
    """``n`` extra streams at once, dropped after their first text or read slowly."""
    settings = target.settings
    outputs = [RequestOutput(i % len(prompts), 0) for i in range(n)]
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=target.headers) as client:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                send_request(
                    client,
                    settings,
                    request_body(settings, max_tokens, messages=prompts[out.conversation_id]),
                    out,
                    t0,
                    read_delay_s=slow_read_s,
                    stop_after_first=drop_after_first,
                )
                for out in outputs
            )
        )
    return outputs
