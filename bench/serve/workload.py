"""The chat workload: ``bench.engine.make_workload``'s prompts as chat messages, and their bodies.

Owns ``ChatRequest`` (system text, user text, and the ids the server's chat template makes of
them, which the offline run feeds to the engine as is), ``make_chat_workload``,
``requests_for`` (the shorter concurrency-1 run) and ``chat_body`` (the streaming,
greedy, ``ignore_eos`` request every HTTP system gets).

Failure modes: an ``AssertionError`` when ``make_workload`` stops encoding exactly one question
per request (the recorder would pair the wrong texts); the tokenizer's own errors when the
bundled model cannot be found (``load_workload``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatRequest:
    index: int
    system_index: int
    system_text: str
    user_text: str
    token_ids: tuple[int, ...]
    """What the server's chat template makes of ``messages`` (the offline run's prompt)."""

    @property
    def messages(self) -> list[dict]:
        return [
            {"role": "system", "content": self.system_text},
            {"role": "user", "content": self.user_text},
        ]


class _Recorder:
    """A tokenizer stand-in that records the texts ``make_workload`` encodes, in order."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, []

    def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        return self.tokenizer.encode(text)


def make_chat_workload(tokenizer, num_requests: int, seed: int = 0) -> list[ChatRequest]:
    """``bench.engine.make_workload``'s requests as chat messages, with their template ids.

    make_workload encodes the 4 system prompts (then cuts each to 300-500 tokens) and one
    question per request (``"\\nUser r asks: ...?\\nAssistant:"``). The system text here is the
    decoded cut; the user message is the question without the completion-style framing.
    """
    from bench.engine import TOPICS, make_workload

    rec = _Recorder(tokenizer)
    prompts = make_workload(rec, num_requests, seed)
    questions = rec.texts[len(TOPICS) :]
    assert len(questions) == num_requests, "make_workload encodes one question per request"
    system_texts: dict[int, str] = {}
    out = []
    for r, (prompt, question) in enumerate(zip(prompts, questions, strict=True)):
        s = r % len(TOPICS)
        if s not in system_texts:
            system_ids = prompt[: len(prompt) - len(tokenizer.encode(question))]
            system_texts[s] = tokenizer.decode(system_ids)
        user = question.strip().removesuffix("Assistant:").strip()
        messages = [
            {"role": "system", "content": system_texts[s]},
            {"role": "user", "content": user},
        ]
        out.append(
            ChatRequest(r, s, system_texts[s], user, tuple(tokenizer.apply_chat_template(messages)))
        )
    return out


def requests_for(
    workload: Sequence[ChatRequest], concurrency: int, c1_requests: int
) -> list[ChatRequest]:
    """All requests, except at concurrency 1: the first ``c1_requests`` (a shorter run)."""
    return list(workload[:c1_requests]) if concurrency == 1 else list(workload)


def chat_body(model: str | None, messages: list[dict], max_tokens: int) -> dict:
    body = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "messages": messages,
    }
    if model:
        body["model"] = model
    return body


def load_workload(num_requests: int):
    from worker.loader import resolve_model
    from worker.tokenizer import Tokenizer

    return make_chat_workload(Tokenizer(resolve_model("smollm2").path), num_requests)
