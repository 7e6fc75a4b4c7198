"""The serving path's floor: one process, FastAPI + uvicorn around the same ``AsyncEngine``.

    python -m bench.bare_server --model PATH --port N [--engine sim --sim-profile gpu]
        [--max-num-seqs N] [--num-threads N] [--num-kv-blocks N] [--max-waiting-requests N]

No Ray, no ingress-to-replica hop, no router, no metrics: ``POST /v1/completions`` (streaming
only; ``prompt`` a list of token ids or a string, ``max_tokens``, ``temperature``,
``ignore_eos``, ``stream_options.include_usage``) sends one SSE ``text_completion`` chunk per
engine output, the usage chunk, then ``data: [DONE]``; ``GET /health``; ``GET /v1/models``.
The engine runs in its child process (``python -m worker.engine_process``) as under Serve.

Failure modes: a body that is not a streaming completion is a 400; the engine's refusals come
before the stream starts (``ValueError``: 400, ``EngineOverloadedError``: 429); a request the
engine fails ends its stream with ``finish_reason`` ``error``. SIGINT/SIGTERM stop uvicorn,
which shuts the engine process down.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build_app(config) -> FastAPI:
    from worker import AsyncEngine, SamplingParams
    from worker.outputs import EngineOverloadedError

    state: dict = {}
    ids = itertools.count()

    @asynccontextmanager
    async def lifespan(_app):
        state["engine"] = AsyncEngine(config)
        yield
        await state["engine"].shutdown(drain_timeout_s=0.0)

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health():
        ok = "engine" in state and state["engine"].is_alive()
        return JSONResponse({"alive": ok}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state["engine"].model_id, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        engine, body = state["engine"], await request.json()
        rid, created = f"cmpl-{next(ids)}", int(time.time())
        try:
            if not body.get("stream"):
                raise ValueError("this server streams only: set stream to true")
            prompt = body["prompt"]
            tokens = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            params = SamplingParams(
                max_tokens=int(body.get("max_tokens", 16)),
                temperature=float(body.get("temperature", 1.0)),
                ignore_eos=bool(body.get("ignore_eos", False)),
            )
            stream = engine.generate(rid, tokens, params)
            first = await anext(stream)  # refusals are raised here, before any byte is sent
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": {"message": f"{exc}"}}, status_code=400)
        except EngineOverloadedError as exc:
            return JSONResponse({"error": {"message": f"{exc}"}}, status_code=429)
        usage = (body.get("stream_options") or {}).get("include_usage", False)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": engine.model_id,
        }

        async def events():
            out, n_out = first, 0
            try:
                while True:
                    for c in out.choices:
                        reason = c.finish_reason.value if c.finish_reason else None
                        choice = {"index": 0, "text": c.new_text, "finish_reason": reason}
                        yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                        n_out += len(c.new_token_ids)
                    if out.finished:
                        break
                    out = await anext(stream)
            finally:
                await stream.aclose()  # a client gone mid-stream aborts its request
            if usage:
                n_prompt = out.num_prompt_tokens
                counts = {"prompt_tokens": n_prompt, "completion_tokens": n_out}
                counts["total_tokens"] = n_prompt + n_out
                counts["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': counts})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from worker import EngineConfig

    ap = argparse.ArgumentParser(prog="python -m bench.bare_server", description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine", default="model", choices=("model", "sim"))
    ap.add_argument("--sim-profile", default="gpu")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-waiting-requests", type=int, default=4096)
    a = ap.parse_args(argv)
    config = EngineConfig(
        model=a.model,
        engine=a.engine,
        sim_profile=a.sim_profile,
        max_num_seqs=a.max_num_seqs,
        num_threads=a.num_threads,
        num_kv_blocks=a.num_kv_blocks,
        max_waiting_requests=a.max_waiting_requests,
    )
    uvicorn.run(build_app(config), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
