"""Engine options: device/dtype ``auto``, ``gpu_memory_utilization``, the tokenizer
and chat template overrides, and the model's generation_config.json as sampling defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.worker.helpers import AUTO_HERE, lay_out_cache
from worker.config import EngineConfig, resolve_device, resolve_dtype
from worker.engine import LLMEngine
from worker.generation_defaults import (
    apply_defaults,
    load_generation_defaults,
    read_generation_defaults,
)
from worker.llm import LLM
from worker.loader import load_tokenizer
from worker.model_runner import kv_bytes_for_utilization
from worker.sampling_params import SamplingParams
from worker.testing import make_tiny_model
from worker.tokenizer import read_chat_template

GIB = 2**30
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("options") / "tiny", "llama", seed=5)


# -- device and dtype ------------------------------------------------------------------------
def test_auto_is_the_default_and_resolves_to_cpu_float32_here():
    config = EngineConfig()
    assert (config.device, config.dtype) == ("auto", "auto")
    with pytest.raises(ValueError, match=r"dtype is 'auto': call EngineConfig.resolved\(\)"):
        _ = config.torch_dtype
    resolved = config.resolved()
    assert (resolved.device, resolved.dtype) == AUTO_HERE  # ("cpu", "float32") without a GPU
    assert (
        EngineConfig(device="cpu", dtype="bfloat16").resolved().dtype == "bfloat16"
    )  # explicit values stay


def test_cuda_rule_as_a_pure_function():
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("cuda:1", cuda_available=False) == "cuda:1"
    assert resolve_dtype("auto", "cuda", (9, 0)) == "bfloat16"  # H100
    assert resolve_dtype("auto", "cuda:0", (8, 0)) == "bfloat16"  # A100
    assert resolve_dtype("auto", "cuda", (7, 5)) == "float16"  # T4
    assert resolve_dtype("auto", "cuda", (6, 0)) == "float16"  # P100
    assert resolve_dtype("auto", "cpu", None) == "float32"
    assert resolve_dtype("float16", "cpu", None) == "float16"


def test_bad_device_and_dtype_name_the_field():
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match=r"EngineConfig.device: 'cuda:1' but this process sees no CUDA device"
        ):
            EngineConfig(device="cuda:1").resolved()
    with pytest.raises(
        ValueError, match=r"EngineConfig.device: must be 'auto', 'cpu' or 'cuda\[:N\]'"
    ):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match=r"EngineConfig.dtype: must be 'auto' or one of"):
        EngineConfig(dtype="fp8")


# -- gpu_memory_utilization -------------------------------------------------------------------
def test_kv_bytes_for_utilization_is_vllms_arithmetic():
    # 0.9 of 80 GiB = 72 GiB; 16 GiB of weights and 2 GiB of activations leave 54 GiB of KV.
    assert kv_bytes_for_utilization(80 * GIB, 16 * GIB, 2 * GIB, 0.9) == 54 * GIB
    assert kv_bytes_for_utilization(80 * GIB, 16 * GIB, 2 * GIB, 1.0) == 62 * GIB
    # A lower utilization leaves less KV, byte for byte.
    assert kv_bytes_for_utilization(80 * GIB, 16 * GIB, 2 * GIB, 0.5) == 22 * GIB
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization=0.2 allows 16.00 GiB .* weights take 16.00 GiB"
    ):
        kv_bytes_for_utilization(80 * GIB, 16 * GIB, 2 * GIB, 0.2)


def test_gpu_memory_utilization_on_cpu_names_the_cpu_knobs(tiny_folder):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: .*kv_cache_memory_fraction"):
        EngineConfig(device="cpu", gpu_memory_utilization=0.9)
    if AUTO_HERE[0] != "cpu":
        return  # device auto takes the GPU here: the rest checks what a CPU-only machine says
    config = EngineConfig(
        model=tiny_folder, gpu_memory_utilization=0.9
    )  # device auto: decided where it runs
    with pytest.raises(
        ValueError,
        match=r"on CPU size the KV cache with kv_cache_memory_fraction "
        r".*device 'auto' found no GPU",
    ):
        LLMEngine(config)
    with pytest.raises(ValueError, match=r"set only one of .*gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.9, kv_cache_bytes=2**20)


# -- tokenizer and chat template ---------------------------------------------------------------
def word_tokenizer(folder: Path) -> str:
    """A word-level tokenizer unlike the model's own, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    raw = RawTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>"
    ).save_pretrained(str(folder))
    return str(folder)


