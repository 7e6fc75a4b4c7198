"""Served TTFT when a prefix's holder is busy, or a burst wants the prefix: KV pulls on vs off.

The question in the live path: when the replica holding a prefix is busy, what does
``--kv-pull-tokens-per-s`` change for the next request with that prefix? With pulls on, the
router sends it to the idle replica, which pulls the prefix and prefills only the rest; with
pulls off, it either queues behind the holder's decode (a hit) or prefills the whole prompt
on the idle replica, whichever the router predicts is faster.

Two phases in one local Ray (loopback), the same seeded prompts in each: a Serve application
of 2 engine replicas with pulls on, then one with pulls off, called through a
``DeploymentHandle`` of this process (whose request router is ours). Each phase first sends
cold prompts until both replicas have measured their prefill rate (an unmeasured replica is
priced at the default rate, far above a CPU's). Per repeat, with a fresh random prefix:
``cold`` (prefix + question A) lands on a replica X; after the index and the stats settle, a
long request (prefix + question B) keeps X decoding; then the timed ``follow`` (prefix +
question C). Then the burst: a second fresh prefix, cold on one replica, then ``--burst``
requests for it at once (each with its own 64-token question), as a hot prefix arrives.
TTFT is the handle's: the call to the first streamed item (routing, Serve's hops, a pull if
any, the engine). Every request's greedy tokens must be equal in both phases. The replicas'
pull counters and seconds come from the ``MetricsHub``; ``--log-level debug`` logs each pull
with its peer lookup and the peer's answer timed.

    python -m bench.experiments.kv_pull_served          # SmolLM2, 496-token prefix, 3 repeats
    python -m bench.experiments.kv_pull_served --quick  # smoke: 1 repeat, 128-token prefix

Writes ``bench/results/kv_pull_served_cpu_<date>.json`` with the load average at the start
and the end: on a shared machine the numbers are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

from bench.common import free_port
from bench.result_files import result_header, result_stem

# One application name per phase: this process's handle keeps the request router (and its
# RouterConfig) of the first application it called under a name, redeployed or not.
APPS = {"pulls_on": "kvpull-on", "pulls_off": "kvpull-off"}
QUESTION_TOKENS = 16
TOKEN_LISTS = ("follow_tokens", "burst_tokens")  # compared between phases, not written
BURST_QUESTION_TOKENS = 64  # each burst request's own part: prefilled wherever it runs
LONG_TOKENS = 1024  # the busy holder's decode outlasts both follow-ups
TOKEN_RANGE = (1000, 40000)  # ordinary SmolLM2 words, clear of the special tokens
# Routing stats arrive every ROUTING_STATS_PERIOD_S (1 s) through the controller: after this
# long a finished request no longer shows as running, so it prices no replica as busy.
SETTLE_S = 2.5


def _as_list(tokens: list) -> list[list[int]]:
    """One request's token ids (``follow_tokens``) or several (``burst_tokens``), as several."""
    return tokens if tokens and isinstance(tokens[0], list) else [tokens]


async def timed(handle, request_id, prompt, params, salt=None, hashes=None, keep=False):
    """(TTFT s, replica id, cached tokens, token ids, the stream when ``keep``)."""
    from cluster.stream_items import check_item

    start_s = time.perf_counter()
    stream = handle.options(stream=True).generate.remote(
        request_id, prompt, params, cache_salt=salt, block_hashes=hashes
    )
    ttft_s, replica_id, cached, tokens = None, None, 0, []
    async for item in stream:
        item = check_item(item)
        if ttft_s is None:
            ttft_s = time.perf_counter() - start_s
        replica_id, cached = item.replica_id, item.num_cached_tokens
        tokens += [t for c in item.choices for t in c.new_token_ids]
        if keep:
            return ttft_s, replica_id, cached, tokens, stream
    return ttft_s, replica_id, cached, tokens, None


