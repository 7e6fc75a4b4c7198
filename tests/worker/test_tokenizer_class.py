"""The ingress loads the tokenizer class the engine's ``AutoTokenizer`` chose, directly: the
same tokenizer, without torch in the ingress process (``worker.tokenizer.load_backend``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Hello world, how are you?", "  tabs\tand\nnewlines  ", "café 東京 🙂", ""]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]


def _same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    assert type(a._tok) is type(b._tok)
    assert (a.vocab_size, a.eos_token_ids, a.has_chat_template) == (
        b.vocab_size,
        b.eos_token_ids,
        b.has_chat_template,
    )
    assert a.special_token_ids == b.special_token_ids
    for text in TEXTS:
        for special in (False, True):
            ids = a.encode(text, add_special_tokens=special)
            assert ids == b.encode(text, add_special_tokens=special), text
            assert a.decode(ids, False) == b.decode(ids, False)
    if a.has_chat_template:
        assert a.apply_chat_template(MESSAGES) == b.apply_chat_template(MESSAGES)
        assert a.apply_chat_template(MESSAGES, tools=TOOLS) == b.apply_chat_template(
            MESSAGES, tools=TOOLS
        )


@pytest.mark.parametrize("model", ["smollm2", "llama", "qwen2", "qwen3"])
def test_the_named_class_loads_the_tokenizer_auto_tokenizer_loads(model, smollm2_path, tiny_models):
    path = smollm2_path if model == "smollm2" else tiny_models[model]
    auto = Tokenizer(path)
    assert auto.backend_class.startswith("transformers.")
    _same_tokenizer(auto, Tokenizer(path, backend_class=auto.backend_class))


@pytest.mark.parametrize(
    "named", ["json:JSONDecoder", "transformers.nothing", "transformers.no_such_module:X", None]
)
def test_a_class_outside_transformers_or_none_falls_back_to_auto_tokenizer(named, smollm2_path):
    _same_tokenizer(Tokenizer(smollm2_path), Tokenizer(smollm2_path, backend_class=named))


def test_the_ingress_loads_its_tokenizer_without_torch(smollm2_path):
    """The ingress's imports and ``load_frontend`` with the engine's class, in a fresh
    process: torch never loads (it would cost seconds of CPU per ingress replica start)."""
    backend_class = Tokenizer(smollm2_path).backend_class
    script = textwrap.dedent(
        f"""
        import sys
        import cluster.ingress
        from worker.config import EngineConfig
        from worker.loader import load_frontend

        tokenizer, _ = load_frontend(EngineConfig(model={smollm2_path!r}), {backend_class!r})
        assert tokenizer.encode("hello") and tokenizer.backend_class == {backend_class!r}
        print("torch" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "False", result.stdout
