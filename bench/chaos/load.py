"""The chaos benchmark's load: closed-loop streaming chat requests, and each one's outcome.

``run_load`` keeps ``Load.concurrency`` streams busy for ``Load.duration_s`` and calls a clock
hook every 0.5 s (where faults are injected); ``storm`` opens many extra streams at once, each
dropped after its first token or read slowly. Every request is recorded as an ``Outcome``
(TTFT, text, done or error, when it ended).

How it fails: it does not raise on the server's behalf. An HTTP error status, an ``error``
event or a transport error (connection reset, timeout after ``REQUEST_TIMEOUT_S``) is written
into the request's ``Outcome.error``; a stream that ends without ``[DONE]`` stays not ``done``
(counted as lost by ``bench.chaos.report``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

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


@dataclass
class Outcome:
    index: int
    start_s: float
    ttft_s: float | None = None
    text: str = ""
    done: bool = False
    error: str = ""
    end_s: float | None = None
    """When the stream ended (finished, failed or dropped); None while it runs."""


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    out: Outcome,
    slow_read_s: float = 0.0,
    drop_after_first: bool = False,
) -> None:
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                out.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return
            async for line in reply.aiter_lines():
                if slow_read_s:
                    await asyncio.sleep(slow_read_s)
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out.done = True
                    return
                event = json.loads(data)
                if "error" in event:
                    out.error = str(event["error"].get("message", event["error"]))[:200]
                    return
                for choice in event.get("choices", ()):
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text and out.ttft_s is None:
                        out.ttft_s = time.monotonic() - out.start_s
                        if drop_after_first:
                            return
                    out.text += text
    except (httpx.HTTPError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        out.end_s = time.monotonic()


async def run_load(
    target: Target, prompts: list[list[dict]], load: Load, on_time=None
) -> list[Outcome]:
    """Closed loop: ``load.concurrency`` workers send ``prompts`` (chat messages) round-robin
    for ``load.duration_s``; ``on_time(elapsed_s)`` is awaited every 0.5 s (fault injection)."""
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=load.concurrency + 8)
    async with httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT_S, limits=limits, headers=target.headers
    ) as client:

        async def worker() -> None:
            while time.monotonic() - t0 < load.duration_s:
                i = next(counter) % len(prompts)
                out = Outcome(i, time.monotonic())
                outcomes.append(out)
                await one_request(client, target.url, chat_body(prompts[i], load.max_tokens), out)

        async def clock() -> None:
            while on_time is not None and time.monotonic() - t0 < load.duration_s:
                await on_time(time.monotonic() - t0)
                await asyncio.sleep(0.5)

        await asyncio.gather(clock(), *(worker() for _ in range(load.concurrency)))
    return outcomes


async def storm(
    target: Target,
    prompts: list[list[dict]],
    n: int,
    max_tokens: int,
    *,
    drop_after_first: bool = False,
    slow_read_s: float = 0.0,
) -> list[Outcome]:
    """``n`` extra streams at once, dropped after their first token or read slowly."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=target.headers) as client:
        outs = [Outcome(i % len(prompts), time.monotonic()) for i in range(n)]
        await asyncio.gather(
            *(
                one_request(
                    client,
                    target.url,
                    chat_body(prompts[o.index], max_tokens),
                    o,
                    slow_read_s=slow_read_s,
                    drop_after_first=drop_after_first,
                )
                for o in outs
            )
        )
    return outs