async def warm_up(handle, described, rng, max_requests: int = 8) -> None:
    """Cold prompts until both replicas served one, so both report a measured prefill rate:
    an unmeasured replica is priced at ``RouterConfig``'s default (8000 tokens/s, far above a
    CPU's), which would draw the requests this benchmark means for the holder."""
    from router.protocol import hash_blocks
    from worker.sampling_params import SamplingParams

    served = set()
    for i in range(max_requests):
        prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(64)]
        hashes = hash_blocks(prompt, described["block_size"], described["cache_namespace"], None)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        served.add((await timed(handle, f"warm{i}", prompt, params, hashes=hashes))[1])
        if len(served) == 2:
            return
    raise RuntimeError("the router never sent a cold prompt to the second replica")


async def one_repeat(handle, described, rng, prefix_tokens: int, burst: int, index: int) -> dict:
    """The follow-up (cold request on the holder, the holder kept busy, the timed follow-up),
    then the burst."""
    from router.protocol import hash_blocks
    from worker.sampling_params import SamplingParams

    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
    prefix = [rng.randrange(*TOKEN_RANGE) for _ in range(prefix_tokens)]

    def prompt():
        return prefix + [rng.randrange(*TOKEN_RANGE) for _ in range(QUESTION_TOKENS)]

    def call(name, tokens, params, keep=False):
        hashes = hash_blocks(tokens, described["block_size"], described["cache_namespace"], None)
        return timed(handle, f"{name}{index}", tokens, params, hashes=hashes, keep=keep)

    cold_prompt, busy_prompt, follow_prompt = prompt(), prompt(), prompt()
    cold = await call("cold", cold_prompt, short)
    await asyncio.sleep(SETTLE_S)  # the index has the holder's blocks; stats show it idle
    busy = await call("busy", busy_prompt, long, keep=True)
    follow = await call("follow", follow_prompt, short)
    busy[4].cancel()
    await asyncio.sleep(SETTLE_S)  # the cancelled request leaves the holder and its stats
    # The burst: another fresh prefix, cold on one replica, then ``burst`` requests for it at
    # once, each with its own question of BURST_QUESTION_TOKENS.
    prefix = [rng.randrange(*TOKEN_RANGE) for _ in range(prefix_tokens)]
    burst_cold = await call("burst-cold", prompt(), short)
    await asyncio.sleep(SETTLE_S)
    burst_prompts = [
        prefix + [rng.randrange(*TOKEN_RANGE) for _ in range(BURST_QUESTION_TOKENS)]
        for _ in range(burst)
    ]
    burst_out = await asyncio.gather(
        *(call(f"burst{j}-", tokens, short) for j, tokens in enumerate(burst_prompts))
    )
    await asyncio.sleep(SETTLE_S)
    return {
        "holder": cold[1],
        "busy_replica": busy[1],
        "cold_ttft_s": cold[0],
        "follow_ttft_s": follow[0],
        "follow_replica": follow[1],
        "follow_cached_tokens": follow[2],
        "follow_tokens": follow[3],
        "burst_holder": burst_cold[1],
        "burst_ttft_s": [out[0] for out in burst_out],
        "burst_on_the_other_replica": sum(out[1] != burst_cold[1] for out in burst_out),
        "burst_cached_tokens": [out[2] for out in burst_out],
        "burst_tokens": [out[3] for out in burst_out],
    }


def run_phase(
    args, app_name: str, kv_pull_tokens_per_s: float | None, port: int
) -> tuple[dict, list, dict]:
    """One application with this pull setting: warm up, then ``args.repeats`` repeats (the
    same prompts in every phase: the generator is seeded alike)."""
    from ray import serve

    from cluster.app import build_app

    engine = {
        "model": args.model,
        "max_model_len": args.prefix_tokens + QUESTION_TOKENS + LONG_TOKENS + 16,
        "num_threads": 1,
    }
    cluster = {
        "num_replicas": 2,
        "num_ingress_replicas": 1,
        "port": port,
        "app_name": app_name,
        "log_level": args.log_level,
    }
    router = {"kv_pull_tokens_per_s": kv_pull_tokens_per_s}
    app = build_app({"engine": engine, "cluster": cluster, "router": router})
    serve.run(app, name=app_name, route_prefix="/")  # returns once every replica is up
    handle = serve.get_deployment_handle("EngineReplica", app_name)
    rng = random.Random(0)

    async def run():
        described = await handle.describe.remote()
        # Its own generator: the warm-up sends as many prompts as the routing takes, and the
        # measured prompts must be the same in both phases whatever that number was.
        await warm_up(handle, described, random.Random(1))
        await asyncio.sleep(SETTLE_S)
        rows = [
            await one_repeat(handle, described, rng, args.prefix_tokens, args.burst, i)
            for i in range(args.repeats)
        ]
        await asyncio.sleep(SETTLE_S)  # the replicas push their metrics every second
        hub = serve.get_deployment_handle("MetricsHub", app_name)
        snapshots = (await hub.export.remote())["replicas"].values()
        pulls = {
            name: sum(snap.get("counters", {}).get(name, 0) for snap in snapshots)
            for name in ("kv_pulls", "kv_pull_failures", "kv_pull_tokens")
        }
        pulls["kv_pull_seconds_sum"] = sum(
            snap["histograms"]["kv_pull_seconds"]["sum"] for snap in snapshots
        )
        return described, rows, pulls

    try:
        return asyncio.run(run())
    finally:
        serve.delete(app_name)


