"""The benchmarks' one HTTP client: streaming requests to an OpenAI-compatible endpoint, timed
the way ``vllm bench serve`` does.

``send_request`` streams one request (``stream: true`` with ``stream_options.include_usage``)
into a ``RequestOutput``: TTFT (first chunk with text), the inter-token latencies, the time
to the stream's end, token counts and ``usage.prompt_tokens_details.cached_tokens`` from the
final usage chunk, whether the stream reached ``[DONE]``, and the replica that served it
from the ``x-prefixserve-replica`` response header when present. Two options shape the
client itself for fault tests: ``read_delay_s`` (a slow reader) and ``stop_after_first``
(a client that disconnects after the first text). ``request_body`` builds the streaming
request from chat messages or a prompt (text or token ids); ``first_model`` asks
``/v1/models``. ``run_benchmark`` sends every conversation's turns (a conversation's turns
in order, each after the previous answer arrived), starting conversations by Poisson
arrivals at ``request_rate`` (``inf``: all at once) and/or under a ``max_concurrency`` cap.
``bench.serve``, ``bench.serve_path``, ``bench.serve_compare`` and ``bench.chaos`` drive
their loads through this module.

Failure modes: an HTTP error status, an ``error`` event in the stream, a malformed stream, a
broken connection or a timeout fails *that request* (recorded with its error text), as does
a stream that ends without any text; the benchmark carries on. A stream cut after some text
without ``[DONE]`` is a success with ``done`` false (servers that omit ``[DONE]`` still
count). Later turns of a conversation whose turn failed are skipped and counted as failed.
``first_model`` raises ``httpx.HTTPError`` (or ``KeyError``/``IndexError`` for a listing
without models).
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
    """One request's record; times in seconds, ``start_s`` and ``token_times_s`` since the
    run's start, ``ttft_s`` and ``latency_s`` since the request was sent."""

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
    """Until the stream ended, however it ended (finished, failed or stopped)."""
    start_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    replica: str | None = None
    generated_text: str = ""
    done: bool = False
    """The stream reached ``data: [DONE]``."""


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


def request_body(
    settings: RequestSettings,
    max_tokens: int,
    *,
    messages: list[dict] | None = None,
    prompt: str | list[int] | None = None,
) -> dict:
    """The streaming request for ``settings``: chat ``messages`` or a ``prompt`` (text or token
    ids), ``max_tokens``, the settings' temperature and ``ignore_eos``, usage in the stream.
    ``model`` is left out when ``settings.model`` is empty (the server's only model)."""
    body = {
        "max_tokens": max_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.model:
        body["model"] = settings.model
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    return body


def _payload(
    settings: RequestSettings, conv: Conversation, history: list, user_text: str, max_tokens: int
) -> dict:
    if settings.is_chat:
        messages = [{"role": "system", "content": conv.system_text}] if conv.system_text else []
        for user, assistant in history:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
        messages.append({"role": "user", "content": user_text})
        return request_body(settings, max_tokens, messages=messages)
    parts = [conv.system_text] if conv.system_text else []
    for user, assistant in history:
        parts += [f"User: {user}", f"Assistant: {assistant}"]
    parts.append(f"User: {user_text}\nAssistant:" if history else user_text)
    return request_body(settings, max_tokens, prompt="\n".join(parts))


def first_model(base_url: str, api_key: str | None = None) -> str:
    """The id of the first model ``GET /v1/models`` lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _chunk_text(chunk: dict, is_chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if is_chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _error_text(event: dict) -> str:
    error = event["error"]
    return str(error.get("message", error) if isinstance(error, dict) else error)[:500]


def _rough_prompt_len(body: dict) -> int:
    """Prompt tokens when the server reported no usage: token ids counted, text by words."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    return len((prompt or json.dumps(body.get("messages"))).split())


async def send_request(
    client: httpx.AsyncClient,
    settings: RequestSettings,
    body: dict,
    out: RequestOutput,
    t0: float,
    *,
    read_delay_s: float = 0.0,
    stop_after_first: bool = False,
) -> None:
    """Stream one request into ``out``; never raises for request-level failures.

    ``read_delay_s`` waits that long before reading each line of the stream (a slow reader);
    ``stop_after_first`` closes the stream once the first text arrived (a client that
    disconnects; the request then counts as not successful, with no error)."""
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
                if read_delay_s:
                    await asyncio.sleep(read_delay_s)
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    out.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = _error_text(chunk)
                    return
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
                if stop_after_first:
                    return
    except (httpx.HTTPError, OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return
    finally:
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
        out.prompt_len = _rough_prompt_len(body)
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
