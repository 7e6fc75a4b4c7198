"""``prefixserve batch``: an offline batch of chat/completion requests through a running cluster.

Reads JSONL requests, sends them to the cluster's OpenAI-compatible HTTP endpoint (so they go
through the ingress and the prefix-aware router like any client's), and appends one JSONL
answer per request. Input lines are either OpenAI Batch API lines
(``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``) or plain
request bodies with an ``id`` (``{"id": "q1", "messages": [...]}`` is a chat request,
``{"id": "q2", "prompt": "..."}`` a completion). Output lines follow the Batch API:
``{"id", "custom_id", "response": {"status_code", "body"}, "error"}``.

Resume: ids already in the output are skipped, so rerunning the same command after an
interruption finishes the batch and answers every id exactly once. A line is written only
once its request has a final answer (2xx, or a 4xx that a retry cannot change), in one write;
a line cut short by a kill is dropped on resume. Transient failures (connection errors, 429,
5xx) are retried with backoff; requests still failing are left out and the command exits 1,
naming how many, so a rerun retries exactly those. ``--ordered`` writes answers in input order
(holding back finished answers behind slower earlier ones); otherwise they are written as they
finish, keyed by ``custom_id``. Bad input (invalid JSON, duplicate ids, streaming requests)
fails before any request is sent, with the line number. Submit it as a Ray job with
``ray job submit -- prefixserve batch --input ... --output ...`` (the head's proxy answers on
127.0.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from cluster.config import API_KEY_ENV

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_CONCURRENCY = 16
DEFAULT_MAX_RETRIES = 5
# First retry after half a second, doubling: five retries ride out ~15 s of replica restarts.
RETRY_BACKOFF_S = 0.5
# A long generation on a busy CPU replica can take minutes; the timeout only catches hangs.
REQUEST_TIMEOUT_S = 600.0
ENDPOINTS = {"/v1/chat/completions", "/v1/completions"}


@dataclass(frozen=True)
class BatchRequest:
    index: int
    """Position in the input file (0-based), for --ordered output."""
    custom_id: str
    url: str
    body: dict


def parse_request(line: str, line_number: int) -> BatchRequest:
    """One input line -> a request; ValueError naming the line on anything malformed."""
    where = f"input line {line_number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "body" in item:
        custom_id, url, body = item.get("custom_id"), item.get("url"), item["body"]
        if item.get("method", "POST") != "POST":
            raise ValueError(f"{where}: method must be POST")
    else:
        body = {k: v for k, v in item.items() if k not in ("id", "custom_id")}
        custom_id = item.get("custom_id", item.get("id"))
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if custom_id is None:
        custom_id = str(line_number)
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"{where}: custom_id must be a non-empty string")
    if url not in ENDPOINTS:
        raise ValueError(f"{where}: url must be one of {sorted(ENDPOINTS)}, got {url!r}")
    if not isinstance(body, dict):
        raise ValueError(f"{where}: body must be a JSON object")
    if body.get("stream"):
        raise ValueError(f"{where}: streaming requests cannot be batched (drop 'stream')")
    return BatchRequest(line_number - 1, custom_id, url, body)


def read_requests(path: Path) -> list[BatchRequest]:
    requests: list[BatchRequest] = []
    seen: dict[str, int] = {}
    with path.open() as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            request = parse_request(line, line_number)
            if request.custom_id in seen:
                raise ValueError(
                    f"input line {line_number}: duplicate id {request.custom_id!r} "
                    f"(first on line {seen[request.custom_id]})"
                )
            seen[request.custom_id] = line_number
            requests.append(request)
    return requests


def answered_ids(path: Path) -> set[str]:
    """Ids already in the output; drops a last line cut short by an interrupted run."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        with path.open("r+b") as out:
            out.truncate(complete)
    ids = set()
    for line_number, line in enumerate(data[:complete].decode().splitlines(), start=1):
        if line.strip():
            try:
                ids.add(json.loads(line)["custom_id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f"output line {line_number} of {path} is not a batch answer"
                ) from None
    return ids


def _retryable(status_code: int) -> bool:
    return status_code == 429 or status_code >= 500


def _result_line(request: BatchRequest, response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = {"text": response.text}
    error = None
    if response.status_code >= 400:
        detail = body.get("error", {}) if isinstance(body, dict) else {}
        error = {
            "code": detail.get("code") or response.status_code,
            "message": detail.get("message", ""),
        }
    record = {
        "id": f"batch_req_{request.index}",
        "custom_id": request.custom_id,
        "response": {"status_code": response.status_code, "body": body},
        "error": error,
    }
    return json.dumps(record, ensure_ascii=False) + "\n"


async def _send(client: httpx.AsyncClient, request: BatchRequest, max_retries: int) -> str | None:
    """The answer line, or None when the request still failed after every retry."""
    for attempt in range(max_retries + 1):
        try:
            response = await client.post(request.url, json=request.body)
            if not _retryable(response.status_code):
                return _result_line(request, response)
        except httpx.TransportError:
            pass
        if attempt < max_retries:
            await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
    return None


async def _default_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_batch(
    requests: list[BatchRequest],
    output: Path,
    *,
    url: str = DEFAULT_URL,
    api_key: str | None = None,
    model: str | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    ordered: bool = False,
    max_retries: int = DEFAULT_MAX_RETRIES,
    show_progress: bool = True,
) -> int:
    """Sends ``requests`` and appends their answers to ``output``; returns how many failed."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:
        if any("model" not in r.body for r in requests):
            model = model or await _default_model(client)
            requests = [
                r
                if "model" in r.body
                else BatchRequest(r.index, r.custom_id, r.url, {**r.body, "model": model})
                for r in requests
            ]
        slots = asyncio.Semaphore(concurrency)

        async def one(position: int, request: BatchRequest) -> tuple[int, str | None]:
            async with slots:
                return position, await _send(client, request, max_retries)

        num_failed = 0
        held: dict[int, str | None] = {}
        next_position = 0
        with (
            output.open("a") as out,
            tqdm(
                total=len(requests), desc="batch", unit="req", disable=not show_progress
            ) as progress,
        ):
            for finished in asyncio.as_completed([one(i, r) for i, r in enumerate(requests)]):
                position, line = await finished
                progress.update(1)
                num_failed += line is None
                held[position] = line
                # Unordered: write whatever finished. Ordered: write the finished run of
                # answers that starts at the first one not written yet.
                ready = sorted(held) if not ordered else []
                while ordered and next_position in held:
                    ready.append(next_position)
                    next_position += 1
                for key in ready:
                    answer = held.pop(key)
                    if answer is not None:
                        out.write(answer)
                        out.flush()
    return num_failed


def run(ns: argparse.Namespace) -> int:
    try:
        requests = read_requests(Path(ns.input))
        done = answered_ids(Path(ns.output))
    except (OSError, ValueError) as exc:
        print(f"prefixserve batch: error: {exc}", file=sys.stderr)
        return 2
    pending = [r for r in requests if r.custom_id not in done]
    print(
        f"prefixserve batch: {len(requests)} requests, {len(requests) - len(pending)} already "
        f"answered in {ns.output}, sending {len(pending)} to {ns.url}",
        file=sys.stderr,
        flush=True,
    )
    try:
        num_failed = asyncio.run(
            run_batch(
                pending,
                Path(ns.output),
                url=ns.url,
                api_key=ns.api_key or os.environ.get(API_KEY_ENV),
                model=ns.model,
                concurrency=ns.concurrency,
                ordered=ns.ordered,
                max_retries=ns.max_retries,
                show_progress=not ns.no_progress,
            )
        )
    except ValueError as exc:
        print(f"prefixserve batch: error: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:  # only the model lookup raises; requests are retried
        print(f"prefixserve batch: cannot reach {ns.url}: {exc}", file=sys.stderr)
        return 1
    if num_failed:
        print(
            f"prefixserve batch: {num_failed} request(s) still failing after retries; "
            "rerun the same command to retry only those",
            file=sys.stderr,
        )
        return 1
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``prefixserve batch`` (hooked in by cluster.cli.SUBCOMMAND_HOOKS)."""
    parser = subparsers.add_parser(
        "batch",
        help="Run a JSONL batch of chat/completion requests through a running cluster.",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "--input", required=True, help="JSONL requests (Batch API lines or bodies with 'id')."
    )
    parser.add_argument(
        "--output", required=True, help="JSONL answers; appended to, ids in it are skipped."
    )
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"Cluster endpoint (default {DEFAULT_URL})."
    )
    parser.add_argument("--api-key", default=None, help=f"Bearer key (default: ${API_KEY_ENV}).")
    parser.add_argument(
        "--model", default=None, help="Model for requests that name none (default: the served one)."
    )
    parser.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="Requests in flight."
    )
    parser.add_argument("--ordered", action="store_true", help="Write answers in input order.")
    parser.add_argument(
        "--max-retries",
        type=int,
        default=DEFAULT_MAX_RETRIES,
        help="Retries of 429/5xx/connection errors.",
    )
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    parser.set_defaults(handler=run)
    return parser