def summary(rows: list[dict]) -> dict:
    return {
        "follow_ttft_s_median": statistics.median(r["follow_ttft_s"] for r in rows),
        "cold_ttft_s_median": statistics.median(r["cold_ttft_s"] for r in rows),
        "follow_on_the_other_replica": sum(r["follow_replica"] != r["holder"] for r in rows),
        "follow_cached_tokens": [r["follow_cached_tokens"] for r in rows],
        "burst_ttft_s_mean": statistics.mean(t for r in rows for t in r["burst_ttft_s"]),
        "burst_ttft_s_max_median": statistics.median(max(r["burst_ttft_s"]) for r in rows),
        "burst_on_the_other_replica": [r["burst_on_the_other_replica"] for r in rows],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix-tokens", type=int, default=496)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--kv-pull-tokens-per-s",
        type=float,
        default=7237.0,
        help="the router's pull price with pulls on (default: bench/kv_pull.py's CPU rate)",
    )
    ap.add_argument("--burst", type=int, default=6, help="requests sent at once for a prefix")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 128-token prefix")
    ap.add_argument(
        "--log-level", default="info", help="the replicas' (debug: one line per pull, timed)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.prefix_tokens = 1, 128

    import ray
    from ray import serve

    load_start = os.getloadavg()
    port = free_port()  # for Serve's proxy
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    phases, pulls = {}, {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, rate in (("pulls_on", args.kv_pull_tokens_per_s), ("pulls_off", None)):
            described, phases[name], pulls[name] = run_phase(args, APPS[name], rate, port)
    finally:
        serve.shutdown()
        ray.shutdown()
    on, off = phases["pulls_on"], phases["pulls_off"]
    result = {
        **result_header("kv_pull_served", "bench.experiments.kv_pull_served", argv, "cpu"),
        "note": "machine shared with other work; load averages below; numbers indicative only",
        "load_average_1_5_15_start": list(load_start),
        "load_average_1_5_15_end": list(os.getloadavg()),
        "model_id": described["model_id"],
        "prefix_tokens": args.prefix_tokens,
        "question_tokens": QUESTION_TOKENS,
        "kv_pull_tokens_per_s": args.kv_pull_tokens_per_s,
        "summary": {"pulls_on": summary(on), "pulls_off": summary(off)},
        "replica_pull_metrics": pulls,
        "tokens_equal_on_vs_off": all(
            a["follow_tokens"] == b["follow_tokens"] and a["burst_tokens"] == b["burst_tokens"]
            for a, b in zip(on, off, strict=True)
        ),
        "token_mismatches": [  # (repeat, which list, index in it) where on and off differ
            [repeat, name, i]
            for repeat, (a, b) in enumerate(zip(on, off, strict=True))
            for name in TOKEN_LISTS
            for i, (x, y) in enumerate(zip(_as_list(a[name]), _as_list(b[name]), strict=True))
            if x != y
        ],
        "repeats": {
            name: [{k: v for k, v in r.items() if k not in TOKEN_LISTS} for r in rows]
            for name, rows in phases.items()
        },
    }
    path = result_stem("kv_pull_served", "cpu").with_suffix(".json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2), json.dumps(pulls), path)
    return result


if __name__ == "__main__":
    main()
