"""The commands an engine loop takes (``EngineCore.submit``): one small type each.

They cross the engine socket as they are (``worker/engine_process.py``) and ``EngineLoop``
dispatches on their type, so a new command is a new class here and a branch there, never a
tagged tuple whose fields are read by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Add:
    """Start a request (``LLMEngine.add_request``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    resume_token_ids: list[int] = field(default_factory=list)
    """Tokens another replica already streamed: the request goes on after them."""
    lora_name: str | None = None
    """The LoRA adapter the request runs on; None: the base model."""


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request now; its blocks are freed and its stream ends with ``abort``."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Call:
    """Run one of ``engine_core.ENGINE_CALLS`` on the engine; answered by ``call_id``."""

    call_id: int
    method: str
    args: tuple


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop (running requests are not finished: abort them first)."""


Command = Add | Abort | Call | Stop