def test_tokenizer_override_folder_and_hub_id(tiny_folder, tmp_path, monkeypatch):
    folder = word_tokenizer(tmp_path / "words")
    assert load_tokenizer(EngineConfig(model=tiny_folder)).encode("hello world") != [2, 3]
    assert load_tokenizer(EngineConfig(model=tiny_folder, tokenizer=folder)).encode(
        "hello world"
    ) == [2, 3]
    engine = LLMEngine(
        EngineConfig(
            model=tiny_folder, tokenizer=folder, num_kv_blocks=8, max_num_batched_tokens=32
        )
    )
    assert engine.tokenizer.path == folder and engine.tokenizer.eos_token_ids == {1}
    # A tokenizer repo id (no config.json in it), from the hub cache offline.
    lay_out_cache(tmp_path / "cache", "org/words", folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = load_tokenizer(
        EngineConfig(model=tiny_folder, tokenizer="org/words", download_dir=str(tmp_path / "cache"))
    )
    assert tok.encode("world hello") == [3, 2]
    with pytest.raises(
        ValueError, match=r"tokenizer 'org/absent': HF_HUB_OFFLINE=1 and org/absent is not in"
    ):
        load_tokenizer(
            EngineConfig(
                model=tiny_folder, tokenizer="org/absent", download_dir=str(tmp_path / "cache")
            )
        )
    with pytest.raises(
        ValueError,
        match=r"EngineConfig.tokenizer: 'no-such-folder' is neither a folder nor a hub repo id",
    ):
        load_tokenizer(EngineConfig(model=tiny_folder, tokenizer="no-such-folder"))


def rendered(config: EngineConfig) -> str:
    tok = load_tokenizer(config)
    return tok.decode(tok.apply_chat_template(MESSAGES), skip_special_tokens=False)


def test_chat_template_override_inline_and_file(tiny_folder, tmp_path):
    assert "<|im_start|>user" in rendered(
        EngineConfig(model=tiny_folder)
    )  # the model's own (SmolLM2's)
    inline = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[bot]{% endif %}"
    )
    assert (
        rendered(EngineConfig(model=tiny_folder, chat_template=inline)) == "[user] hi there\n[bot]"
    )
    jinja_file = tmp_path / "t.jinja"
    jinja_file.write_text("{{ messages[0].content | upper }}")
    assert rendered(EngineConfig(model=tiny_folder, chat_template=str(jinja_file))) == "HI THERE"
    json_file = tmp_path / "chat_template.json"
    json_file.write_text(json.dumps({"chat_template": "<{{ messages[-1].role }}>"}))
    assert rendered(EngineConfig(model=tiny_folder, chat_template=str(json_file))) == "<user>"


def test_bad_chat_templates_fail_at_start_naming_the_field(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"EngineConfig.chat_template: 'templates/missing.jinja' is neither a file nor",
    ):
        read_chat_template("templates/missing.jinja")
    with pytest.raises(
        ValueError, match=r"EngineConfig.chat_template: not a valid Jinja template \(line 1"
    ):
        read_chat_template("{% for m in messages %}{{ m.content }}")
    bad_json = tmp_path / "t.json"
    bad_json.write_text(json.dumps({"template": "x"}))
    with pytest.raises(ValueError, match=r"is JSON without a 'chat_template' string"):
        read_chat_template(str(bad_json))


# -- generation_config.json defaults ---------------------------------------------------------
def write_generation_config(folder: Path, data: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return str(folder)


def test_generation_config_auto_vllm_and_folder(tmp_path):
    model = write_generation_config(
        tmp_path / "model",
        {
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 20,
            "max_new_tokens": 128,
            "do_sample": True,
            "bos_token_id": 1,
            "eos_token_id": [2, 3],
            "repetition_penalty": None,
        },
    )
    assert load_generation_defaults(EngineConfig(model=model), model) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 128,
    }
    assert (
        load_generation_defaults(EngineConfig(model=model, generation_config="vllm"), model) == {}
    )
    other = write_generation_config(tmp_path / "other", {"min_p": 0.05, "repetition_penalty": 1.1})
    assert load_generation_defaults(EngineConfig(model=model, generation_config=other), model) == {
        "min_p": 0.05,
        "repetition_penalty": 1.1,
    }
    assert read_generation_defaults(tmp_path / "no_file_here") == {}
    with pytest.raises(
        ValueError, match=r"generation_config: 'nowhere' must be 'auto', 'vllm' or a folder"
    ):
        load_generation_defaults(EngineConfig(model=model, generation_config="nowhere"), model)


def test_bad_generation_config_fails_naming_file_and_field(tmp_path):
    folder = write_generation_config(tmp_path / "bad", {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config: .*generation_config.json: .*top_p"):
        read_generation_defaults(folder)
    folder = write_generation_config(tmp_path / "str", {"temperature": "hot"})
    with pytest.raises(ValueError, match=r"temperature must be a number, got 'hot'"):
        read_generation_defaults(folder)


def test_defaults_fill_only_fields_the_request_left_unset():
    defaults = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 128}
    requested = {"temperature": 0.0, "top_p": None, "top_k": None, "min_p": 0.1}
    merged = apply_defaults(requested, defaults)
    assert merged == {"temperature": 0.0, "top_p": 0.9, "min_p": 0.1}  # 0.0 is set, not unset
    params = SamplingParams(**merged)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 0.9, 0, 0.1)
    assert apply_defaults({"temperature": None}, {}) == {}


def test_offline_llm_uses_the_models_defaults_and_chat_template(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", "llama", seed=9)
    write_generation_config(Path(folder), {"temperature": 0.0, "max_new_tokens": 3})
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[bot]"
    llm = LLM(model=folder, chat_template=template, num_kv_blocks=16, max_num_batched_tokens=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
    out = llm.chat(MESSAGES)
    assert (
        llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        == "[user] hi there\n[bot]"
    )
    greedy = llm.generate([out.prompt_token_ids], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert (
        out.outputs[0].token_ids == greedy.outputs[0].token_ids
        and len(greedy.outputs[0].token_ids) <= 3
    )
    unset = LLM(model=folder, generation_config="vllm", num_kv_blocks=16, max_num_batched_tokens=64)
    assert unset.get_default_sampling_params() == SamplingParams()
