"""The ingress's models: what a request's ``model`` may name, the cards ``/v1/models`` shows,
and the LoRA adapters loaded and unloaded at runtime.

Owns the names: the base model answers to its served name (``--served-model-name``, else the
engine's model id) and, when no served name was given, to the model as the engine was
started with (``--model``); a LoRA adapter answers to its own name, which
``cluster.lora_adapters.AdapterCatalog`` knows (the engines' ``lora_modules`` and the runtime
loads recorded in the index actor). ``resolve`` turns a request's ``model`` into the adapter
it runs on; ``base_card``, ``cards`` and ``card`` are ``/v1/models``'s answers, vLLM's shape
(an adapter's ``parent`` is the base model's served name); ``load_adapter`` and
``unload_adapter`` are the runtime endpoints' work, on every engine replica
(``cluster.lora_adapters.load_everywhere``).

How it fails: a name that is neither the base model's nor an adapter's is a 404
``model_not_found``; the runtime endpoints answer 400 while the engines run without LoRA
(``--enable-lora``) and the errors ``load_everywhere``/``unload_everywhere`` give (400, 404,
409, 503).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cluster import errors
from cluster.lora_adapters import (
    AdapterCatalog,
    AdapterRecord,
    adapter_card,
    load_everywhere,
    unload_everywhere,
)


@dataclass
class ModelCatalog:
    """One ingress replica's models (module docstring)."""

    served_name: str
    """What responses name the base model, and what its card says."""
    model_id: str
    """The engines' model id (the base card's ``root``)."""
    max_model_len: int
    adapters: AdapterCatalog
    record: AdapterRecord
    """Where runtime loads and unloads are recorded (the index actor)."""
    engine_replicas: Callable[[], Awaitable[dict]]
    """The engine replicas serving now, as ``load_everywhere`` takes them."""
    other_names: tuple[str, ...] = ()
    """Names the base model also answers to (the model as given, without a served name)."""
    accepted_names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.accepted_names = frozenset({self.served_name, *self.other_names})

    async def resolve(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model, also when omitted); any
        other name is a 404 ``model_not_found``."""
        if model is None or model in self.accepted_names:
            return None
        if await self.adapters.lookup(model) is None:
            raise errors.model_not_found(model)
        return model

    # ---- /v1/models ------------------------------------------------------------------------
    def base_card(self) -> dict:
        return {
            "id": self.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "prefixserve",
            "root": self.model_id,
            "parent": None,
            "max_model_len": self.max_model_len,
        }

    def _adapter_card(self, name: str, path: str) -> dict:
        return adapter_card(name, path, self.served_name, self.max_model_len)

    async def cards(self) -> list[dict]:
        """The base model, then every LoRA adapter (``parent``: the base model)."""
        if self.adapters.enabled:
            await self.adapters.refresh()
        adapters = [self._adapter_card(name, path) for name, path in self.adapters.adapters.items()]
        return [self.base_card(), *adapters]

    async def card(self, model_id: str) -> dict:
        """One model's card: the base model under any name it answers to, or an adapter's;
        anything else is a 404 ``model_not_found``."""
        if model_id in self.accepted_names:
            return self.base_card()
        path = await self.adapters.lookup(model_id)
        if path is None:
            raise errors.model_not_found(model_id)
        return self._adapter_card(model_id, path)

    # ---- adapters at runtime ---------------------------------------------------------------
    def _require_lora(self) -> None:
        if not self.adapters.enabled:
            raise errors.bad_request(
                "LoRA adapters are off on this server: start it with --enable-lora (or "
                "--lora-modules) to load adapters at runtime"
            )

    async def load_adapter(self, name: str, path: str) -> str:
        """vLLM's runtime load onto every engine replica; its success text."""
        self._require_lora()
        return await load_everywhere(
            self.adapters, self.record, self.engine_replicas, name, path, self.accepted_names
        )

    async def unload_adapter(self, name: str) -> str:
        """vLLM's runtime unload from every engine replica; its success text."""
        self._require_lora()
        return await unload_everywhere(self.adapters, self.record, self.engine_replicas, name)
