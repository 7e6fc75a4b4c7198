"""The README's serve command, run as a new user would: it answers, then Ctrl-C stops it cleanly.

Runs ``prefixserve serve`` (the console script, defaults: bundled SmolLM2 on 2 CPU replicas)
in a subprocess on a free port, waits for /health and the printed URL, asks the real model
with the official ``openai`` client (a factual answer, then cached tokens on a repeated
prompt), sends SIGINT and expects exit status 0. This is also the cluster's one test with
the real bundled model; the rest use a tiny random one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from bench.common import free_port

pytestmark = pytest.mark.slow

# Two replicas loading SmolLM2 (and converting the GGUF on a fresh cache) on a busy CPU box.
STARTUP_TIMEOUT_S = 420.0
SHUTDOWN_TIMEOUT_S = 120.0


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def read_stream(url: str, model: str, lines: list[str]) -> None:
    """Streams a long completion into ``lines`` (one entry per SSE data line)."""
    payload = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=300) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)


def proxy_environ(serve_pid: int) -> dict[str, str]:
    """The environment of Serve's proxy among the processes ``prefixserve serve`` started."""
    from pathlib import Path

    from cluster.priority import descendants

    for pid in descendants(serve_pid):
        try:
            if b"ProxyActor" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    raise AssertionError(f"no ProxyActor process below {serve_pid}")


def command() -> list[str]:
    script = shutil.which("prefixserve")
    if script is not None:
        return [script]
    return [sys.executable, "-m", "cluster.cli"]


def test_prefixserve_serve_answers_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "PREFIXSERVE_API_KEY"}
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*command(), "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (healthy(url) and f"{url}/v1" in log_path.read_text()):  # URL printed when ready
            assert proc.poll() is None, f"serve exited early:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, (
                f"not ready in time:\n{log_path.read_text()[-4000:]}"
            )
            time.sleep(1.0)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        answer = response.choices[0].message.content
        assert "Paris" in answer, answer  # the real bundled model, greedy
        cached = response.usage.prompt_tokens_details.cached_tokens
        assert isinstance(cached, int) and 0 <= cached < response.usage.prompt_tokens
        if sys.platform.startswith("linux"):  # the default handle transport: the proxy on gRPC
            assert proxy_environ(proc.pid).get("RAY_SERVE_PROXY_USE_GRPC") == "1"

        # Tool calling with no flags: `required` and a named function are forced by the
        # grammar; the template ignores tools, so they go into the system message.
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
        ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
        forced = client.chat.completions.create(
            model=model,
            messages=ask,
            tools=[weather],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=48,
            temperature=0,
        )
        assert forced.choices[0].finish_reason == "tool_calls", forced
        (call,) = forced.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert "Paris" in json.loads(call.function.arguments)["city"], call
        arguments, names = "", []
        for chunk in client.chat.completions.create(
            model=model,
            messages=ask,
            tools=[weather],
            max_tokens=48,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
        ):
            for choice in chunk.choices:
                for delta_call in choice.delta.tool_calls or []:
                    names += [delta_call.function.name] if delta_call.id else []
                    arguments += delta_call.function.arguments or ""
        assert names == ["get_weather"] and json.loads(arguments) == json.loads(
            call.function.arguments
        )

        # Prefix cache on the real model: three identical long prompts over two replicas, so
        # one replica sees the prompt twice and serves its leading blocks from cache.
        system = "You are a terse assistant who answers in one short sentence. " * 6
        cached = []
        for _ in range(3):
            repeat = client.chat.completions.create(
                model=model,
                max_tokens=4,
                temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            )
            cached.append(repeat.usage.prompt_tokens_details.cached_tokens)
        assert max(cached) >= 16, cached

        # Ctrl-C with a long stream in flight: the stream must end cleanly (a finish_reason,
        # then [DONE]) rather than be cut off, and the server must exit with status 0.
        stream_lines: list[str] = []
        streamer = threading.Thread(target=read_stream, args=(url, model, stream_lines))
        streamer.start()
        deadline = time.monotonic() + 120
        while not any('"text"' in line for line in stream_lines):  # tokens are flowing
            assert streamer.is_alive() and time.monotonic() < deadline, stream_lines
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=SHUTDOWN_TIMEOUT_S) == 0, log_path.read_text()[-4000:]
        assert "prefixserve: stopped" in log_path.read_text()
        streamer.join(timeout=30)
        assert stream_lines[-1] == "data: [DONE]", stream_lines[-3:]
        finishes = [
            json.loads(line[6:])["choices"][0]["finish_reason"]
            for line in stream_lines[:-1]
            if line.startswith("data: {")
        ]
        assert finishes[-1] in ("abort", "length"), stream_lines[-3:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
