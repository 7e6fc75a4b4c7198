"""The Prometheus export, parsed with prometheus_client's own text parser.

The ingress's request-level series (vLLM's names, ``model_name`` label, summed over ingress
replicas), the engine-side phase histograms a replica observes from the engine's timestamps,
the router's dropped-speculation counter, and ``--metrics-prefix``. No Ray: the classes the
deployments run are driven directly (the real cluster's /metrics is checked in
``tests/cluster/tiny/test_serve_openai.py``).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import metrics
from cluster.cli import build_parser
from cluster.cli_options import args_from_namespace
from cluster.config import ClusterConfig, configs_from_args
from cluster.metrics_render import render_prometheus
from cluster.metrics_series import token_buckets
from cluster.metrics_snapshots import IngressMetrics, ReplicaMetrics, sum_ingress_snapshots
from cluster.replica import EngineReplica
from cluster.stream_items import prefill_time_s
from router.metrics import RouterMetrics
from router.policy import RoutingReason
from worker.outputs import ChoiceDelta, FinishReason, OutputDelta

MODEL = "tiny"


def parse(text: bytes) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": {(sample name, labels as a sorted tuple): value}}}"""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        out[family.name] = {"type": family.type, "samples": samples}
    return out


def value(families: dict, family: str, sample: str, **labels) -> float:
    return families[family]["samples"][(sample, tuple(sorted(labels.items())))]


def one_ingress(ttft_s: float, prefill_s: float, reasons: list[str | None]) -> IngressMetrics:
    """An ingress that served one request of ``len(reasons)`` choices, 4 tokens each."""
    ingress = IngressMetrics(max_model_len=1000)
    times = {
        "arrival_time": 9.9,
        "first_scheduled_time": 10.0,
        "first_token_time": 10.0 + prefill_s,
    }
    first = OutputDelta("r", 30, 0, [ChoiceDelta(0, [1])], metrics=times)
    ingress.started(10.0, [first], now_s=10.0 + ttft_s)
    choices = [(reason, 4) for reason in reasons]
    ingress.finished(10.0, 10.0 + ttft_s + 1.0, [30], choices, unfinished_reason="abort")
    return ingress


def test_token_buckets_are_vllms_1_2_5_series_up_to_the_context():
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_buckets(2048)[-1] == 2000
    assert token_buckets(1) == (1,)


def test_ingress_series_have_vllms_names_types_labels_and_buckets_under_the_vllm_prefix():
    router = RouterMetrics()
    router.record_decision("prefix", RoutingReason.PREFIX, 4, 3)
    router.record_dropped_speculation()
    ingress = one_ingress(ttft_s=0.3, prefill_s=0.1, reasons=["stop", None])
    snapshot = sum_ingress_snapshots([ingress.snapshot(MODEL, router.snapshot())])
    text = render_prometheus({}, snapshot["router"], ingress_snapshot=snapshot, prefix="vllm:")
    families = parse(text)
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert families[name]["type"] == "histogram", name
        assert value(families, name, name + "_count", model_name=MODEL) == (
            2 if name == "vllm:request_generation_tokens" else 1
        ), name
    assert families["vllm:request_success"]["type"] == "counter"
    success = "vllm:request_success_total"
    assert (
        value(families, "vllm:request_success", success, model_name=MODEL, finished_reason="stop")
        == 1
    )
    # The second choice never finished: the client left, so it counts as an abort.
    assert (
        value(families, "vllm:request_success", success, model_name=MODEL, finished_reason="abort")
        == 1
    )
    assert (
        value(families, "vllm:request_success", success, model_name=MODEL, finished_reason="length")
        == 0
    )
    # vLLM's TTFT buckets: 0.3 s falls in le=0.5, not le=0.25.
    ttft = "vllm:time_to_first_token_seconds"
    assert value(families, ttft, ttft + "_bucket", model_name=MODEL, le="0.25") == 0
    assert value(families, ttft, ttft + "_bucket", model_name=MODEL, le="0.5") == 1
    assert value(families, ttft, ttft + "_bucket", model_name=MODEL, le="2560.0") == 1
    # Queue time is the TTFT less the engine's prefill.
    queue = "vllm:request_queue_time_seconds"
    assert value(families, queue, queue + "_sum", model_name=MODEL) == pytest.approx(0.2)
    prompt = "vllm:request_prompt_tokens"
    assert value(families, prompt, prompt + "_bucket", model_name=MODEL, le="20.0") == 0
    assert value(families, prompt, prompt + "_bucket", model_name=MODEL, le="50.0") == 1
    assert value(families, prompt, prompt + "_sum", model_name=MODEL) == 30
    dropped = "vllm:router_dropped_speculations"
    assert value(families, dropped, dropped + "_total") == 1
    assert not [name for name in families if not name.startswith("vllm:")]


