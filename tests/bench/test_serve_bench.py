"""bench/serve/ without any server: the chat workload (``bench.loadgen.workloads``) is the engine
benchmark's and gives the server's chat-template ids, the summary math, the result files, and
stopping a process tree."""

from __future__ import annotations

import json
import sys
import time

import pytest

from bench import serve
from bench.common import free_ports, percentile
from bench.loadgen.client import RequestSettings, request_body
from bench.loadgen.workloads import make_chat_workload, requests_for


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from worker.tokenizer import Tokenizer

    return Tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def workload(tokenizer):
    return make_chat_workload(tokenizer, 12)


def test_offline_ids_are_what_the_server_template_makes(tokenizer, workload):
    from cluster.openai_protocol import ChatCompletionRequest

    for req in workload:
        # The body the HTTP client sends, parsed the way the server's ingress parses it.
        settings = RequestSettings("http://x", "m", "/v1/chat/completions", ignore_eos=True)
        assert req.conversation(64).system_text == req.messages[0]["content"]
        body = json.loads(json.dumps(request_body(settings, 64, messages=req.messages)))
        parsed = ChatCompletionRequest.model_validate(body)
        assert parsed.ignore_eos and parsed.stream and parsed.temperature == 0
        server_ids = tokenizer.apply_chat_template(
            parsed.template_messages(), parsed.add_generation_prompt
        )
        assert list(req.token_ids) == server_ids
    text = tokenizer.decode(list(workload[0].token_ids), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are the assistant of")
    assert text.endswith(
        f"<|im_start|>user\n{workload[0].user_text}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_workload_keeps_the_engine_benchmarks_prompts(tokenizer, workload):
    from bench.engine import make_workload

    engine_prompts = make_workload(tokenizer, len(workload))
    for req, prompt in zip(workload, engine_prompts, strict=True):
        system_ids = tokenizer.encode(req.system_text)
        assert 300 <= len(system_ids) <= 500
        assert prompt[: len(system_ids)] == system_ids  # the same system prompt tokens
        question = tokenizer.decode(prompt[len(system_ids) :])
        assert req.user_text in question and req.user_text.startswith(f"User {req.index} asks:")
        assert req.system_index == req.index % 4
    # Requests sharing a system prompt share a long template prefix (what prefix caching reuses).
    a, b = workload[0].token_ids, workload[4].token_ids
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared >= len(tokenizer.encode(workload[0].system_text))
    assert len(requests_for(workload, 1, 5)) == 5
    assert len(requests_for(workload, 8, 5)) == len(workload)


def _record(ttft, out_tokens=4, latency=None, cached=0, prompt=100, ok=True, text="x"):
    return {
        "success": ok,
        "error": "" if ok else "HTTP 500: boom",
        "prompt_tokens": prompt,
        "output_tokens": out_tokens,
        "cached_tokens": cached,
        "ttft_s": ttft,
        "itl_s": [0.01] * (out_tokens - 1),
        "latency_s": latency if latency is not None else ttft + 0.03,
        "text": text,
    }


def test_free_ports_never_hands_a_port_out_twice():
    # A cluster draws its head's ports, then each node's: a port the OS reissues after an
    # earlier draw closed it would be given to two of Ray's components. 2000 draws from the
    # ephemeral range repeat dozens of times unless the earlier draws are remembered.
    draws = [port for _ in range(40) for port in free_ports(50)]
    assert len(set(draws)) == len(draws)


def test_summary_math():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    records = [
        _record(0.1, cached=50),
        _record(0.2),
        _record(0.3, cached=None),
        _record(0.4, cached=100),
        _record(9.0, out_tokens=0, ok=False),
    ]
    row = serve.summarize(records, duration_s=2.0)
    assert row["completed"] == 4 and row["failed"] == 1 and row["errors"] == ["HTTP 500: boom"]
    assert row["output_tokens"] == 16 and row["output_tok_per_s"] == pytest.approx(8.0)
    assert row["request_per_s"] == pytest.approx(2.0)
    assert row["ttft_p50_ms"] == pytest.approx(250.0)
    assert row["ttft_p90_ms"] == pytest.approx(370.0)
    assert row["ttft_p99_ms"] == pytest.approx(397.0)
    assert row["ttft_mean_ms"] == pytest.approx(250.0)
    assert row["itl_mean_ms"] == pytest.approx(10.0)
    assert row["tpot_mean_ms"] == pytest.approx(10.0)  # (latency - ttft) / (4 - 1)
    assert row["cached_token_ratio"] == pytest.approx(150 / 300)  # only requests that reported it
    assert row["text_digests"][0] == row["text_digests"][1] and row["text_digests"][4] is None
    assert serve.summarize([_record(0.1, cached=None)], 1.0)["cached_token_ratio"] is None


def test_result_files_and_table(tmp_path):
    ok = {
        "system": "served",
        "label": "prefixserve 1x2",
        "concurrency": 4,
        "num_requests": 5,
        **serve.summarize([_record(0.1 * i) for i in range(1, 6)], 1.5),
        "cpu_s": 3.0,
    }
    offline = {**ok, "system": "offline", "label": "offline LLM (2 threads)"}
    failed = {
        "system": "llama",
        "label": "llama-server 1x2",
        "concurrency": 4,
        "num_requests": 5,
        "error": "RuntimeError: llama-server not ready within 300 s",
    }
    rows = [offline, ok, failed]
    serve.same_as_offline(rows)
    assert ok["same_as_offline"] == 1.0
    header = {"cpu": "Test CPU", "date": "2026-01-02T03:04:05+00:00", "title": "t"}
    json_path, png_path = serve.write_results(tmp_path / "out", "serve_2026-01-02", header, rows)
    data = json.loads(json_path.read_text())
    assert data["header"]["cpu"] == "Test CPU" and len(data["rows"]) == 3
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = serve.markdown(rows)
    assert "| prefixserve 1x2 | 4 | 5 | 5/0 | 13.3 |" in table and "error: RuntimeError" in table


def test_flags():
    args = serve.parse_args(["--quick", "--systems", "offline,served", "--llama-server", "none"])
    assert (args.num_requests, args.max_tokens, args.concurrency) == (8, 16, [1, 4])
    assert args.systems == ["offline", "served"] and args.llama_server is None
    args = serve.parse_args(["--quick", "--concurrency", "2", "--max-tokens", "4"])
    assert (args.num_requests, args.max_tokens, args.concurrency) == (8, 4, [2])
    args = serve.parse_args([])
    assert (args.num_requests, args.max_tokens, args.concurrency) == (64, 64, [1, 8, 64])
    runs = serve.plan(serve.parse_args(["--cluster-replicas", "2", "--llama-server", "none"]))
    assert [(r.system, r.concurrency) for r in runs][-2:] == [
        ("served-cluster", 8),
        ("llama-cluster", 8),
    ]
    with pytest.raises(SystemExit):
        serve.parse_args(["--systems", "vllm"])


def test_stop_ends_a_process_tree_that_ignores_sigint(tmp_path, monkeypatch):
    monkeypatch.setattr(serve.processes, "STOP_GRACE_S", 0.5)  # Server.stop reads them there
    monkeypatch.setattr(serve.processes, "KILL_GRACE_S", 2.0)
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    server = serve.Server("dummy", [sys.executable, "-c", script], tmp_path / "log.txt")
    import psutil

    deadline = time.monotonic() + 10
    while not psutil.Process(server.proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = [
        psutil.Process(server.proc.pid),
        *psutil.Process(server.proc.pid).children(recursive=True),
    ]
    assert len(tree) == 2 and server.cpu_seconds() >= 0
    server.stop()
    assert server.proc.poll() is not None
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)


def test_process_labels_name_what_a_process_is():
    from bench.serve.processes import process_label

    assert process_label(["ray::ServeController.listen_for_change"], "x") == "ray::ServeController"
    assert (
        process_label(["ray::ServeReplica:prefixserve:Ingress", ""], "x")
        == "ray::ServeReplica:prefixserve:Ingress"
    )
    assert process_label(["/usr/bin/python3.11", "-m", "worker.engine_process", "7"], "x") == (
        "python -m worker.engine_process"
    )
    assert process_label(["python", "/a/b/dashboard.py", "--x"], "x") == "python dashboard.py"
    assert process_label(["/opt/ray/core/src/ray/raylet/raylet", "--flag"], "x") == "raylet"
    assert process_label([], "kworker") == "kworker"


def test_cpu_breakdown_is_the_difference_largest_first():
    from bench.serve.http_load import cpu_breakdown

    before = [{"engine": 10.0, "ingress": 1.0, "gone": 3.0}]
    after = [{"engine": 40.0, "ingress": 3.5, "new": 0.5, "idle": 0.01}]
    assert cpu_breakdown(before, after) == {"engine": 30.0, "ingress": 2.5, "new": 0.5}


def test_idle_measurement_reports_per_second_rates(monkeypatch):
    from bench.serve import http_load

    class FakeServer:  # two snapshots: 0.2 CPU-s of the controller over the idle time
        def __init__(self):
            self.snapshots = iter([{"ctl": 1.0, "engine": 5.0}, {"ctl": 1.2, "engine": 5.0}])

        def cpu_by_process(self):
            return next(self.snapshots)

    clock = iter([100.0, 102.0])
    monkeypatch.setattr(http_load.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(http_load.time, "sleep", lambda s: None)
    idle = http_load.measure_idle([FakeServer()], 2.0)
    assert idle == {
        "idle_s": 2.0,
        "idle_cpu_s": pytest.approx(0.1),
        "idle_cpu_s_by_process": {"ctl": pytest.approx(0.1)},
    }
    with pytest.raises(SystemExit):
        serve.parse_args(["--idle-s", "-1"])


def test_sigterm_unwinds_the_block_like_an_exit_and_restores_the_handler():
    import os
    import signal
    import threading
    import time

    from bench.common import sigterm_unwinds

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")  # the SIGTERM would end this worker
    before = signal.getsignal(signal.SIGTERM)
    cleaned_up = []
    with pytest.raises(SystemExit) as exit_info, sigterm_unwinds():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here at the latest
        finally:
            cleaned_up.append(True)
    assert exit_info.value.code == 143 and cleaned_up == [True]
    assert signal.getsignal(signal.SIGTERM) is before


def test_warm_up_retries_until_a_whole_burst_is_served_and_then_gives_up():
    from bench.common import retry_until_served

    bursts = iter([[{"success": False, "error": "503"}], [{"success": True, "error": ""}]])
    sent = []
    retry_until_served(lambda: sent.append(1) or next(bursts), patience_s=10.0, interval_s=0.0)
    assert len(sent) == 2
    failing = [{"success": True, "error": ""}, {"success": False, "error": "no replica"}]
    with pytest.raises(RuntimeError, match="1 of 2 requests failed, first: no replica"):
        retry_until_served(lambda: failing, patience_s=0.0, interval_s=0.0)
