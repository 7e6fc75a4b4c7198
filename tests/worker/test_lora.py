"""LoRA adapters in the engine: the same greedy tokens as transformers + peft, mixed-adapter
batches bitwise equal to each request alone, no KV shared across adapters, device slots
fewer than the adapters in flight, runtime load and unload, tensor parallelism, and a clear
error for every adapter the engine cannot serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from router.protocol import adapter_namespace, hash_blocks
from worker.config import EngineConfig, parse_lora_modules
from worker.engine import LLMEngine
from worker.llm import LLM
from worker.lora import LoRAManager
from worker.parallel.step_message import StepDecoder, StepEncoder, StepInputs
from worker.sampling_params import SamplingParams
from worker.testing import make_tiny_adapter, make_tiny_model

PROMPT = [1, *range(100, 2000, 100), 5]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama and three adapters: all seven targets at rank 8, q/v at rank 16, and an
    rsLoRA one on the MLP only."""
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "model", "llama", seed=5)
    adapters = {
        "all8": make_tiny_adapter(model, root / "all8", rank=8, seed=1),
        "qv16": make_tiny_adapter(
            model, root / "qv16", rank=16, targets=("q_proj", "v_proj"), seed=2
        ),
        "mlp4": make_tiny_adapter(
            model,
            root / "mlp4",
            rank=4,
            targets=("gate_proj", "up_proj", "down_proj"),
            seed=3,
            use_rslora=True,
        ),
    }
    return model, adapters


@pytest.fixture(scope="module")
def llm(tiny):
    model, adapters = tiny
    return LLM(model, dtype="float32", lora_modules=adapters, max_loras=3, num_kv_blocks=128)


