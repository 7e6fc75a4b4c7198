"""The TP-worker fault where it differs from an engine replica kill, without a cluster.

When one tensor-parallel worker dies, its replica's actor lives on with a dead engine
(``tests/worker/test_tensor_parallel.py``: in-flight requests end with ``EngineDeadError``,
which ``EngineReplica.generate`` yields as a ``dead`` rejection) until Serve's health check
replaces it, seconds later. Unlike a killed replica, Serve keeps routing to it meanwhile, so:

- the dead replica must say so in its routing stats (``engine_alive``), and the request
  router must then leave it out even though it holds the request's whole prefix (otherwise
  every re-submission lands on it again);
- the ingress must fail a stream over when the ``dead`` rejection arrives mid-stream, and
  re-submit a request whose first answer is that rejection, so the client's stream holds
  exactly the tokens of a fault-free run;
- with no live replica the error still reaches the client after ``MAX_FAILOVERS`` tries and
  names the dead rank (what ``tests/cluster/test_tp_health.py`` sees with one replica).

``python -m bench.chaos --faults tp_worker_kill`` runs the fault end to end on a real TP cluster
(too slow to start for this suite on a 2-core machine: 50-120 s measured).
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from cluster import engine_client
from cluster.engine_client import MAX_FAILOVERS, EngineClient
from cluster.errors import APIError
from cluster.replica import EngineReplica
from cluster.request_router import live_replicas
from cluster.stream_items import Rejected, RejectKind
from router.protocol import ReplicaStats
from worker.outputs import ChoiceDelta, FinishReason, OutputDelta
from worker.sampling_params import SamplingParams

DEAD_MESSAGE = "engine r-dead is not running: tensor-parallel worker rank(s) [1] ended"
MAX_TOKENS = 12
PROMPT = list(range(100, 140))


def token(position: int) -> int:
    """The fake engine's greedy token at ``position``: the same on every replica."""
    return 1000 + 7 * position


class FakeReplica:
    """A replica's ``generate`` stream: tokens, or the ``dead`` rejection once its engine died
    (after ``die_after`` tokens of the first call it serves; at once for later calls)."""

    def __init__(self, replica_id: str, die_after: int | None = None) -> None:
        self.replica_id, self.die_after, self.dead = replica_id, die_after, False
        self.calls: list[dict] = []

    async def generate(self, request_id, prompt_ids, params, resume_token_ids=None, **_):
        self.calls.append({"request_id": request_id, "resume": list(resume_token_ids or ())})
        done = len(resume_token_ids or ())
        for seq in itertools.count():
            if self.dead or (self.die_after is not None and done >= self.die_after):
                self.dead = True
                yield Rejected(RejectKind.DEAD, DEAD_MESSAGE, self.replica_id)
                return
            finished = done + 1 == params.max_tokens
            choice = ChoiceDelta(
                0,
                [token(done)],
                f"<{done}>",
                finish_reason=FinishReason.LENGTH if finished else None,
            )
            yield OutputDelta(
                request_id,
                len(prompt_ids),
                0,
                [choice],
                finished,
                seq=seq,
                replica_id=self.replica_id,
            )
            done += 1
            if finished:
                return
            await asyncio.sleep(0)


class FakeResponse:
    def __init__(self, agen) -> None:
        self._agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._agen.__anext__()

    def cancel(self) -> None:
        pass


class ScriptedHandle:
    """A streaming handle whose router picks replicas in the order ``route`` gives (the
    last one from then on), and records which replica got each call."""

    def __init__(self, route: list[FakeReplica]) -> None:
        self.route, self.sent_to = list(route), []
        self.generate = SimpleNamespace(remote=self._remote)

    def _remote(self, *args, **kwargs):
        replica = self.route.pop(0) if len(self.route) > 1 else self.route[0]
        self.sent_to.append(replica.replica_id)
        return FakeResponse(replica.generate(*args, **kwargs))


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(engine_client, "FAILOVER_BACKOFF_S", 0.001)


def stream_tokens(handle: ScriptedHandle) -> list[int]:
    client = EngineClient(handle, block_size=16, cache_namespace="tiny")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def run() -> list[int]:
        opened = await client.open_all("cmpl-1", [PROMPT], [params], None)
        out: list[int] = []
        async for _, outputs in client.merge(opened):
            for item in outputs:
                for choice in item.choices:
                    out += choice.new_token_ids
        return out

    return asyncio.run(run())


EXPECTED = [token(i) for i in range(MAX_TOKENS)]


def test_a_stream_whose_tp_worker_dies_mid_way_resumes_elsewhere_with_the_same_tokens():
    dying, live = FakeReplica("r-dead", die_after=5), FakeReplica("r-live")
    # The first re-submission lands on the dead replica again (its stats not yet routed on).
    handle = ScriptedHandle([dying, dying, live])
    assert stream_tokens(handle) == EXPECTED
    assert handle.sent_to == ["r-dead", "r-dead", "r-live"]
    assert live.calls[-1]["resume"] == EXPECTED[:5]


def test_a_request_first_routed_to_a_dead_engine_is_re_submitted_before_streaming():
    dead, live = FakeReplica("r-dead", die_after=0), FakeReplica("r-live")
    handle = ScriptedHandle([dead, dead, live])
    assert stream_tokens(handle) == EXPECTED
    assert handle.sent_to == ["r-dead", "r-dead", "r-live"]
    assert len({c["request_id"] for c in dead.calls + live.calls}) == 3, "one id per attempt"


@pytest.mark.parametrize("die_after", [0, 5])
def test_with_no_live_replica_the_client_gets_the_dead_rank_after_the_retries(die_after):
    handle = ScriptedHandle([FakeReplica("r-dead", die_after=die_after)])
    with pytest.raises(APIError) as failure:
        stream_tokens(handle)
    assert failure.value.status == 503
    assert "rank(s) [1]" in failure.value.message
    assert len(handle.sent_to) == 1 + MAX_FAILOVERS


def routing_stats_of(alive: bool) -> dict:
    """``EngineReplica.record_routing_stats`` on a replica whose engine is alive or dead."""
    stats = ReplicaStats(num_running=1, prefill_tokens_per_s=2000.0, decode_tokens_per_s=50.0)
    engine = SimpleNamespace(
        stats=lambda: stats,
        is_alive=lambda: alive,
        config=SimpleNamespace(max_waiting_requests=1024),
        model_id="tiny",
    )
    return asyncio.run(
        EngineReplica.func_or_class.record_routing_stats(SimpleNamespace(engine=engine))
    )


def test_a_dead_engine_says_so_in_its_stats_and_the_request_router_leaves_it_out():
    alive, dead = routing_stats_of(alive=True), routing_stats_of(alive=False)
    assert alive["engine_alive"] is True and dead["engine_alive"] is False
    assert dead["num_running"] == alive["num_running"] == 1  # its own counts, not a disguise
    assert ReplicaStats.from_dict(dead).engine_alive is False
    r_dead = SimpleNamespace(name="r-dead", routing_stats=dead)
    r_live = SimpleNamespace(name="r-live", routing_stats=alive)
    # The dead replica holds the whole prompt and is idle: it is still not a candidate.
    assert live_replicas([r_dead, r_live]) == [r_live]
    fresh = SimpleNamespace(name="fresh", routing_stats=None)  # no stats yet: alive
    assert live_replicas([r_dead, fresh]) == [fresh]
    # Every engine dead: Serve keeps them all (its health check replaces them).
    both = [r_dead, SimpleNamespace(name="r-dead-2", routing_stats=dead)]
    assert live_replicas(both) == both