def test_ingress_replicas_sum_and_the_hub_keeps_an_ingress_that_stopped(monkeypatch):
    first_router, second_router = RouterMetrics(), RouterMetrics()
    first_router.record_dropped_speculation()
    second_router.record_dropped_speculation()
    second_router.record_dropped_speculation()
    second_router.record_decision("prefix", RoutingReason.FALLBACK, 2, 0)
    hub = metrics.MetricsHub.func_or_class()
    asyncio.run(
        hub.report_ingress(
            "a", one_ingress(0.3, 0.1, ["stop"]).snapshot(MODEL, first_router.snapshot())
        )
    )
    asyncio.run(
        hub.report_ingress(
            "b", one_ingress(2.0, 0.5, ["length"]).snapshot(MODEL, second_router.snapshot())
        )
    )
    later_s = metrics.time.monotonic() + metrics.STALE_AFTER_S + 1.0
    monkeypatch.setattr(metrics.time, "monotonic", lambda: later_s)
    # counters: an ingress gone quiet still counts, or the sum would drop
    export = asyncio.run(hub.export())
    assert sorted(export["ingresses"]) == ["a", "b"]
    total = sum_ingress_snapshots(export["ingresses"].values())
    families = parse(render_prometheus(export["replicas"], total["router"], ingress_snapshot=total))
    ttft = "prefixserve:time_to_first_token_seconds"
    assert value(families, ttft, ttft + "_count", model_name=MODEL) == 2
    assert value(families, ttft, ttft + "_sum", model_name=MODEL) == pytest.approx(2.3)
    assert value(families, ttft, ttft + "_bucket", model_name=MODEL, le="0.5") == 1
    assert value(families, ttft, ttft + "_bucket", model_name=MODEL, le="2.5") == 2
    success = "prefixserve:request_success"
    for reason in ("stop", "length"):
        assert (
            value(families, success, success + "_total", model_name=MODEL, finished_reason=reason)
            == 1
        )
    dropped = "prefixserve:router_dropped_speculations"
    assert value(families, dropped, dropped + "_total") == 3
    fallback = "prefixserve:router_fallback_decisions"
    assert value(families, fallback, fallback + "_total") == 1


