"""Streaming requests to an OpenAI-compatible endpoint, timed the way ``vllm bench serve`` does.

``run_benchmark`` sends every conversation's turns (a conversation's turns in order, each
after the previous answer arrived), starting conversations by Poisson arrivals at
``request_rate`` (``inf``: all at once) and/or under a ``max_concurrency`` cap. Each request
streams (``stream: true`` with ``stream_options.include_usage``) so that it yields:
TTFT (first chunk with text), the inter-token latencies, end-to-end latency, token counts
and ``usage.prompt_tokens_details.cached_tokens`` from the final usage chunk, and the replica
that served it from the ``x-prefixserve-replica`` response header when present.

Failure modes: an HTTP error, a malformed stream or a timeout fails *that request* (recorded
with its error text); the benchmark carries on. Later turns of a conversation whose turn failed
are skipped and counted as failed.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bench.loadgen.workloads import Conversation

REPLICA_HEADER = "x-prefixserve-replica"


@dataclass
class RequestOutput:
    conversation_id: int
    turn: int
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    start_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    replica: str | None = None
    generated_text: str = ""


@dataclass(frozen=True)
class RequestSettings:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise ValueError(
                f"endpoint must be /v1/completions or /v1/chat/completions, got {self.endpoint!r}"
            )

    @property
    def is_chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"


def _payload(
    settings: RequestSettings, conv: Conversation, history: list, user_text: str, max_tokens: int
) -> dict:
    body = {
        "model": settings.model,
        "max_tokens": max_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if settings.is_chat:
        messages = [{"role": "system", "content": conv.system_text}] if conv.system_text else []
        for user, assistant in history:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
        body["messages"] = messages + [{"role": "user", "content": user_text}]
    else:
        parts = [conv.system_text] if conv.system_text else []
        for user, assistant in history:
            parts += [f"User: {user}", f"Assistant: {assistant}"]
        parts.append(f"User: {user_text}\nAssistant:" if history else user_text)
        body["prompt"] = "\n".join(parts)
    return body


def _chunk_text(chunk: dict, is_chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if is_chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(
    client: httpx.AsyncClient, settings: RequestSettings, body: dict, out: RequestOutput, t0: float
) -> None:
    """Stream one request into ``out``; never raises for request-level failures."""
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    start = time.perf_counter()
    out.start_s = start - t0
    last = start
    usage = None
    try:
        url = settings.base_url.rstrip("/") + settings.endpoint
        async with client.stream("POST", url, json=body, headers=headers) as response:
            out.replica = response.headers.get(REPLICA_HEADER)
            if response.status_code != 200:
                out.error = (
                    f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}"
                )
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = _chunk_text(chunk, settings.is_chat)
                if not text:
                    continue
                now = time.perf_counter()
                if not out.token_times_s:
                    out.ttft_s = now - start
                else:
                    out.itl_s.append(now - last)
                out.token_times_s.append(now - t0)
                last = now
                out.generated_text += text
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return
    out.latency_s = time.perf_counter() - start
    if not out.token_times_s:
        out.error = "stream ended without any text"
        return
    if usage:
        out.prompt_len = int(usage.get("prompt_tokens") or 0)
        out.output_tokens = int(usage.get("completion_tokens") or len(out.token_times_s))
        details = usage.get("prompt_tokens_details") or {}
        out.cached_tokens = details.get("cached_tokens")
    else:
        out.prompt_len = len((body.get("prompt") or json.dumps(body.get("messages"))).split())
        out.output_tokens = len(out.token_times_s)
    out.success = True


@dataclass
class RunStats:
    duration_s: float = 0.0
    max_concurrent_requests: int = 0


async def run_benchmark(
    settings: RequestSettings,
    conversations: list[Conversation],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    on_done: Callable[[RequestOutput], None] | None = None,
) -> tuple[list[RequestOutput], RunStats]:
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (inf for all at once), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    rng = random.Random(seed)
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    stats = RunStats()
    inflight = 0
    outputs: list[RequestOutput] = []
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=100)

    async with httpx.AsyncClient(timeout=settings.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one_turn(conv, turn_index, history) -> RequestOutput:
            nonlocal inflight
            turn = conv.turns[turn_index]
            out = RequestOutput(conv.conversation_id, turn_index)
            body = _payload(settings, conv, history, turn.user_text, turn.max_tokens)
            if limiter is not None:
                await limiter.acquire()
            inflight += 1
            stats.max_concurrent_requests = max(stats.max_concurrent_requests, inflight)
            try:
                await send_request(client, settings, body, out, t0)
            finally:
                inflight -= 1
                if limiter is not None:
                    limiter.release()
            return out

        async def one_conversation(conv: Conversation) -> None:
            history: list[tuple[str, str]] = []
            failed = False
            for i, turn in enumerate(conv.turns):
                if failed:
                    out = RequestOutput(conv.conversation_id, i, error="earlier turn failed")
                else:
                    out = await one_turn(conv, i, history)
                    failed = not out.success
                    history.append((turn.user_text, out.generated_text))
                outputs.append(out)
                if on_done is not None:
                    on_done(out)

        tasks = []
        for conv in conversations:
            tasks.append(asyncio.create_task(one_conversation(conv)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        stats.duration_s = time.perf_counter() - t0
    outputs.sort(key=lambda o: (o.conversation_id, o.turn))
    return outputs, stats
