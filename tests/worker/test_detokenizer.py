"""Incremental detokenisation: multi-byte characters and stop strings across tokens."""

from __future__ import annotations

import pytest

from worker.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer(smollm2_path)


def stream(tok, text, stop=()):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop)
    deltas = []
    for i, t in enumerate(ids):
        d.add_token(t)
        deltas.append(d.take_delta(finished=i == len(ids) - 1 or d.stop_reason is not None))
        if d.stop_reason:
            break
    return deltas, d


def test_never_emits_half_a_character(tok):
    text = "Emoji 🙂 and 日本語 and é done"
    deltas, _ = stream(tok, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_is_never_streamed(tok):
    text = "The answer is forty-two, my friend."
    deltas, d = stream(tok, text, stop=["forty-two"])
    assert d.stop_reason == "forty-two"
    assert "".join(deltas) == "The answer is "
    assert not any("forty" in x for x in deltas)


def test_decode_equals_transformers_decode(tok, test_seed):
    """``Tokenizer.decode`` calls the Rust tokenizer directly where it may: same text as
    transformers' ``decode`` for any ids, special tokens kept or skipped."""
    import random

    rng = random.Random(test_seed)
    assert tok._backend_decode is not None  # SmolLM2's tokenizer takes the direct path
    specials = sorted(tok.eos_token_ids) + [0, 1, 2]
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids += rng.sample(specials, k=rng.randrange(0, 2))
        rng.shuffle(ids)
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok._tok.decode(ids, skip_special_tokens=skip)
