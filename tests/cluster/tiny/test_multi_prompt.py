"""One completions request over several prompts: each prompt is its own engine request, and
they are routed and run at the same time (Serve's router once lost one of two such calls
pending together, and the request hung: ``cluster/serve_compat.own_internal_request_id``)."""

from __future__ import annotations

import httpx
import pytest

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    [30, 31, 32],
]


def complete(server, prompt, **fields) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}
    reply = httpx.post(
        f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_several_prompts_in_one_request_answer_like_one_request_each(tiny_server, n):
    together = complete(tiny_server, PROMPTS, n=n)
    alone = [complete(tiny_server, p, n=n)["choices"] for p in PROMPTS]
    assert [c["index"] for c in together["choices"]] == list(range(len(PROMPTS) * n))
    assert [c["text"] for c in together["choices"]] == [c["text"] for cs in alone for c in cs]
    assert together["usage"]["prompt_tokens"] == sum(len(p) for p in PROMPTS)
