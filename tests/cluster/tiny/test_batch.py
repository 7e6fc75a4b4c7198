"""``prefixserve batch`` against a real local cluster: interrupted halfway, resumed, every id
answered exactly once; plus the input rules users hit before any request is sent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.batch import answered_ids, parse_request, read_requests

NUM_REQUESTS = 50
# The batch subprocess imports torch (via the configs) before its first request; then 50
# tiny-model requests take seconds. Generous bounds for a loaded 2-core CI box.
BATCH_TIMEOUT_S = 300.0
POLL_INTERVAL_S = 0.01


def _write_requests(path: Path, num_requests: int) -> list[str]:
    """Half chat (Batch API lines), half completion (plain bodies with an id)."""
    ids = []
    with path.open("w") as out:
        for i in range(num_requests):
            custom_id = f"req-{i:03d}"
            ids.append(custom_id)
            if i % 2 == 0:
                line = {
                    "custom_id": custom_id,
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "messages": [{"role": "user", "content": f"Count to {i}."}],
                        "max_tokens": 24,
                        "temperature": 0,
                    },
                }
            else:
                line = {
                    "id": custom_id,
                    "prompt": f"Number {i} is",
                    "max_tokens": 24,
                    "temperature": 0,
                }
            out.write(json.dumps(line) + "\n")
    return ids


def _batch_command(server, input_path: Path, output_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "cluster.cli", "batch",
        "--input", str(input_path), "--output", str(output_path),
        "--url", server.url, "--api-key", server.api_key, "--no-progress", *extra,
    ]  # fmt: skip


def _output_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_batch_interrupted_halfway_then_resumed_answers_every_id_once(tiny_server, tmp_path):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _write_requests(input_path, NUM_REQUESTS)

    proc = subprocess.Popen(
        _batch_command(tiny_server, input_path, output_path, "--concurrency", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + BATCH_TIMEOUT_S
    while (
        not output_path.exists() or len(output_path.read_bytes().splitlines()) < NUM_REQUESTS // 2
    ):
        assert proc.poll() is None, f"batch ended early: {proc.stdout.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "batch made no progress"
        time.sleep(POLL_INTERVAL_S)
    proc.send_signal(signal.SIGKILL)  # the hardest interruption: no cleanup at all
    proc.wait(timeout=30)
    answered_before = answered_ids(output_path)
    assert NUM_REQUESTS // 2 <= len(answered_before) < NUM_REQUESTS

    resumed = subprocess.run(
        _batch_command(tiny_server, input_path, output_path, "--concurrency", "4"),
        capture_output=True,
        text=True,
        timeout=BATCH_TIMEOUT_S,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{len(answered_before)} already answered" in resumed.stderr

    records = _output_records(output_path)
    assert sorted(r["custom_id"] for r in records) == ids  # each id exactly once
    for record in records:
        assert record["response"]["status_code"] == 200, record
        assert record["error"] is None
        body = record["response"]["body"]
        choice = body["choices"][0]
        text = (
            choice["message"]["content"] if record["custom_id"][-1] in "02468" else choice["text"]
        )
        assert text, record
        assert body["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_ordered_batch_keeps_input_order_and_records_client_errors(tiny_server, tmp_path):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _write_requests(input_path, 8)
    with input_path.open("a") as out:  # a request the server rejects: answered, not retried
        out.write(json.dumps({"id": "too-long", "prompt": "hi", "max_tokens": 10**6}) + "\n")
    done = subprocess.run(
        _batch_command(tiny_server, input_path, output_path, "--ordered", "--concurrency", "4"),
        capture_output=True,
        text=True,
        timeout=BATCH_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = _output_records(output_path)
    assert [r["custom_id"] for r in records] == [*ids, "too-long"]
    rejected = records[-1]
    assert rejected["response"]["status_code"] == 400
    assert rejected["error"]["message"]


def test_input_formats_and_their_errors(tmp_path):
    chat = parse_request(json.dumps({"id": "a", "messages": [{"role": "user", "content": "x"}]}), 1)
    assert (chat.custom_id, chat.url, "id" in chat.body) == ("a", "/v1/chat/completions", False)
    completion = parse_request(json.dumps({"prompt": "x"}), 7)
    assert (completion.custom_id, completion.url) == ("7", "/v1/completions")
    for bad, message in [
        ("{not json", "line 3: invalid JSON"),
        (json.dumps({"id": "s", "prompt": "x", "stream": True}), "stream"),
        (json.dumps({"custom_id": "u", "url": "/v1/embeddings", "body": {}}), "url must be"),
        (
            json.dumps({"custom_id": "m", "method": "GET", "url": "/v1/completions", "body": {}}),
            "POST",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_request(bad, 3)
    duplicated = tmp_path / "dup.jsonl"
    duplicated.write_text('{"id": "x", "prompt": "a"}\n\n{"id": "x", "prompt": "b"}\n')
    with pytest.raises(ValueError, match="line 3: duplicate id 'x' \\(first on line 1\\)"):
        read_requests(duplicated)


def test_resume_drops_a_line_cut_short_by_a_kill(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text('{"custom_id": "a", "response": {}}\n{"custom_id": "b", "resp')
    assert answered_ids(output) == {"a"}
    assert output.read_text() == '{"custom_id": "a", "response": {}}\n'
    output.write_text('{"custom_id": "a"}\ngarbage\n{"custom_id": "c"}\n')
    with pytest.raises(ValueError, match="output line 2"):
        answered_ids(output)


@pytest.mark.slow
def test_dashboard_queries_name_metrics_the_server_exports(tiny_server):
    """Every engine metric the Grafana dashboard plots is in the live /metrics exposition."""
    import re

    import httpx

    dashboard = json.loads(
        (
            Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "prefixserve.json"
        ).read_text()
    )
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    wanted = {name for e in exprs for name in re.findall(r"(prefixserve:[a-z_]+)\{", e)}
    exposition = httpx.get(f"{tiny_server.url}/metrics", timeout=30).text
    exported = set(re.findall(r"^(prefixserve:[a-z_]+)", exposition, flags=re.MULTILINE))
    assert wanted, "the dashboard names no engine metric"
    assert wanted <= exported, f"plotted but not exported: {sorted(wanted - exported)}"
    router_patterns = {p for e in exprs for p in re.findall(r'__name__=~"([^"]+)"', e)}
    router_exported = {name for name in exported if name.startswith("prefixserve:router_")}
    if router_exported:  # the router's series appear once it is wired into the app
        for pattern in router_patterns:
            assert any(re.fullmatch(pattern, name) for name in router_exported), pattern


def test_unreachable_cluster_and_bad_flags_exit_nonzero_without_output(tmp_path, capsys):
    import socket

    from cluster.cli import main

    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_requests(input_path, 2)
    base = ["batch", "--input", str(input_path), "--output", str(output_path), "--no-progress"]
    url = ["--url", f"http://127.0.0.1:{closed_port}"]
    assert main([*base, *url]) == 1
    assert "cannot reach" in capsys.readouterr().err
    assert main([*base, *url, "--concurrency", "0"]) == 2
    assert "concurrency must be >= 1" in capsys.readouterr().err
    assert not output_path.exists() or output_path.read_text() == ""
