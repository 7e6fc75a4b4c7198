"""CLI flags -> config dataclasses, config validation, and Prometheus rendering (no Ray)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.cli import build_parser, main
from cluster.cli_options import args_from_namespace
from cluster.config import API_KEY_ENV, ClusterConfig, configs_from_args
from cluster.metrics import any_replica_serving
from cluster.metrics_render import render_prometheus
from cluster.metrics_snapshots import ReplicaMetrics
from router.config import RouterConfig
from worker.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


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
        ({"num_ingress_replicas": 0}, "num_ingress_replicas"),
        ({"num_replicas": 1, "max_ingress_replicas": 0}, "max_ingress_replicas"),
        ({"num_ingress_replicas": 3, "max_ingress_replicas": 2}, "max_ingress_replicas"),
        ({"ingress_target_ongoing_requests": 0}, "ingress_target_ongoing_requests"),
        ({"allowed_origins": [""]}, "allowed_origins"),
        ({"allowed_methods": 3}, "allowed_methods"),
        ({"root_path": "api/"}, "root_path"),
        ({"root_path": "/api/"}, "root_path"),
        ({"log_level": "loud"}, "log_level"),
        ({"handle_transport": "http"}, "handle_transport"),
        ({"served_model_name": " "}, "served_model_name"),
        ({"app_name": "a b"}, "app_name"),
    ],
)
def test_cluster_config_rejects_bad_values_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=f"ClusterConfig.{name}"):
        ClusterConfig(**fields)


def test_help_groups_flags_by_topic_and_shows_the_dataclass_defaults():
    from cluster.cli_flags import GROUPS, LIST, field_default, flag_rows

    (serve,) = [
        action.choices["serve"]
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    titles = [group.title for group in serve._action_groups]
    assert [t for t in titles if t in GROUPS.values()] == list(GROUPS.values())
    by_dest = {action.dest: action for action in serve._actions}
    for _, section, field, kind, _, _ in flag_rows():
        default = field_default(section, field)
        help_text = by_dest[field].help
        if default is None or default in ((), ""):
            continue  # the text says what unset means, in words
        if kind is None:
            shown = "on" if default else "off"
        else:
            shown = ",".join(default) if kind == LIST else str(default)
        assert help_text.endswith(f"(default: {shown}).".replace("%", "%%")), (field, help_text)
        assert help_text.count("(default") == 1, help_text  # never typed a second time
    assert by_dest["block_size"].help.endswith(f"(default: {EngineConfig().block_size}).")
    assert by_dest["num_replicas"].help.endswith(f"(default: {ClusterConfig().num_replicas}).")
    serve.format_help()  # every help string formats (no stray '%')


def test_positional_model_version_and_list_flags(monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert parse("/models/a")["engine"]["model"] == "/models/a"
    assert parse("/models/a", "--model", "/models/a")["engine"]["model"] == "/models/a"
    assert main(["serve", "/models/a", "--model", "/models/b"]) == 2
    assert "disagrees with --model" in capsys.readouterr().err
    args = parse("--allowed-origins", "http://a.example, http://b.example",
                 "--allowed-origins", "http://c.example",
                 "--allowed-methods", "GET,POST")  # fmt: skip
    _, cluster, _ = configs_from_args(args)
    assert cluster.allowed_origins == ("http://a.example", "http://b.example", "http://c.example")
    assert (cluster.allowed_methods, cluster.allowed_headers) == (("GET", "POST"), ("*",))
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("prefixserve ")


def test_config_file_keys_match_flags_and_the_command_line_wins(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /models/from-file\n"
        "max-num-seqs: 8\n"
        "max_model_len: '512'\n"
        "routing: round_robin\n"
        "num-replicas: 3\n"
        "enable-prefix-caching: false\n"
        "allowed-origins: [http://a.example]\n"
        "log-level: DEBUG\n"
        "port: 9001\n"
    )
    engine, cluster, router = configs_from_args(
        parse("--config", str(config), "--max-num-seqs", "4", "--port", "9002")
    )
    assert (engine.model, engine.max_num_seqs, engine.max_model_len) == (
        "/models/from-file",
        4,
        512,
    )
    assert engine.enable_prefix_caching is False and router.policy == "round_robin"
    assert (cluster.num_replicas, cluster.port, cluster.log_level) == (3, 9002, "debug")
    assert cluster.allowed_origins == ("http://a.example",)
    assert (
        parse("/models/positional", "--config", str(config))["engine"]["model"]
        == "/models/positional"
    )

    for text, named in (
        ("max-num-seq: 8\n", "max-num-seq"),
        ("max-num-seqs: many\n", "max-num-seqs"),
        ("enable-prefix-caching: 1\n", "enable-prefix-caching"),
        ("- just a list\n", "mapping"),
    ):
        config.write_text(text)
        assert main(["serve", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert named in err and str(config) in err, err


def test_detach_needs_a_running_ray_cluster(capsys):
    assert main(["serve", "--detach"]) == 2
    assert "--detach needs --address" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("device", "tp", "cluster_gpus", "explicit", "gpus"),
    [
        ("cpu", 1, 8.0, None, 0.0),
        ("cuda", 1, 0.0, None, 1.0),  # one GPU per replica: replicas never share cuda:0
        ("cuda:1", 2, 0.0, None, 1.0),
        ("auto", 1, 8.0, None, 1.0),  # the cluster has GPUs
        ("auto", 4, 8.0, None, 1.0),
        ("auto", 1, 0.0, None, 0.0),  # CPU-only cluster
        ("cuda", 1, 0.0, 0.5, 0.5),  # explicit: two replicas per GPU
        ("auto", 2, 8.0, 0.0, 0.0),
    ],
)
def test_replicas_reserve_one_gpu_per_rank_on_cuda(device, tp, cluster_gpus, explicit, gpus):
    from ray import serve

    from cluster.app import engine_replica_options, gpus_per_replica
    from cluster.replica import EngineReplica

    cluster = ClusterConfig(num_gpus_per_replica=explicit, num_cpus_per_replica=2)
    assert gpus_per_replica(device, cluster, cluster_gpus) == gpus
    if device == "auto" and not _engine_accepts_auto():
        return
    engine = EngineConfig(device=device, tensor_parallel_size=tp)
    options = engine_replica_options(engine, cluster, RouterConfig(), cluster_gpus)
    assert options["ray_actor_options"]["num_cpus"] == 2
    assert options["ray_actor_options"]["num_gpus"] == gpus
    if tp == 1:
        assert "placement_group_bundles" not in options
    else:
        bundle = {"CPU": 2, "GPU": gpus} if gpus else {"CPU": 2}
        assert options["placement_group_bundles"] == [bundle] * tp
        assert options["placement_group_strategy"] == "STRICT_PACK"
    # Serve accepts the options (its own validation; no Ray started).
    deployment = EngineReplica.options(**options)
    assert isinstance(deployment, serve.Deployment)
    assert deployment.ray_actor_options["num_gpus"] == gpus


def _engine_accepts_auto() -> bool:
    try:
        EngineConfig(device="auto")
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    ("fields", "replicas", "autoscaling"),
    [
        ({}, 2, None),  # two engine replicas: two ingress replicas
        ({"num_replicas": 1}, 1, None),
        ({"num_replicas": 1, "num_ingress_replicas": 3}, 3, None),
        ({"num_ingress_replicas": 2, "max_ingress_replicas": 2}, 2, None),
        (
            {"max_ingress_replicas": 6, "ingress_target_ongoing_requests": 32},
            None,
            {
                "min_replicas": 2,
                "initial_replicas": 2,
                "max_replicas": 6,
                "target_ongoing_requests": 32,
            },
        ),
    ],
)
def test_ingress_replicas_and_autoscaling(fields, replicas, autoscaling):
    from cluster.app import LOG_LEVEL_ENV, ingress_options
    from cluster.ingress import Ingress

    cluster = ClusterConfig(**fields, log_level="warning")
    options = ingress_options(cluster)
    assert options.get("num_replicas") == replicas
    assert options.get("autoscaling_config") == autoscaling
    assert options["ray_actor_options"]["num_cpus"] == 0
    assert options["ray_actor_options"]["runtime_env"]["env_vars"][LOG_LEVEL_ENV] == "WARNING"
    assert options["logging_config"]["log_level"] == "WARNING"
    deployment = Ingress.options(**options)  # Serve's own validation of the options
    if autoscaling is None:
        assert deployment.num_replicas == replicas
    else:
        config = deployment._deployment_config.autoscaling_config
        assert (config.min_replicas, config.max_replicas) == (2, 6)
        assert config.target_ongoing_requests == 32


def test_serve_config_yaml_builds_the_app_with_the_cluster_fields():
    import yaml

    from cluster.app import build_app

    path = REPO_ROOT / "deploy" / "serve_config.yaml"
    (app_config,) = yaml.safe_load(path.read_text())["applications"]
    args = app_config["args"]
    _, cluster, _ = configs_from_args(args)
    assert cluster.ingress_replicas == 2  # two engine replicas
    build_app(args)  # binds every deployment with Serve's validation; no Ray needed


def test_builder_args_reject_unknown_sections_fields_and_block_size_mismatch():
    with pytest.raises(ValueError, match="unknown section"):
        configs_from_args({"engines": {}})
    with pytest.raises(ValueError, match="num_replica"):
        configs_from_args({"cluster": {"num_replica": 2}})
    with pytest.raises(ValueError, match="block_size"):
        configs_from_args({"engine": {"block_size": 16}, "router": {"block_size": 32}})


def test_prometheus_text_has_vllm_names_labels_and_histograms():
    metrics = ReplicaMetrics()
    metrics.observe("engine_time_to_first_token_seconds", 0.03)
    metrics.observe("engine_time_to_first_token_seconds", 0.5)
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
        "prefixserve:engine_time_to_first_token_seconds_bucket"
        '{le="0.04",model_name="tiny",replica="r1"} 1.0' in text
    )
    assert f"prefixserve:engine_time_to_first_token_seconds_count{labels} 2.0" in text
    assert "# TYPE prefixserve:engine_e2e_request_latency_seconds histogram" in text
    assert any_replica_serving(snapshots)
    assert not any_replica_serving({"r1": {**snapshots["r1"], "alive": False}})


def test_router_snapshot_renders_as_router_series():
    from router.metrics import RouterMetrics

    router = RouterMetrics()
    from router.policy import RoutingReason

    router.record_decision(
        "prefix", RoutingReason.PREFIX, num_prompt_blocks=4, num_matched_blocks=3
    )
    router.record_lookup(0.2)
    router.record_decision_latency(0.9, 0.4)
    router.record_decision_latency(7.0)  # no CPU time given: the wall histogram alone
    text = render_prometheus({}, router.snapshot()).decode()
    assert 'prefixserve:router_decisions_total{policy="prefix",reason="prefix"} 1.0' in text
    assert "prefixserve:router_matched_blocks_total 3.0" in text
    assert "prefixserve:router_prompt_blocks_total 4.0" in text
    assert "prefixserve:router_lookup_latency_seconds_count 1.0" in text
    assert "prefixserve:router_decision_latency_seconds_count 2.0" in text
    assert 'prefixserve:router_decision_latency_seconds_bucket{le="0.001"} 1.0' in text
    assert "prefixserve:router_decision_cpu_seconds_count 1.0" in text
    assert 'prefixserve:router_decision_cpu_seconds_bucket{le="0.0005"} 1.0' in text


def test_metrics_hub_counts_busy_requests_and_drops_stale_replicas(monkeypatch):
    import asyncio

    from cluster import metrics

    hub = metrics.MetricsHub.func_or_class()
    busy = {"engine": {"num_requests_running": 2, "num_requests_waiting": 1}, "alive": True}
    asyncio.run(hub.report("r1", busy))
    assert list(asyncio.run(hub.snapshots())) == ["r1"]  # what a drain tells, and waits for
    assert metrics.num_busy_requests(asyncio.run(hub.snapshots())) == 3
    later_s = metrics.time.monotonic() + metrics.STALE_AFTER_S + 1.0
    monkeypatch.setattr(metrics.time, "monotonic", lambda: later_s)
    assert asyncio.run(hub.snapshots()) == {}  # a replica that stopped pushing no longer counts


def test_a_drain_order_lets_requests_finish_then_aborts_the_rest_once():
    """``EngineReplica.begin_drain``: what is in flight after the grace period is aborted
    (finish_reason abort reaches the client); a second order starts no second drain."""
    import asyncio
    from types import SimpleNamespace

    from cluster.replica import EngineReplica

    aborted: list[str] = []
    replica = object.__new__(EngineReplica.func_or_class)
    replica.engine = SimpleNamespace(abort=aborted.append)
    replica._in_flight, replica._drain_task = {"done-in-time", "slow"}, None

    async def main():
        await replica.begin_drain(0.2)
        first = replica._drain_task
        await asyncio.sleep(0.05)
        replica._in_flight.discard("done-in-time")  # finished within the grace period
        await replica.begin_drain(0.0)
        assert replica._drain_task is first
        await first

    asyncio.run(main())
    assert aborted == ["slow"]


def test_deployments_run_serve_code_on_the_loop_that_receives_it(monkeypatch):
    """Serve's throughput-optimized event loops and its once-a-second metrics export reach
    both deployments' processes, unless the deploying environment says otherwise."""
    from cluster.app import SERVE_ENV, engine_replica_options, ingress_options

    for name in SERVE_ENV:
        monkeypatch.delenv(name, raising=False)
    cluster = ClusterConfig()
    engine_env = engine_replica_options(EngineConfig(), cluster, RouterConfig())[
        "ray_actor_options"
    ]["runtime_env"]["env_vars"]
    ingress_env = ingress_options(cluster)["ray_actor_options"]["runtime_env"]["env_vars"]
    for env in (engine_env, ingress_env):
        assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
        assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
        assert env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")
    monkeypatch.setenv("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "100")
    ingress_env = ingress_options(cluster)["ray_actor_options"]["runtime_env"]["env_vars"]
    assert ingress_env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"
    assert ingress_env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "100"


def test_lora_flags_take_vllm_forms_and_reach_the_engine_config(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engine, _, _ = configs_from_args(parse("/models/base"))
    assert (engine.enable_lora, engine.lora_modules, engine.max_loras) == (False, (), 8)
    args = parse(
        "/models/base",
        "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}',
        "--lora-modules", "eq=/adapters/a=b",
        "--max-loras", "2", "--max-lora-rank", "64",
    )  # fmt: skip
    engine, _, _ = configs_from_args(args)
    assert engine.lora_modules == (
        ("sql", "/adapters/sql"),
        ("chat", "/adapters/chat"),
        ("eq", "/adapters/a=b"),
    )
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 2, 64)
    engine, _, _ = configs_from_args(parse("/models/base", "--enable-lora"))
    assert engine.enable_lora and engine.lora_modules == ()

    config = tmp_path / "serve.yaml"
    config.write_text(
        "lora-modules:\n  - sql=/adapters/sql\n  - {name: chat, path: /adapters/chat}\n"
    )
    engine, _, _ = configs_from_args(parse("/models/base", "--config", str(config)))
    assert engine.lora_modules == (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))
    config.write_text("lora_modules: {sql: /adapters/sql}\n")
    engine, _, _ = configs_from_args(parse("/models/base", "--config", str(config)))
    assert engine.lora_modules == (("sql", "/adapters/sql"),)

    for bad in ("sql", '{"name": "sql"}', "{not json"):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "/models/base", "--lora-modules", bad])
        assert exit_info.value.code == 2
        assert "argument --lora-modules" in capsys.readouterr().err
    config.write_text("lora-modules: [{name: sql}]\n")
    assert main(["serve", "/models/base", "--config", str(config)]) == 2
    assert "lora-modules" in capsys.readouterr().err
    assert main(["serve", "/models/base", "--lora-modules", "a=/x", "a=/y"]) == 2
    assert "given twice" in capsys.readouterr().err
