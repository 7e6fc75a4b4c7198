"""``prefixserve bench serve``: the command line of the load generator (``main(argv)``).

    prefixserve bench serve --base-url http://127.0.0.1:8000 --model smollm2 \\
        --dataset-name generated-shared-prefix --request-rate 4 --seed 0 --save-result

Flags follow ``vllm bench serve`` where the meaning is the same (``--base-url``,
``--endpoint``, ``--model``, ``--dataset-name``, ``--num-prompts``, ``--request-rate``,
``--max-concurrency``, ``--seed``, ``--ignore-eos``, ``--metric-percentiles``,
``--save-result``, ``--result-dir``, ``--result-filename``, ``--label``, ``--disable-tqdm``)
and SGLang's for the shared-prefix dataset (``--gsp-*``). Without ``--model`` the first
model of ``GET /v1/models`` is used. Exit status 0 when at least one request succeeded, 1
otherwise; bad flags exit 2 with argparse's usage message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

from bench.loadgen import workloads
from bench.loadgen.client import RequestSettings, first_model, run_benchmark
from bench.loadgen.metrics import compute_result, format_result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixserve bench serve", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    p.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--dataset-name", default="generated-shared-prefix", choices=list(workloads.WORKLOADS)
    )
    p.add_argument(
        "--num-prompts", type=int, default=64, help="prompts (multi-turn: conversations)"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson rate (req/s); inf: all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="fixed concurrency cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--metric-percentiles", default="99", help='comma-separated, e.g. "50,90,99"')
    g = p.add_argument_group("generated-shared-prefix (SGLang's names)")
    g.add_argument("--gsp-num-groups", type=int, default=8)
    g.add_argument("--gsp-prompts-per-group", type=int, default=8)
    g.add_argument("--gsp-system-prompt-len", type=int, default=512)
    g.add_argument("--gsp-question-len", type=int, default=64)
    g.add_argument("--gsp-output-len", type=int, default=32)
    m = p.add_argument_group("multi-turn")
    m.add_argument("--multi-turn-turns", type=int, default=4)
    m.add_argument("--multi-turn-system-len", type=int, default=128)
    m.add_argument("--multi-turn-user-len", type=int, default=64)
    m.add_argument("--multi-turn-output-len", type=int, default=32)
    r = p.add_argument_group("prefix-repetition and zipf (vLLM's names)")
    r.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    r.add_argument("--prefix-repetition-prefix-len", type=int, default=512)
    r.add_argument("--prefix-repetition-suffix-len", type=int, default=64)
    r.add_argument("--prefix-repetition-output-len", type=int, default=32)
    r.add_argument("--zipf-num-prefixes", type=int, default=16)
    d = p.add_argument_group("random")
    d.add_argument("--random-input-len", type=int, default=256)
    d.add_argument("--random-output-len", type=int, default=32)
    o = p.add_argument_group("output")
    o.add_argument("--save-result", action="store_true")
    o.add_argument("--result-dir", type=Path, default=Path("."))
    o.add_argument("--result-filename", default=None)
    o.add_argument("--label", default="prefixserve")
    o.add_argument("--disable-tqdm", action="store_true")
    return p


def make_conversations(args) -> list[workloads.Conversation]:
    a, seed = args, args.seed
    name = a.dataset_name
    if name == "generated-shared-prefix":
        return workloads.generated_shared_prefix(
            seed,
            a.gsp_num_groups,
            a.gsp_prompts_per_group,
            a.gsp_system_prompt_len,
            a.gsp_question_len,
            a.gsp_output_len,
        )
    if name == "multi-turn":
        return workloads.multi_turn_chat(
            seed,
            a.num_prompts,
            a.multi_turn_turns,
            a.multi_turn_system_len,
            a.multi_turn_user_len,
            a.multi_turn_output_len,
        )
    if name == "prefix-repetition":
        return workloads.prefix_repetition(
            seed,
            a.num_prompts,
            a.prefix_repetition_num_prefixes,
            a.prefix_repetition_prefix_len,
            a.prefix_repetition_suffix_len,
            a.prefix_repetition_output_len,
        )
    if name == "zipf":
        return workloads.zipf_prefixes(
            seed,
            a.num_prompts,
            a.zipf_num_prefixes,
            a.prefix_repetition_prefix_len,
            a.prefix_repetition_suffix_len,
            a.prefix_repetition_output_len,
        )
    return workloads.random_prompts(seed, a.num_prompts, a.random_input_len, a.random_output_len)


def run(args) -> dict:
    """Run the benchmark ``args`` describe; return the result dict (vLLM keys + ours)."""
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if any(not 0 < p <= 100 for p in percentiles):
        raise ValueError(
            f"metric_percentiles must lie in (0, 100], got {args.metric_percentiles!r}"
        )
    model = args.model or first_model(args.base_url, args.api_key)
    settings = RequestSettings(
        args.base_url,
        model,
        args.endpoint,
        args.temperature,
        args.ignore_eos,
        args.timeout_s,
        args.api_key,
    )
    conversations = make_conversations(args)
    num_requests = sum(len(c.turns) for c in conversations)
    bar = tqdm(total=num_requests, unit="req", disable=args.disable_tqdm, file=sys.stderr)
    outputs, stats = asyncio.run(
        run_benchmark(
            settings,
            conversations,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            on_done=lambda _: bar.update(1),
        )
    )
    bar.close()
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if settings.is_chat else "openai",
        "endpoint_type": "openai-chat" if settings.is_chat else "openai",
        "label": args.label,
        "model_id": model,
        "tokenizer_id": model,
        "dataset_name": args.dataset_name,
        "num_prompts": num_requests,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": 1.0,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        **compute_result(outputs, stats, percentiles),
    }
    print(format_result(result, percentiles, args.request_rate, args.max_concurrency))
    if args.save_result:
        name = args.result_filename or f"{args.label}-{args.dataset_name}-{result['date']}.json"
        path = args.result_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    return result


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench serve`` on the ``prefixserve`` command (``cluster.cli``'s hook shape)."""
    bench = subparsers.add_parser("bench", help="Benchmarks: 'bench serve' load-tests an endpoint.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser(
        "serve",
        parents=[build_parser()],
        add_help=False,
        help="Load-test an OpenAI-compatible endpoint.",
    )
    serve.set_defaults(handler=_handle)
    return bench


def _handle(ns: argparse.Namespace) -> int:
    try:
        result = run(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if result["completed"] > 0 else 1


def main(argv=None) -> int:
    return _handle(build_parser().parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
