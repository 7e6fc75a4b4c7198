"""Models by hub id: a hub cache laid out on disk (offline), and downloads from a loopback hub.

The engine loads ``org/tiny`` the way a user's ``--model org/tiny`` would: from the Hugging
Face cache layout (``models--org--tiny/snapshots/<sha>/``, ``refs/main``) with
``HF_HUB_OFFLINE=1``, and through huggingface_hub from ``tests/worker/fake_hub.py`` with
``HF_ENDPOINT`` pointing at it (revision, ``HF_TOKEN``, the errors users meet).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.worker.fake_hub import FakeHub, FakeRepo, folder_files
from tests.worker.helpers import AUTO_HERE, lay_out_cache, run
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.hub import looks_like_repo_id, select_files
from worker.loader import load_tokenizer, resolve_model
from worker.sampling_params import SamplingParams
from worker.testing import make_tiny_model

REPO = "org/tiny"
EXTRAS = {
    "pytorch_model.bin": b"not read: safetensors exist",
    "original/consolidated.pth": b"not read either",
    "README.md": b"# tiny",
}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("hub") / "tiny", "llama", seed=3)


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """No stray hub settings from the machine: a fresh HF_HOME, no token, online."""
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HUB_OFFLINE",
        "HF_ENDPOINT",
        "HF_HUB_CACHE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    return monkeypatch


@pytest.fixture
def fake_hub(hub_env, tiny_folder):
    hub = FakeHub()
    repo = FakeRepo()
    repo.add_revision("main", folder_files(tiny_folder, EXTRAS))
    v2 = folder_files(tiny_folder)
    v2["generation_config.json"] = json.dumps({"temperature": 0.25}).encode()
    repo.add_revision("v2", v2)
    hub.repos[REPO] = repo
    hub_env.setenv("HF_ENDPOINT", hub.url)
    yield hub
    hub.close()


def greedy_tokens(config: EngineConfig) -> tuple[LLMEngine, list[int]]:
    engine = LLMEngine(config)
    prompt = engine.tokenizer.encode("The capital of France is")
    out = run(engine, {"r": (prompt, SamplingParams(max_tokens=4, temperature=0.0))})["r"]
    return engine, out.outputs[0].token_ids


def test_repo_id_detection(tmp_path):
    assert looks_like_repo_id("meta-llama/Llama-3.1-8B-Instruct")
    assert (
        not looks_like_repo_id("smollm2")
        and not looks_like_repo_id("/abs/path")
        and not looks_like_repo_id("a/b/c")
    )
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not looks_like_repo_id(
        str(tmp_path / "org" / "name")
    )  # an existing path is a folder, not a repo


def test_offline_engine_loads_repo_id_from_hub_cache(hub_env, tmp_path, tiny_folder):
    cache = tmp_path / "hub_cache"
    snapshot = lay_out_cache(cache, REPO, tiny_folder)
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    hub_env.setenv("HF_HUB_CACHE", str(cache))  # the default cache, as the env says at call time
    engine, tokens = greedy_tokens(
        EngineConfig(model=REPO, num_kv_blocks=16, max_num_batched_tokens=64)
    )
    assert engine.model_path == str(snapshot)
    assert engine.model_id == REPO  # served under the repo id, as vLLM does
    assert (engine.config.device, engine.config.dtype) == AUTO_HERE  # "auto" resolved here
    _, local_tokens = greedy_tokens(
        EngineConfig(model=tiny_folder, num_kv_blocks=16, max_num_batched_tokens=64)
    )
    assert tokens == local_tokens and len(tokens) == 4


def test_offline_and_not_cached_names_repo_and_cache(hub_env, tmp_path):
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "empty_cache"
    with pytest.raises(ValueError, match=rf"HF_HUB_OFFLINE=1 and org/missing is not in {cache}"):
        resolve_model("org/missing", download_dir=str(cache))


def test_download_fetches_only_what_the_engine_reads_then_loads(fake_hub, tmp_path, tiny_folder):
    download_dir = tmp_path / "downloads"
    config = EngineConfig(
        model=REPO, download_dir=str(download_dir), num_kv_blocks=16, max_num_batched_tokens=64
    )
    engine, tokens = greedy_tokens(config)
    snapshot = Path(engine.model_path)
    assert (
        snapshot.parent.parent == download_dir / "models--org--tiny"
        and snapshot.name == FakeRepo.sha("main")
    )
    assert (download_dir / "models--org--tiny" / "refs" / "main").read_text() == FakeRepo.sha(
        "main"
    )
    got = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert got == sorted(
        p.name for p in Path(tiny_folder).iterdir()
    )  # no .bin, no original/, no README
    assert not set(EXTRAS) & set(fake_hub.downloaded())
    assert all(auth is None for _, _, auth in fake_hub.requests)  # no token set: none sent
    _, local_tokens = greedy_tokens(
        EngineConfig(model=tiny_folder, num_kv_blocks=16, max_num_batched_tokens=64)
    )
    assert tokens == local_tokens

    # The same cache then serves HF_HUB_OFFLINE=1 with no request to the hub.
    fake_hub.requests.clear()
    monkey = pytest.MonkeyPatch()
    monkey.setenv("HF_HUB_OFFLINE", "1")
    try:
        assert resolve_model(REPO, download_dir=str(download_dir)).path == str(snapshot)
    finally:
        monkey.undo()
    assert fake_hub.requests == []


def test_revision_is_honoured(fake_hub, tmp_path):
    download_dir = tmp_path / "downloads"
    resolved = resolve_model(REPO, revision="v2", download_dir=str(download_dir))
    assert Path(resolved.path).name == FakeRepo.sha("v2")
    assert json.loads((Path(resolved.path) / "generation_config.json").read_text()) == {
        "temperature": 0.25
    }
    assert (download_dir / "models--org--tiny" / "refs" / "v2").read_text() == FakeRepo.sha("v2")
    with pytest.raises(ValueError, match=r"'org/tiny' \(revision 'nope'\): revision not found"):
        resolve_model(REPO, revision="nope", download_dir=str(download_dir))


def test_tokenizer_only_download_skips_weights(fake_hub, tmp_path):
    tok = load_tokenizer(EngineConfig(model=REPO, download_dir=str(tmp_path / "d")))
    assert tok.encode("hello world")
    assert not any(p.endswith(".safetensors") for p in fake_hub.downloaded())


def test_hf_token_is_sent_and_401_names_hf_token(fake_hub, tmp_path, hub_env):
    fake_hub.token = "hf_secret"
    with pytest.raises(ValueError, match=r"model 'org/tiny'.*refused access \(401\).*set HF_TOKEN"):
        resolve_model(REPO, download_dir=str(tmp_path / "a"))
    hub_env.setenv("HF_TOKEN", "hf_secret")
    fake_hub.requests.clear()
    resolved = resolve_model(REPO, download_dir=str(tmp_path / "b"))
    assert (Path(resolved.path) / "config.json").is_file()
    assert fake_hub.requests and all(auth == "Bearer hf_secret" for _, _, auth in fake_hub.requests)


def test_missing_and_gated_repos_are_clear_errors(fake_hub, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"model .org/nothing.: repository not found on http://127\.0\.0\.1:\d+, "
        r"and no local folder",
    ):
        resolve_model("org/nothing", download_dir=str(tmp_path))
    fake_hub.repos["org/gated"] = FakeRepo(
        revisions=dict(fake_hub.repos[REPO].revisions), gated=True
    )
    with pytest.raises(ValueError, match=r"model 'org/gated' is gated.*set HF_TOKEN"):
        resolve_model("org/gated", download_dir=str(tmp_path))


def test_repo_without_safetensors_is_refused_before_downloading(fake_hub, tmp_path, tiny_folder):
    files = {k: v for k, v in folder_files(tiny_folder).items() if not k.endswith(".safetensors")}
    files["pytorch_model.bin"] = b"weights in pickle form"
    repo = FakeRepo()
    repo.add_revision("main", files)
    fake_hub.repos["org/binonly"] = repo
    with pytest.raises(ValueError, match=r"'org/binonly': the repo has no \*\.safetensors weights"):
        resolve_model("org/binonly", download_dir=str(tmp_path))
    assert fake_hub.downloaded() == []


def test_unreachable_hub_falls_back_to_cache_or_says_both(hub_env, tmp_path, tiny_folder):
    hub = FakeHub()
    dead_url = hub.url
    hub.close()  # nothing listens there now
    hub_env.setenv("HF_ENDPOINT", dead_url)
    with pytest.raises(
        ValueError, match=r"model 'org/tiny': cannot reach http://127\.0\.0\.1:\d+ .* not in "
    ):
        resolve_model(REPO, download_dir=str(tmp_path / "empty"))
    snapshot = lay_out_cache(tmp_path / "cache", REPO, tiny_folder)
    assert resolve_model(REPO, download_dir=str(tmp_path / "cache")).path == str(snapshot)


def test_select_files_follows_the_safetensors_index():
    listing = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "consolidated.safetensors",
        "pytorch_model.bin",
        "original/params.json",
        "original/consolidated.00.pth",
        "tokenizer.model",
        "merges.txt",
        "README.md",
        ".gitattributes",
    ]
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert select_files(listing, shards, weights=True) == sorted(
        [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "merges.txt",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer.model",
            "tokenizer_config.json",
            *shards,
        ]
    )
    assert "consolidated.safetensors" in select_files(
        listing, None, weights=True
    )  # no index: every top-level shard
    assert not any(f.endswith(".safetensors") for f in select_files(listing, shards, weights=False))
