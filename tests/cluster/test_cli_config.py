"""CLI flags -> config dataclasses, config validation, and Prometheus rendering (no Ray)."""

from __future__ import annotations

import pytest

from cluster.cli import API_KEY_ENV, args_from_namespace, build_parser, main
from cluster.config import ClusterConfig, configs_from_args
from cluster.metrics import ReplicaMetrics, any_replica_serving, render_prometheus


def parse(*argv: str) -> dict:
    return args_from_namespace(build_parser().parse_args(["serve", *argv]))


def test_no_flags_means_dataclass_defaults(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engine, cluster, router = configs_from_args(parse())
    assert engine.model == "smollm2"
    assert (cluster.num_replicas, cluster.host, cluster.port, cluster.api_key) == (
        2,
        "127.0.0.1",
        8000,
        None,
    )
    assert router.policy == "prefix" and router.index_backend == "embedded"
    assert router.block_size == engine.block_size


def test_flags_map_onto_each_layer(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = parse(
        "--model",
        "/m",
        "--block-size",
        "32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
        "--no-enable-prefix-caching",
        "--num-kv-blocks",
        "100",
        "--dtype",
        "bfloat16",
        "--seed",
        "3",
        "--no-deterministic",
        "--served-model-name",
        "tiny",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--api-key",
        "k",
        "--num-replicas",
        "3",
        "--max-ongoing-requests",
        "16",
        "--routing",
        "pow2",
        "--redis-url",
        "redis://h:1",
        "--num-threads",
        "1",
        "--max-load-ratio",
        "1.5",
        "--speculative-ttl-s",
        "60",
    )
    engine, cluster, router = configs_from_args(args)
    assert engine.num_threads == 1
    assert (router.max_load_ratio, router.speculative_ttl_s) == (1.5, 60.0)
    assert (engine.model, engine.block_size, engine.max_model_len, engine.max_num_seqs) == (
        "/m",
        32,
        512,
        8,
    )
    assert (engine.max_num_batched_tokens, engine.enable_prefix_caching, engine.num_kv_blocks) == (
        64,
        False,
        100,
    )
    assert (engine.dtype, engine.seed, engine.deterministic) == ("bfloat16", 3, False)
    assert (cluster.served_model_name, cluster.host, cluster.port, cluster.api_key) == (
        "tiny",
        "0.0.0.0",
        9000,
        "k",
    )
    assert (cluster.num_replicas, cluster.max_ongoing_requests) == (3, 16)
    assert cluster.url == "http://127.0.0.1:9000"
    assert (router.policy, router.redis_url, router.index_backend, router.block_size) == (
        "pow2",
        "redis://h:1",
        "redis",
        32,
    )


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse()["cluster"]["api_key"] == "from-env"
    assert parse("--api-key", "flag")["cluster"]["api_key"] == "flag"


def test_bad_flag_exits_2_naming_the_field(capsys):
    assert main(["serve", "--num-replicas", "0"]) == 2
    assert "num_replicas" in capsys.readouterr().err
    assert main(["serve", "--num-kv-blocks", "10", "--kv-cache-bytes", "100"]) == 2
    with pytest.raises(SystemExit):
        main(["serve", "--routing-typo", "x"])


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"num_replicas": 0}, "num_replicas"),
        ({"port": 70000}, "port"),
        ({"max_ongoing_requests": True}, "max_ongoing_requests"),
        ({"max_queued_requests": 0}, "max_queued_requests"),
        ({"api_key": ""}, "api_key"),
        ({"max_request_body_bytes": 10}, "max_request_body_bytes"),
        ({"num_gpus_per_replica": -1}, "num_gpus_per_replica"),
        ({"served_model_name": " "}, "served_model_name"),
        ({"app_name": "a b"}, "app_name"),
    ],
)
def test_cluster_config_rejects_bad_values_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=f"ClusterConfig.{name}"):
        ClusterConfig(**fields)


def test_builder_args_reject_unknown_sections_fields_and_block_size_mismatch():
    with pytest.raises(ValueError, match="unknown section"):
        configs_from_args({"engines": {}})
    with pytest.raises(ValueError, match="num_replica"):
        configs_from_args({"cluster": {"num_replica": 2}})
    with pytest.raises(ValueError, match="block_size"):
        configs_from_args({"engine": {"block_size": 16}, "router": {"block_size": 32}})


def test_prometheus_text_has_vllm_names_labels_and_histograms():
    metrics = ReplicaMetrics()
    metrics.observe("time_to_first_token_seconds", 0.03)
    metrics.observe("time_to_first_token_seconds", 0.5)
    engine = {
        "num_requests_running": 2,
        "num_requests_waiting": 1,
        "kv_cache_usage_perc": 0.25,
        "prefix_cache_queries_total": 40,
        "prefix_cache_hits_total": 16,
        "prompt_tokens_total": 40,
        "generation_tokens_total": 9,
        "num_preemptions_total": 0,
    }
    snapshots = {"r1": metrics.snapshot(engine, alive=True, model_name="tiny")}
    text = render_prometheus(snapshots).decode()
    labels = '{model_name="tiny",replica="r1"}'
    assert f"prefixserve:num_requests_running{labels} 2.0" in text
    assert f"prefixserve:kv_cache_usage_perc{labels} 0.25" in text
    assert f"prefixserve:prefix_cache_hits_total{labels} 16.0" in text
    assert f"prefixserve:generation_tokens_total{labels} 9.0" in text
    assert (
        'prefixserve:time_to_first_token_seconds_bucket{le="0.04",model_name="tiny",replica="r1"} 1.0'
        in text
    )
    assert f"prefixserve:time_to_first_token_seconds_count{labels} 2.0" in text
    assert "# TYPE prefixserve:e2e_request_latency_seconds histogram" in text
    assert any_replica_serving(snapshots)
    assert not any_replica_serving({"r1": {**snapshots["r1"], "alive": False}})


def test_router_snapshot_renders_as_router_series():
    from router.metrics import RouterMetrics

    router = RouterMetrics()
    from router.policy import RoutingReason

    router.record_decision("prefix", RoutingReason.PREFIX, num_prompt_blocks=4, num_matched_blocks=3)
    router.record_lookup(0.2)
    text = render_prometheus({}, router.snapshot()).decode()
    assert 'prefixserve:router_decisions_total{policy="prefix",reason="prefix"} 1.0' in text
    assert "prefixserve:router_matched_blocks_total 3.0" in text
    assert "prefixserve:router_prompt_blocks_total 4.0" in text
    assert "prefixserve:router_lookup_latency_seconds_count 1.0" in text


def test_metrics_hub_relays_a_drain_order_and_drops_stale_replicas(monkeypatch):
    from cluster import metrics

    hub = metrics.MetricsHub.func_or_class()
    busy = {"engine": {"num_requests_running": 2, "num_requests_waiting": 1}, "alive": True}
    assert hub.report("r1", busy) is None  # serving: no drain
    hub.begin_drain(5.0)
    assert 4.0 < hub.report("r1", busy) <= 5.0
    assert metrics.num_busy_requests(hub.snapshots()) == 3
    later_s = metrics.time.monotonic() + metrics.STALE_AFTER_S + 1.0
    monkeypatch.setattr(metrics.time, "monotonic", lambda: later_s)
    assert hub.snapshots() == {}  # a replica that stopped pushing no longer counts
    assert hub.report("r2", busy) == 0.0  # the drain deadline has passed