def test_replica_observes_the_engine_phases_from_the_engines_timestamps():
    replica = SimpleNamespace(metrics=ReplicaMetrics())  # all that _observe touches
    observe = EngineReplica.func_or_class._observe
    times = {"arrival_time": 100.0, "first_scheduled_time": 100.5, "first_token_time": 101.25}

    def output(finished: bool, metrics: dict | None = None) -> OutputDelta:
        reason = FinishReason.LENGTH if finished else None
        choice = ChoiceDelta(0, [1], finish_reason=reason)
        return OutputDelta("r", 2, 0, [choice], finished=finished, metrics=metrics)

    assert prefill_time_s(output(False, times)) == pytest.approx(0.75)
    assert prefill_time_s(output(False, {"arrival_time": 100.0, "first_token_time": 101.0})) is None
    assert prefill_time_s(output(False)) is None  # a delta between the first and the last

    observe(replica, output(False, times), now_s=101.3, last_step_s=None)
    observe(replica, output(False), now_s=101.5, last_step_s=101.3)
    observe(
        replica, output(True, {**times, "finished_time": 104.0}), now_s=104.1, last_step_s=101.5
    )
    snapshot = replica.metrics.snapshot({}, alive=True, model_name=MODEL)
    families = parse(render_prometheus({"r1": snapshot}, prefix="vllm"))  # ':' added
    labels = {"model_name": MODEL, "replica": "r1"}
    for name, expected_s in (
        ("engine_queue_time_seconds", 0.5),
        ("engine_time_to_first_token_seconds", 1.25),
        ("request_prefill_time_seconds", 0.75),
        ("request_decode_time_seconds", 2.75),
        ("request_inference_time_seconds", 3.5),
        ("engine_e2e_request_latency_seconds", 4.0),
    ):
        family = "vllm:" + name
        assert value(families, family, family + "_count", **labels) == 1, name
        assert value(families, family, family + "_sum", **labels) == pytest.approx(expected_s), name
    itl = "vllm:inter_token_latency_seconds"
    assert value(families, itl, itl + "_count", **labels) == 2


def test_metrics_prefix_flag_and_field():
    assert ClusterConfig().prometheus_prefix == "prefixserve:"
    assert ClusterConfig(metrics_prefix="vllm").prometheus_prefix == "vllm:"
    assert ClusterConfig(metrics_prefix="vllm:").prometheus_prefix == "vllm:"
    for bad in ("", "9lives", "a-b", "vllm::", 3):
        with pytest.raises(ValueError, match="ClusterConfig.metrics_prefix"):
            ClusterConfig(metrics_prefix=bad)
    namespace = build_parser().parse_args(["serve", "--metrics-prefix", "vllm"])
    _, cluster, _ = configs_from_args(args_from_namespace(namespace))
    assert cluster.prometheus_prefix == "vllm:"


@pytest.mark.parametrize("process", ["replica", "ingress"])
def test_a_process_pushes_a_changed_snapshot_at_once_and_an_unchanged_one_every_few_seconds(
    process, monkeypatch
):
    """The engine replica's and the ingress's push loops (``push_snapshots_forever``), on a
    fake clock: what changed goes every period; what did not, only every
    ``UNCHANGED_PUSH_S``, so the hub (``STALE_AFTER_S``) keeps the series of an idle replica."""
    from cluster.ingress import Ingress

    assert metrics.UNCHANGED_PUSH_S < metrics.STALE_AFTER_S
    clock = {"now": 0.0}
    snapshots = iter([{"n": 1}] * 5 + [{"n": 2}] + [{"n": 2}] * 4)
    pushed: list[tuple[float, str, dict]] = []

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        async def remote(self, sender_id, snapshot):  # Ray's shape: hub.report.remote(...)
            pushed.append((clock["now"], f"{self.name}:{sender_id}", snapshot))

    async def sleep(seconds):
        clock["now"] += seconds
        if clock["now"] >= 10:
            raise asyncio.CancelledError

    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(metrics.asyncio, "sleep", sleep)
    hub = SimpleNamespace(report=Method("report"), report_ingress=Method("report_ingress"))
    if process == "replica":
        fake = SimpleNamespace(_hub=hub, replica_id="r1", metrics_snapshot=lambda: next(snapshots))
        loop, sender = EngineReplica.func_or_class._push_metrics_forever(fake), "report:r1"
    else:
        fake = SimpleNamespace(
            _hub=hub, _ingress_id="i1", _metrics_snapshot=lambda: next(snapshots)
        )
        loop, sender = Ingress.func_or_class._push_metrics_forever(fake), "report_ingress:i1"
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(loop)
    # Unchanged: pushed at 0 and 3; changed at 5; unchanged again: 8 (3 s after 5).
    assert [t for t, _, _ in pushed] == [0.0, 3.0, 5.0, 8.0]
    assert {who for _, who, _ in pushed} == {sender}
    assert [s["n"] for _, _, s in pushed] == [1, 1, 2, 2]
