"""A tiny OpenAI-compatible streaming server for the load generator's tests (a test double of
the remote endpoint): deterministic tokens, a word-level prefix cache that reports
``cached_tokens``, a replica header alternating between two names, and a record of every
request it saw. Runs uvicorn in a thread on a free loopback port."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.common import free_port

CACHE_BLOCK_WORDS = 16
BAD_MODEL = "no-such-model"


class OpenAIDouble:
    def __init__(self, token_delay_s: float = 0.002, port: int | None = None) -> None:
        self.seen: list[dict] = []
        self.max_concurrent = 0
        self._inflight = 0
        self._cached_prefixes: set[tuple] = set()
        self.token_delay_s = token_delay_s
        self.app = self._build()
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def serve_forever(self) -> None:
        self.server.run()

    def __enter__(self) -> OpenAIDouble:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def _cached_words(self, words: list[str]) -> int:
        cached = 0
        for end in range(CACHE_BLOCK_WORDS, len(words) + 1, CACHE_BLOCK_WORDS):
            if tuple(words[:end]) not in self._cached_prefixes:
                break
            cached = end
        for end in range(CACHE_BLOCK_WORDS, len(words) + 1, CACHE_BLOCK_WORDS):
            self._cached_prefixes.add(tuple(words[:end]))
        return cached

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "double-model", "object": "model"}]}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.seen.append(body)
            if body.get("model") == BAD_MODEL:
                error = {
                    "message": "model not found",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
                return JSONResponse({"error": error}, status_code=404)
            text = json.dumps(body["messages"]) if chat else body["prompt"]
            words = text.split()
            cached = self._cached_words(words)
            replica = f"replica-{len(self.seen) % 2}"

            async def stream():
                self._inflight += 1
                self.max_concurrent = max(self.max_concurrent, self._inflight)
                try:
                    for i in range(body["max_tokens"]):
                        await asyncio.sleep(self.token_delay_s)
                        piece = f"tok{i} "
                        choice = (
                            {"index": 0, "delta": {"content": piece}}
                            if chat
                            else {"index": 0, "text": piece}
                        )
                        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    usage = {
                        "prompt_tokens": len(words),
                        "completion_tokens": body["max_tokens"],
                        "total_tokens": len(words) + body["max_tokens"],
                        "prompt_tokens_details": {"cached_tokens": cached},
                    }
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self._inflight -= 1

            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"x-prefixserve-replica": replica}
            )

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, chat=True)

        return app


if __name__ == "__main__":  # a stand-in cluster for bench/serve_compare.py's test
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    OpenAIDouble(port=parser.parse_args().port).serve_forever()
