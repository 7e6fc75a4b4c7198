"""``prefixserve serve --direct-ingress`` with the simulated engine: the ingress replica serves
HTTP on a port of its own, printed at start, and answers there as through Serve's proxy.

One ``prefixserve serve`` subprocess (a tiny model's tokenizer, ``--engine sim``), so this
also runs the simulated engine and the pushed outputs (``cluster/ingress_channel.py``)
through the whole served path: a streamed completion through either door gives the same
tokens as a plain one. It runs on Ray actor calls (``--handle-transport ray``, the proxy's
too); the other tests run on the default, gRPC.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from bench.common import free_port
from tests.e2e.test_readme_serve import command, healthy, proxy_environ

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300.0
DIRECT_LINE = re.compile(r"prefixserve: direct ingress at (http://\S+)/v1")


def _completion(url: str, stream: bool) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": [11, 22, 33, 44, 55],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "logprobs": 0,
    }
    if not stream:
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        return answer["choices"][0]["logprobs"]["tokens"]
    tokens = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            tokens += choice["logprobs"]["tokens"] if choice.get("logprobs") else []
    return tokens


def test_direct_ingress_answers_like_the_proxy(tmp_path, tiny_models):
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "PREFIXSERVE_API_KEY"}
    env.pop("RAY_ADDRESS", None)
    argv = [*command(), "serve", "--model", tiny_models["llama"], "--served-model-name", "tiny",
            "--engine", "sim", "--num-replicas", "1", "--num-threads", "1", "--direct-ingress",
            "--handle-transport", "ray", "--port", str(port)]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    proxy = f"http://127.0.0.1:{port}"
    try:
        deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
        direct = None
        while direct is None and time.monotonic() < deadline_s:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            found = DIRECT_LINE.search(log_path.read_text(errors="replace"))
            direct = found.group(1) if found else None
            time.sleep(1.0)
        assert direct is not None and healthy(proxy), log_path.read_text(errors="replace")[-3000:]
        assert direct != proxy
        plain = _completion(proxy, stream=False)
        assert len(plain) == 24
        assert _completion(direct, stream=True) == plain
        assert _completion(proxy, stream=True) == plain
        assert _completion(direct, stream=False) == plain
        assert proxy_environ(proc.pid).get("RAY_SERVE_PROXY_USE_GRPC") == "0"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, log_path.read_text(errors="replace")[-3000:]
