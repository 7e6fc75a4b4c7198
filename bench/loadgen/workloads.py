"""The HTTP request workloads of every serving benchmark: what is sent, as ``Conversation``s.

Two kinds, one shape (the client, ``bench.loadgen.client.run_benchmark``, sends
``Conversation``s):

- Seeded synthetic streams for ``prefixserve bench serve`` (``WORKLOADS``: shared prefix,
  multi-turn chat, prefix repetition, Zipf prefixes, random). Lengths are in *words* drawn
  from a small vocabulary of common English words, so one word is about one token for any
  BPE tokenizer; the exact counts the benchmark reports come from the server's ``usage``. A
  single-turn request is a conversation of one turn; multi-turn chat conversations grow turn
  by turn, each turn sending the whole history (with the server's own earlier answers) plus a
  new user message.
- The engine benchmark's workload as chat requests (``make_chat_workload``, ``load_workload``:
  ``bench.engine.make_workload``'s 4 system prompts and questions), for ``bench.serve``,
  ``bench.serve_compare`` and ``bench.chaos``. Each ``ChatRequest`` also holds the token ids
  the server's chat template makes of its messages, which the offline run feeds to the engine
  and the cache oracle counts; ``ChatRequest.conversation`` is what goes over HTTP. These need
  a checkout (``bench/engine.py`` and the bundled model), not only the installed CLI.

Failure modes: a size below its minimum raises ``ValueError`` naming the field; the same
``seed`` always yields the same prompts (only ``random.Random(seed)`` is used).
``make_chat_workload`` raises ``AssertionError`` when ``make_workload`` stops encoding exactly
one question per request (the recorder would pair the wrong texts); ``load_workload`` lets the
tokenizer's errors through when the bundled model cannot be found.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

_VOCABULARY = (  # noqa: SIM905 (one word list, kept readable as prose)
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy process music market sense nation plan college interest "
    "death experience effect use class control care field development role effort rate heart "
    "drug show leader light voice wife police mind price report decision son view relationship"
).split()
_ZIPF_EXPONENT = 1.1  # a commonly observed popularity skew for prompts and documents


@dataclass(frozen=True)
class Turn:
    user_text: str
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    """One or more turns sent in order; ``system_text`` precedes every turn."""

    conversation_id: int
    system_text: str
    turns: tuple[Turn, ...]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(n))


def _need(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {msg}")


def generated_shared_prefix(
    seed: int,
    num_groups: int = 8,
    prompts_per_group: int = 8,
    system_prompt_len: int = 512,
    question_len: int = 64,
    output_len: int = 32,
) -> list[Conversation]:
    """SGLang's generated-shared-prefix: groups share a system prompt; shuffled."""
    _need(num_groups >= 1 and prompts_per_group >= 1, "num_groups/prompts_per_group", ">= 1")
    rng = random.Random(seed)
    convs = []
    for g in range(num_groups):
        system = f"Group {g}. " + _words(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            convs.append((system, Turn(_words(rng, question_len), output_len)))
    rng.shuffle(convs)
    return [Conversation(i, s, (t,)) for i, (s, t) in enumerate(convs)]


def multi_turn_chat(
    seed: int,
    num_conversations: int = 16,
    turns_per_conversation: int = 4,
    system_prompt_len: int = 128,
    user_turn_len: int = 64,
    output_len: int = 32,
) -> list[Conversation]:
    """Conversations that grow turn by turn; each turn resends the history."""
    _need(turns_per_conversation >= 1, "turns_per_conversation", ">= 1")
    rng = random.Random(seed)
    return [
        Conversation(
            c,
            f"Conversation {c}. " + _words(rng, system_prompt_len),
            tuple(
                Turn(_words(rng, user_turn_len), output_len) for _ in range(turns_per_conversation)
            ),
        )
        for c in range(num_conversations)
    ]


def prefix_repetition(
    seed: int,
    num_prompts: int = 64,
    num_prefixes: int = 4,
    prefix_len: int = 512,
    suffix_len: int = 64,
    output_len: int = 32,
) -> list[Conversation]:
    """vLLM's prefix_repetition: a few prefixes, each prompt one of them plus a fresh suffix."""
    _need(num_prefixes >= 1, "num_prefixes", ">= 1")
    rng = random.Random(seed)
    prefixes = [f"Prefix {k}. " + _words(rng, prefix_len) for k in range(num_prefixes)]
    return [
        Conversation(i, prefixes[i % num_prefixes], (Turn(_words(rng, suffix_len), output_len),))
        for i in range(num_prompts)
    ]


def zipf_prefixes(
    seed: int,
    num_prompts: int = 64,
    num_prefixes: int = 16,
    prefix_len: int = 512,
    suffix_len: int = 64,
    output_len: int = 32,
) -> list[Conversation]:
    """Prefixes drawn with Zipf popularity (a few hot, a long tail)."""
    _need(num_prefixes >= 1, "num_prefixes", ">= 1")
    rng = random.Random(seed)
    prefixes = [f"Document {k}. " + _words(rng, prefix_len) for k in range(num_prefixes)]
    weights = [1.0 / (k + 1) ** _ZIPF_EXPONENT for k in range(num_prefixes)]
    picks = rng.choices(range(num_prefixes), weights, k=num_prompts)
    return [
        Conversation(i, prefixes[k], (Turn(_words(rng, suffix_len), output_len),))
        for i, k in enumerate(picks)
    ]


def random_prompts(
    seed: int, num_prompts: int = 64, input_len: int = 256, output_len: int = 32
) -> list[Conversation]:
    """Unrelated prompts: the no-reuse baseline."""
    rng = random.Random(seed)
    return [
        Conversation(i, "", (Turn(_words(rng, input_len), output_len),)) for i in range(num_prompts)
    ]


WORKLOADS = {
    "generated-shared-prefix": generated_shared_prefix,
    "multi-turn": multi_turn_chat,
    "prefix-repetition": prefix_repetition,
    "zipf": zipf_prefixes,
    "random": random_prompts,
}


@dataclass(frozen=True)
class ChatRequest:
    """One chat request of the engine benchmark's workload."""

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

    def conversation(self, max_tokens: int) -> Conversation:
        """The request as the client sends it: one turn of ``max_tokens`` after the system."""
        return Conversation(self.index, self.system_text, (Turn(self.user_text, max_tokens),))


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


def load_workload(num_requests: int) -> list[ChatRequest]:
    """``make_chat_workload`` with the bundled model's (SmolLM2's) tokenizer."""
    from worker.loader import resolve_model
    from worker.tokenizer import Tokenizer

    return make_chat_workload(Tokenizer(resolve_model("smollm2").path), num_requests)


def requests_for(
    workload: Sequence[ChatRequest], concurrency: int, c1_requests: int
) -> list[ChatRequest]:
    """All requests, except at concurrency 1: the first ``c1_requests`` (a shorter run)."""
    return list(workload[:c1_requests]) if concurrency == 1 else list(workload)
