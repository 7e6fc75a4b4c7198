"""Incremental detokenisation: multi-byte characters and stop strings across tokens, by the
byte-level table and by the window of decoded tokens, which must give the same text."""

from __future__ import annotations

import random

import pytest

from worker.tokenizer import IncrementalDetokenizer, Tokenizer, byte_level_table


def _window_only(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.__dict__["token_bytes"] = None  # as for a tokenizer that is not byte-level
    return tokenizer


@pytest.fixture(scope="module", params=["byte_level", "window"])
def tok(smollm2_path, request):
    tokenizer = Tokenizer(smollm2_path)
    return _window_only(tokenizer) if request.param == "window" else tokenizer


@pytest.fixture(scope="module")
def byte_level_tok(smollm2_path):
    tokenizer = Tokenizer(smollm2_path)
    assert tokenizer.token_bytes is not None  # SmolLM2's decoder is ByteLevel alone
    return tokenizer


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


def test_byte_level_text_is_the_rust_decoders_at_every_token(byte_level_tok, test_seed):
    """Any ids, special tokens among them: after each token the text, plus what is held back
    (text ending in U+FFFD, an incomplete character's bytes), is exactly what the Rust
    tokenizer decodes from all the ids so far."""
    tok = byte_level_tok
    rng = random.Random(test_seed)
    specials = sorted(tok.special_token_ids)
    for _ in range(150):
        ids = [
            rng.randrange(tok.vocab_size) if rng.random() < 0.8 else rng.choice(specials)
            for _ in range(rng.randrange(1, 24))
        ]
        for skip in (True, False):
            d = IncrementalDetokenizer(tok, [1, 2], [], skip_special_tokens=skip)
            for k, token in enumerate(ids):
                d.add_token(token)
                incomplete = "\ufffd" if d._utf8.getstate()[0] else ""
                assert d.text + d._pending + incomplete == tok.decode(ids[: k + 1], skip)


def test_byte_level_streams_what_the_window_streams(smollm2_path, byte_level_tok):
    """Real text in many scripts: the window's text is always a prefix of the byte-level
    text (which may show a space before the window does, when the token that carries it
    also starts a character), and both end on the whole text."""
    window = _window_only(Tokenizer(smollm2_path))
    text = (
        "Héllo wörld! 你好，世界 🙂🚀 naïve café — “quotes”\n\tdef f(x):\n  return x**2\n"
        "Ελληνικά русский עברית العربية हिन्दी 日本語のテキスト 🧑‍🚀"
    )
    ids = byte_level_tok.encode(text)
    fast = IncrementalDetokenizer(byte_level_tok, [], [])
    slow = IncrementalDetokenizer(window, [], [])
    for token in ids:
        fast.add_token(token)
        slow.add_token(token)
        assert fast.text.startswith(slow.text)
    assert fast.text == slow.text == text


def test_other_decoders_take_the_window():
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models

    wordpiece = RustTokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert byte_level_table(wordpiece) is None


def test_a_long_output_keeps_its_stop_check_and_pending_text_short(tok):
    """Thousands of tokens in: the deltas still add up to the text, a stop string split over
    tokens near the end is still found and cut, and the text held between steps stays a few
    characters (handed-out text is never searched or copied again, so a token costs the same
    at the end of a long output as at its start)."""
    body = "The quick brown fox jumps over the lazy dog. " * 300
    deltas, d = stream(tok, body + "Ans" + "wer: done, then more text", stop=["Answer:"])
    assert d.stop_reason == "Answer:"
    assert d.text == body and "".join(deltas) == body
    held = []
    d = IncrementalDetokenizer(tok, [], ["Answer:"])
    for t in tok.encode(body):
        d.add_token(t)
        d.take_delta(False)
        held.append(len(d._tail))
    assert max(held) <= len("Answer:") - 1 + 16
    assert d.text == body
