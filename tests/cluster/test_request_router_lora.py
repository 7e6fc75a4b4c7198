"""The request router and LoRA adapters, without Ray: a ``generate`` call's ``lora_name``
keyword reaches the policy, which sends it to the replica whose routing stats list the
adapter; a call without it routes as before.

``PrefixAwareRequestRouter`` driven with Serve's ``PendingRequest`` and stand-ins for
``RunningReplica`` whose routing stats are ``ReplicaStats.to_dict()``'s, as the replicas
report them.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.request_router import LORA_KWARG, request_adapter
from router.embedded_index import EmbeddedIndex
from router.protocol import ReplicaStats, adapter_namespace, hash_blocks
from tests.cluster.helpers import pending, request_router, running

BLOCK_SIZE = 16
MODEL_ID = "lora-model"
NUM_PROMPT_TOKENS = 256


def call(request_id: str, first_token: int, lora_name: str | None):
    """The ingress's ``generate.remote(...)`` for a cold prompt on ``lora_name``."""
    ids = [first_token] + [7] * (NUM_PROMPT_TOKENS - 1)
    hashes = hash_blocks(ids, BLOCK_SIZE, adapter_namespace(MODEL_ID, lora_name), None)
    pending_request = pending(request_id, ids, hashes)
    if lora_name is not None:
        pending_request.kwargs[LORA_KWARG] = lora_name
    return pending_request


def candidates():
    """Three idle replicas that measured a 0.1 s adapter load; "b" holds adapter "x"."""
    holder = ReplicaStats(lora_adapters=("x",), lora_load_s=0.1)
    other = ReplicaStats(lora_load_s=0.1)
    return [
        running("a", **other.to_dict()),
        running("b", **holder.to_dict()),
        running("c", **other.to_dict()),
    ]


def chosen(router, calls) -> list[str]:
    """Each call's chosen replica, decided one after another (``calls``: ``call``'s
    arguments); each decision queues its request's prefill on its replica, as Serve's router
    tells the tracker."""

    async def main():
        return [
            (await router.choose_replicas(candidates(), call(*c)))[0][0].replica_id.unique_id
            for c in calls
        ]

    return asyncio.run(main())


def lora_router():
    # The default policy; no load bound, so a run of one adapter's requests stays together.
    return request_router({"block_size": BLOCK_SIZE, "max_load_ratio": None}, EmbeddedIndex())


def test_an_adapters_calls_go_to_the_replica_whose_stats_list_it_until_its_queue_costs_more():
    # 256-token prompts at the default 8000 tokens/s: each queued one costs the next 0.052 s
    # (its prefill and a decode step); the load elsewhere 0.2 s (0.1 s, miss_cost_factor 2).
    # "b" takes four; the fifth loads the adapter on another replica, where the next three
    # follow it (the router counts that replica as holding the adapter now).
    result = chosen(lora_router(), [(f"x{i}", 100 + i, "x") for i in range(8)])
    assert result[:4] == ["b"] * 4, result
    assert result[4] != "b" and result[4:] == [result[4]] * 4, result


def test_calls_without_an_adapter_route_as_before():
    # Cold prompts of the base model: spread by the queue each one adds, "b" no dearer.
    result = chosen(lora_router(), [(f"base{i}", 100 + i, None) for i in range(6)])
    assert sorted(result) == ["a", "a", "b", "b", "c", "c"], result


def test_calls_on_an_adapter_no_replica_holds_gather_where_the_first_went():
    result = chosen(lora_router(), [(f"y{i}", 100 + i, "y") for i in range(4)])
    assert len(set(result)) == 1, result


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"lora_name": "x"}, "x"),
        ({"lora_name": None}, None),
        ({}, None),
        ({"lora_name": ""}, None),
        ({"lora_name": 3}, None),
    ],
)
def test_request_adapter_reads_the_lora_name_keyword(kwargs, expected):
    async def main():
        pending_request = pending("r", [1] * 16, [])
        pending_request.kwargs.update(kwargs)
        return request_adapter(pending_request)

    assert asyncio.run(main()) == expected
    assert request_adapter(None) is None