def reference_tokens(model: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    net = PeftModel.from_pretrained(base, adapter) if adapter else base
    out = net.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def tokens(llm: LLM, lora: str | None, params: SamplingParams = GREEDY) -> list[int]:
    return list(
        llm.generate([PROMPT], params, lora_name=lora, use_tqdm=False)[0].outputs[0].token_ids
    )


@pytest.mark.parametrize("lora", [None, "all8", "qv16", "mlp4"])
def test_greedy_tokens_equal_transformers_with_peft(tiny, llm, lora):
    model, adapters = tiny
    ref = reference_tokens(model, adapters.get(lora), PROMPT, GREEDY.max_tokens)
    assert tokens(llm, lora) == ref


def test_adapters_change_the_output(llm):
    outs = {lora: tokens(llm, lora) for lora in (None, "all8", "qv16", "mlp4")}
    assert len({tuple(t) for t in outs.values()}) == 4


def test_qwen2_bias_and_grouped_kv(tmp_path):
    model = make_tiny_model(tmp_path / "m", "qwen2", seed=4, num_kv_heads=1)
    adapter = make_tiny_adapter(model, tmp_path / "a", rank=8, seed=6)
    llm = LLM(model, dtype="float32", lora_modules={"a": adapter}, num_kv_blocks=64)
    assert tokens(llm, "a") == reference_tokens(model, adapter, PROMPT, GREEDY.max_tokens)


def _logprobs(out) -> list:
    return [(step.token_id, step.logprob, step.top) for step in out.outputs[0].logprobs]


def test_mixed_batch_is_bitwise_each_request_alone(llm):
    """Deterministic mode: a row's bits depend only on its own tokens and adapter."""
    loras = [None, "all8", "qv16", "mlp4", "all8", None, "mlp4", "qv16"]
    prompts = [[*PROMPT[: 5 + i], 7 + i] for i in range(len(loras))]
    mixed = llm.generate(prompts, WITH_LOGPROBS, lora_name=loras, use_tqdm=False)
    for prompt, lora, out in zip(prompts, loras, mixed, strict=True):
        alone = llm.generate([prompt], WITH_LOGPROBS, lora_name=lora, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert _logprobs(out) == _logprobs(alone)


def test_no_cached_tokens_across_adapters(llm):
    prompt = [1, *range(3000, 3000 + 16 * 4)]
    first = llm.generate([prompt], GREEDY, lora_name="all8", use_tqdm=False)[0]
    other = llm.generate([prompt], GREEDY, lora_name="qv16", use_tqdm=False)[0]
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = llm.generate([prompt], GREEDY, lora_name="all8", use_tqdm=False)[0]
    assert first.num_cached_tokens == other.num_cached_tokens == base.num_cached_tokens == 0
    assert again.num_cached_tokens == 64
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_adapter_is_in_the_block_hash():
    ids = list(range(64))
    base = hash_blocks(ids, 16, "m")
    a = hash_blocks(ids, 16, adapter_namespace("m", "a"))
    b = hash_blocks(ids, 16, adapter_namespace("m", "b"))
    assert adapter_namespace("m", None) == "m"
    assert len({base[0], a[0], b[0]}) == 3


def test_fewer_slots_than_adapters_in_flight(tiny, llm):
    """One device slot, three adapters in one batch: the scheduler runs one adapter at a time,
    and every request gets the tokens it gets alone."""
    model, adapters = tiny
    one_slot = LLM(model, dtype="float32", lora_modules=adapters, max_loras=1, num_kv_blocks=128)
    loras = ["all8", "qv16", None, "mlp4", "all8", "qv16"]
    outs = one_slot.generate([PROMPT] * len(loras), GREEDY, lora_name=loras, use_tqdm=False)
    for lora, out in zip(loras, outs, strict=True):
        assert list(out.outputs[0].token_ids) == tokens(llm, lora)
    manager = one_slot.engine.runner.lora
    assert len(manager.loaded_names) == 1
    assert manager.num_slot_loads >= 3
    assert one_slot.engine.stats().lora_adapters == tuple(manager.loaded_names)


def test_runtime_load_and_unload(tiny):
    model, adapters = tiny
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", enable_lora=True, num_kv_blocks=64))
    assert eng.lora_adapters() == {}
    with pytest.raises(ValueError, match="unknown LoRA adapter 'all8'"):
        eng.add_request("r0", PROMPT, GREEDY, lora_name="all8")
    eng.load_lora_adapter("all8", adapters["all8"])
    eng.load_lora_adapter("all8", adapters["all8"])  # the same again: a no-op
    assert eng.lora_adapters() == {"all8": adapters["all8"]}
    with pytest.raises(ValueError, match="a different adapter .* needs a new name"):
        eng.load_lora_adapter("all8", adapters["qv16"])
    eng.add_request("r1", PROMPT, GREEDY, lora_name="all8")
    with pytest.raises(ValueError, match="1 request\\(s\\) in flight"):
        eng.unload_lora_adapter("all8")
    while eng.has_unfinished():
        eng.step()
    eng.unload_lora_adapter("all8")
    assert eng.lora_adapters() == {}
    with pytest.raises(KeyError):
        eng.unload_lora_adapter("all8")
    with pytest.raises(ValueError, match="needs a new name"):  # a name always means one adapter
        eng.load_lora_adapter("all8", adapters["qv16"])


def test_lora_off_refuses_adapters(tiny):
    model, adapters = tiny
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", num_kv_blocks=64))
    with pytest.raises(ValueError, match="LoRA is off"):
        eng.load_lora_adapter("all8", adapters["all8"])
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        eng.add_request("r", PROMPT, GREEDY, lora_name="all8")


def _edit_config(folder, tmp_path, **changes) -> str:
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return str(out)


def test_adapters_it_cannot_serve_are_clear_errors(tiny, tmp_path):
    model, adapters = tiny
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", enable_lora=True, max_lora_rank=8))
    cases = [
        (str(tmp_path), "no adapter_config.json"),
        (adapters["qv16"], "rank 16 is above max_lora_rank=8"),
        (_edit_config(adapters["all8"], tmp_path, use_dora=True), "DoRA"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            eng.load_lora_adapter("bad", path)
    other = make_tiny_model(tmp_path / "mqa", "llama", num_kv_heads=1)  # narrower k/v
    wide = make_tiny_adapter(other, tmp_path / "mqa_adapter", rank=4)
    with pytest.raises(ValueError, match="this model needs"):
        eng.load_lora_adapter("wide", wide)
    assert eng.lora_adapters() == {}


def test_lora_modules_forms():
    pairs = (("a", "/x"), ("b", "/y"))
    assert parse_lora_modules({"a": "/x", "b": "/y"}) == pairs
    assert parse_lora_modules(["a=/x", "b=/y"]) == pairs
    assert EngineConfig(lora_modules=["a=/x"]).enable_lora
    with pytest.raises(ValueError, match="not name=path"):
        parse_lora_modules(["a"])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(max_loras=0)


def test_step_message_carries_each_sequence_adapter():
    class Req:
        def __init__(self, n: int, lora_id: int):
            self.num_tokens, self.lora_id, self.is_finished = n, lora_id, False

    class Batch:
        pass

    batch = Batch()
    batch.requests = [Req(3, 2), Req(1, 0)]
    inputs = StepInputs([5, 6, 7, 8], [0, 0], [3, 1], [[4], [9]], [2, 3], [2, 0])
    decoded = StepDecoder().decode(StepEncoder().encode(batch, inputs))
    assert decoded.adapters == [2, 0]
    assert decoded.token_ids == inputs.token_ids


def test_slots_evict_the_least_recently_used(tiny):
    model, adapters = tiny
    from worker.models.llama import ModelSpec

    spec = ModelSpec.from_hf_config(json.loads(Path(model, "config.json").read_text()))
    manager = LoRAManager(
        spec, torch.float32, torch.device("cpu"), lambda w: w, max_loras=2, max_lora_rank=16
    )
    ids = [manager.add(name, path) for name, path in adapters.items()]
    manager.slots_for([ids[0]])
    manager.slots_for([ids[1]])
    manager.slots_for([ids[0]])  # ids[1] is now the least recently used
    manager.slots_for([ids[2]])
    assert manager.loaded_names == ["all8", "mlp4"]
    with pytest.raises(ValueError, match="max_loras=2"):
        manager.slots_for(ids)


@pytest.mark.slow
def test_tensor_parallel_shards_the_adapters(tiny, llm):
    """Two gloo ranks: B sharded like q/k/v/gate/up, A like o/down; the same greedy tokens as
    one rank, for every adapter in one batch."""
    model, adapters = tiny
    eng = LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            device="cpu",
            tensor_parallel_size=2,
            lora_modules=adapters,
            num_kv_blocks=128,
        )
    )
    try:
        loras = [None, "all8", "qv16", "mlp4"]
        for i, lora in enumerate(loras):
            eng.add_request(f"r{i}", PROMPT, GREEDY, lora_name=lora)
        done = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        for i, lora in enumerate(loras):
            assert done[f"r{i}"] == tokens(llm, lora), lora
        with pytest.raises(ValueError, match="tensor parallelism"):
            eng.load_lora_adapter("late", adapters["all8"])
    finally:
        eng.shutdown()


def test_the_simulated_engine_keeps_slots_and_prices_their_fill(tiny, tmp_path):
    """``engine="sim"``: the same slots and stats as the real engine on the same schedule,
    pseudo-tokens of the adapter's own, and a slot fill that takes the adapter's bytes over
    the profile's host-to-device rate."""
    import dataclasses
    import time

    from worker.sim_model import load_profile

    model, adapters = tiny
    profile = {**dataclasses.asdict(load_profile("gpu")), "host_to_device_bytes_per_s": 1e6}
    profile.pop("name")
    path = tmp_path / "slow_link.json"
    path.write_text(json.dumps(profile))
    common = dict(model=model, device="cpu", lora_modules=adapters, max_loras=1)
    sim = LLM(engine="sim", sim_profile=str(path), num_kv_blocks=64, **common)
    real = LLM(dtype="float32", num_kv_blocks=64, **common)
    loras = ["all8", "all8", "qv16", None]
    outs = {}
    for name, llm in (("sim", sim), ("real", real)):
        outs[name] = llm.generate([PROMPT] * 4, GREEDY, lora_name=loras, use_tqdm=False)
        assert llm.engine.stats().lora_adapters == ("qv16",)
        assert llm.engine.runner.lora.num_slot_loads == 2
    sim_tokens = [tuple(o.outputs[0].token_ids) for o in outs["sim"]]
    assert sim_tokens[0] == sim_tokens[1] != sim_tokens[2] != sim_tokens[3]
    fill_s = sim.engine.runner.lora.adapter("all8").num_bytes / 1e6
    assert sim.engine.stats().lora_load_s == pytest.approx(fill_s, rel=0.5)
    start_s = time.perf_counter()
    sim.generate([PROMPT], GREEDY, lora_name="all8", use_tqdm=False)  # evicts qv16
    assert time.perf_counter() - start_s >= fill_s


def test_an_adapter_written_without_peft_loads_like_peft_s(tiny, tmp_path):
    """``write_random_adapter`` (what a machine without peft uses) writes PEFT's format:
    peft reads it, and the engine gives transformers + peft's greedy tokens."""
    from worker.testing import write_random_adapter

    model, _ = tiny
    path = write_random_adapter(model, tmp_path / "plain", rank=4, std=0.1, seed=9)
    llm = LLM(model, dtype="float32", lora_modules={"plain": path}, num_kv_blocks=64)
    ref = reference_tokens(model, path, PROMPT, GREEDY.max_tokens)
    assert tokens(llm, "plain") == ref
    assert ref != tokens(llm, None)
