"""The checks a request passes before it touches an engine: ``validate_request`` (prompt,
sampling parameters and sizes against the model) and ``check_resume`` (outputs another
replica streamed, to go on after).

Each raises ``ValueError`` saying what is wrong. Kept apart from ``worker/engine.py`` so a
server that only relays requests to an engine in another process (``AsyncEngine``) checks them
without importing torch or the model code.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.sampling_params import SamplingParams
from worker.structured_output import check_spec


def check_resume(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    resume_token_ids: Sequence[int],
    *,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raises ``ValueError`` unless ``resume_token_ids`` can continue this request."""
    if params.n != 1:
        raise ValueError(
            f"resume_token_ids: only a request with n == 1 can be resumed, got n={params.n}"
        )
    if params.max_tokens is not None and len(resume_token_ids) >= params.max_tokens:
        raise ValueError(
            f"resume_token_ids: {len(resume_token_ids)} tokens already reach "
            f"max_tokens={params.max_tokens}"
        )
    if len(prompt_token_ids) + len(resume_token_ids) >= max_model_len:
        raise ValueError(
            f"resume_token_ids: prompt and resumed tokens fill the context ({max_model_len})"
        )
    bad = [t for t in resume_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"resume_token_ids: token id {bad[0]} is out of range [0, {vocab_size})")


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    kv_capacity_tokens: int,
) -> None:
    """Raises ``ValueError`` saying what is wrong with a request, before it touches the engine."""
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    bad = next(
        (
            t
            for t in prompt_token_ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
        ),
        None,
    )
    if bad is not None:
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.logit_bias or () if not t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")
    n = len(prompt_token_ids)
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens; this model's context is {max_model_len} tokens "
            "(prompt plus output)"
        )
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={params.max_tokens} plus the prompt's {n} tokens exceeds the context of "
            f"{max_model_len} tokens"
        )
    if n > kv_capacity_tokens:
        raise ValueError(
            f"prompt of {n} tokens does not fit the KV cache ({kv_capacity_tokens} tokens)"
        )
    if params.structured_output is not None:
        check_spec(params.structured_output)
