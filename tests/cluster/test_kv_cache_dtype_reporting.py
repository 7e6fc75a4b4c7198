"""``--kv-cache-dtype`` from the command line and a ``--config`` file into ``EngineConfig``, and
the replica's KV cache configuration at ``/metrics`` (``cache_config_info``). No Ray: the parser
and the replica's snapshot are driven directly."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli import build_parser, main
from cluster.cli_options import args_from_namespace
from cluster.config import API_KEY_ENV, configs_from_args
from cluster.metrics_render import render_prometheus
from cluster.metrics_snapshots import ReplicaMetrics
from cluster.replica import EngineReplica


def parse(*argv: str) -> dict:
    return args_from_namespace(build_parser().parse_args(["serve", *argv]))


def samples(text: bytes, family: str) -> dict[tuple, float]:
    """``{sorted labels: value}`` of one family; KeyError when it is absent."""
    for fam in text_string_to_metric_families(text.decode()):
        if fam.name == family:
            assert fam.type == "gauge"
            return {tuple(sorted(s.labels.items())): s.value for s in fam.samples}
    raise KeyError(family)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_the_flag_sets_the_engine_config(monkeypatch, kv_cache_dtype):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engine, _, _ = configs_from_args(parse("--kv-cache-dtype", kv_cache_dtype))
    assert engine.kv_cache_dtype == kv_cache_dtype


def test_left_out_it_is_auto_and_the_help_shows_it(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engine, _, _ = configs_from_args(parse())
    assert engine.kv_cache_dtype == "auto"
    assert "kv_cache_dtype" not in parse()["engine"]  # the dataclass default applies
    (serve,) = [
        action.choices["serve"]
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    (flag,) = [action for action in serve._actions if action.dest == "kv_cache_dtype"]
    assert flag.option_strings == ["--kv-cache-dtype"]
    assert "int8" in flag.help and "fp8_e4m3" in flag.help
    assert flag.help.endswith("(default: auto).")


def test_a_config_file_sets_it_and_the_command_line_wins(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = tmp_path / "serve.yaml"
    config.write_text("kv-cache-dtype: fp8_e4m3\n")
    engine, _, _ = configs_from_args(parse("--config", str(config)))
    assert engine.kv_cache_dtype == "fp8_e4m3"
    engine, _, _ = configs_from_args(parse("--config", str(config), "--kv-cache-dtype", "int8"))
    assert engine.kv_cache_dtype == "int8"
    config.write_text("kv_cache_dtype: int8\n")
    engine, _, _ = configs_from_args(parse("--config", str(config)))
    assert engine.kv_cache_dtype == "int8"


def test_an_unknown_format_exits_2_naming_the_field(capsys):
    assert main(["serve", "--kv-cache-dtype", "int4"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype" in err and "int4" in err


def _snapshot(block_size: int, kv_cache_dtype: str, model_name: str = "tiny") -> dict:
    """``EngineReplica.metrics_snapshot`` of a replica whose engine has this configuration
    (all the method reads of the replica and its engine)."""
    engine = SimpleNamespace(
        config=SimpleNamespace(
            block_size=block_size, kv_cache_dtype=kv_cache_dtype, enable_lora=False
        ),
        metrics=dict,
        is_alive=lambda: True,
    )
    replica = SimpleNamespace(engine=engine, metrics=ReplicaMetrics(), model_name=model_name)
    return EngineReplica.func_or_class.metrics_snapshot(replica)


def test_each_replica_exports_its_cache_config_as_labels_of_a_gauge_of_1():
    snapshots = {"r1": _snapshot(16, "int8"), "r2": _snapshot(32, "auto")}
    found = samples(render_prometheus(snapshots), "prefixserve:cache_config_info")
    assert found == {
        (
            ("block_size", "16"),
            ("kv_cache_dtype", "int8"),
            ("model_name", "tiny"),
            ("replica", "r1"),
        ): 1.0,
        (
            ("block_size", "32"),
            ("kv_cache_dtype", "auto"),
            ("model_name", "tiny"),
            ("replica", "r2"),
        ): 1.0,
    }


def test_the_metrics_prefix_applies_and_the_snapshot_pickles_as_plain_data():
    import pickle

    snapshot = pickle.loads(pickle.dumps(_snapshot(16, "fp8_e4m3")))
    assert snapshot["info"] == {
        "cache_config_info": {"block_size": "16", "kv_cache_dtype": "fp8_e4m3"}
    }
    found = samples(render_prometheus({"r1": snapshot}, prefix="vllm"), "vllm:cache_config_info")
    ((labels, value),) = found.items()
    assert dict(labels)["kv_cache_dtype"] == "fp8_e4m3" and value == 1.0


def test_a_replica_without_the_info_has_no_series_and_breaks_nothing():
    """A snapshot of an older replica (no ``info``) beside a current one; an info series the
    renderer does not know is skipped, a label missing from the snapshot renders empty."""
    old = ReplicaMetrics().snapshot({"num_requests_running": 1}, alive=True, model_name="tiny")
    del old["info"]
    odd = ReplicaMetrics().snapshot(
        {},
        alive=True,
        model_name="tiny",
        info={"cache_config_info": {"kv_cache_dtype": "int8"}, "not_a_series_info": {"a": "b"}},
    )
    text = render_prometheus({"old": old, "new": _snapshot(16, "int8"), "odd": odd})
    found = samples(text, "prefixserve:cache_config_info")
    assert {dict(labels)["replica"]: dict(labels)["block_size"] for labels in found} == {
        "new": "16",
        "odd": "",
    }
    assert "not_a_series_info" not in text.decode()
    running = samples(text, "prefixserve:num_requests_running")
    assert running[(("model_name", "tiny"), ("replica", "old"))] == 1.0
