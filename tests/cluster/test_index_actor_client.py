"""``cluster.index_actor.ActorIndexClient``'s failures, without Ray: what the router's
awaited lookup raises when the index actor is slow, gone or failing (the router then routes
by load: ``router.index.FallbackIndex``)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from cluster.index_actor import ActorIndexClient
from router.config import RouterConfig
from router.index_types import IndexUnavailableError


class _Actor:
    """An index actor whose ``match.remote`` stalls, raises, or answers."""

    def __init__(self, outcome) -> None:
        outcome_of = self

        class match:  # noqa: N801 - the actor method's name
            @staticmethod
            def remote(block_hashes):
                return outcome_of.answer(block_hashes)

        self.match = match
        self.outcome = outcome

    async def answer(self, block_hashes):
        if self.outcome == "stall":
            await asyncio.sleep(10)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return {"r1": self.outcome}


def client_with(outcome) -> ActorIndexClient:
    client = ActorIndexClient("app", RouterConfig(redis_socket_timeout_s=0.05))
    client._actor = _Actor(outcome)
    return client


@pytest.mark.parametrize(
    ("outcome", "message", "actor_kept"),
    [
        ("stall", "took over", True),
        (ValueError("Failed to look up actor"), "unreachable", False),
        (ray.exceptions.RayError("boom"), "call failed", True),
    ],
)
def test_an_awaited_lookup_that_fails_says_the_index_is_unavailable(outcome, message, actor_kept):
    client = client_with(outcome)
    with pytest.raises(IndexUnavailableError, match=message):
        asyncio.run(client.match_async([b"h"]))
    assert (client._actor is not None) == actor_kept  # a gone actor is resolved anew


def test_an_awaited_lookup_answers_the_actors_matches():
    assert asyncio.run(client_with("m").match_async([b"h"])) == {"r1": "m"}
