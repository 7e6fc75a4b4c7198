"""Stored responses, for the Responses API's ``previous_response_id``.

``ResponseStore`` keeps, per tenant (a digest of the request's API key: clients holding
different keys never see each other's responses), each stored response's conversation: the
chat messages that a follow-up puts before its own input (the response's input without its
instructions, then its output). At most ``max_entries`` responses are kept, the oldest
dropped first, each for ``ttl_s`` seconds; an unknown, expired or dropped id reads as None
(the endpoint's 404).

Every ingress replica must see every stored response, so the store is one Ray actor per
application (``store_actor``, named after the served model, created by the first ingress
replica that asks and found by the others). It lives in memory: a cluster restart, or the
loss of the process that holds it, forgets the responses.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

MAX_STORED_RESPONSES = 10_000
STORED_RESPONSE_TTL_S = 3600.0


def tenant_of(authorization: str | None) -> str:
    """The tenant a request belongs to: a digest of its Authorization header ('' without)."""
    if not authorization:
        return ""
    return hashlib.sha256(authorization.encode()).hexdigest()[:32]


class ResponseStore:
    def __init__(
        self, max_entries: int = MAX_STORED_RESPONSES, ttl_s: float = STORED_RESPONSE_TTL_S
    ) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("max_entries must be positive and ttl_s above 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[str, str], tuple[float, list[dict]]] = OrderedDict()

    def put(self, tenant: str, response_id: str, conversation: list[dict]) -> None:
        self._expire()
        self._entries[(tenant, response_id)] = (time.monotonic() + self.ttl_s, conversation)
        self._entries.move_to_end((tenant, response_id))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> list[dict] | None:
        self._expire()
        entry = self._entries.get((tenant, response_id))
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            key, (deadline, _) = next(iter(self._entries.items()))
            if deadline > now:
                break
            del self._entries[key]


def store_actor(app_name: str):
    """The application's one ``ResponseStore`` actor: created by the first caller, found by
    the rest (``get_if_exists``)."""
    import ray

    # No task events, like the index actor's (cluster/index_actor.py): a call per stored
    # response.
    actor_cls = ray.remote(num_cpus=0, enable_task_events=False)(ResponseStore)
    return actor_cls.options(name=f"prefixserve-responses-{app_name}", get_if_exists=True).remote()
