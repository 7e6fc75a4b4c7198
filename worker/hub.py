"""Models by hub id: ``--model org/name`` downloaded (or found in the cache) through
``huggingface_hub``.

``download_repo(repo_id, revision=, download_dir=, weights=)`` returns a snapshot folder laid
out like any local model folder, as vLLM does:

- Only what the engine reads is fetched: ``config.json``, ``generation_config.json``, tokenizer
  files, chat templates and top-level ``*.safetensors`` (``weights=False``: everything but the
  weights, for a process that only tokenizes). ``.bin``/``.pth`` files and subfolders such as
  ``original/`` are never fetched. When ``model.safetensors.index.json`` exists only the shards
  its ``weight_map`` names are fetched (Mistral repos also carry a ``consolidated.safetensors``
  copy of every weight).
- The cache is huggingface_hub's (``HF_HUB_CACHE``, ``HF_HOME/hub``) unless ``download_dir`` is
  given. ``HF_TOKEN`` authenticates, ``HF_ENDPOINT`` points at a mirror, ``HF_HUB_OFFLINE=1``
  uses the cache only. These are read when the call is made, not when huggingface_hub was
  imported. huggingface_hub's progress bars show the download.

Failures are ``ValueError``s naming the repo: not found, gated or unauthorised ("set
HF_TOKEN"), unknown revision, no safetensors weights, offline and not cached ("HF_HUB_OFFLINE=1
and <repo> is not in <cache dir>"), hub unreachable and not cached.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}
_SAFETENSORS_INDEX = "model.safetensors.index.json"
NON_WEIGHT_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
"""Top-level files besides the weights: configs, tokenizer files (``tokenizer.json``,
``vocab.json``/``merges.txt``, sentencepiece ``*.model``, ``*.tiktoken``), chat templates."""


def looks_like_repo_id(model: str) -> bool:
    """``org/name`` that is not a path on this machine (a folder of that name wins)."""
    return bool(_REPO_ID.match(model)) and not Path(model).exists()


def offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    return env.upper() in _TRUE if env is not None else bool(constants.HF_HUB_OFFLINE)


def endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def cache_dir(download_dir: str | None) -> str:
    """Where snapshots live: ``download_dir``, else huggingface_hub's cache as the env says now."""
    if download_dir:
        return str(download_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's stored login, if any


def select_files(
    repo_files: list[str], weight_map_files: set[str] | None, weights: bool
) -> list[str]:
    """The files of a repo the engine needs (pure: the repo's listing in, a list out)."""
    top = [f for f in repo_files if "/" not in f]
    chosen = [f for f in top if any(fnmatch.fnmatch(f, p) for p in NON_WEIGHT_PATTERNS)]
    if weights:
        shards = [f for f in top if f.endswith(".safetensors")]
        if weight_map_files is not None:
            shards = [f for f in shards if f in weight_map_files]
        chosen += shards
    return sorted(chosen)


def _describe(repo_id: str, revision: str | None, label: str = "model") -> str:
    return f"{label} {repo_id!r}" + (f" (revision {revision!r})" if revision else "")


def download_repo(
    repo_id: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
    need_config: bool = True,
) -> str:
    """A local snapshot folder of ``repo_id`` holding what the engine needs; see the module doc.
    ``need_config=False``: a tokenizer repo (``--tokenizer``), which may have no config.json."""
    try:
        import httpx2  # huggingface_hub >= 1.x's HTTP client
    except ImportError:  # pragma: no cover - older huggingface_hub
        import httpx as httpx2
    from huggingface_hub import snapshot_download

    cache = cache_dir(download_dir)
    what = _describe(repo_id, revision, "model" if need_config else "tokenizer")
    if offline():
        folder = cached_snapshot(repo_id, revision, cache, need_config)
        if folder is None:
            raise ValueError(
                f"{what}: HF_HUB_OFFLINE=1 and {repo_id} is not in {cache}; "
                "download it once online (or unset HF_HUB_OFFLINE)"
            )
        _check_snapshot(Path(folder), what, weights, need_config)
        log.info("%s: offline, using the cached snapshot %s", what, folder)
        return folder
    url, token = endpoint(), _token()
    try:
        files = _plan(repo_id, revision, cache, url, token, weights, need_config)
        log.info("%s: fetching %d files from %s into %s", what, len(files), url, cache)
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            endpoint=url,
            token=token,
            allow_patterns=files,
        )
    except (
        httpx2.ConnectError,
        httpx2.TimeoutException,
    ) as exc:  # hub unreachable: the cache may do
        folder = cached_snapshot(repo_id, revision, cache, need_config)
        if folder is None:
            raise ValueError(
                f"{what}: cannot reach {url} ({type(exc).__name__}) and {repo_id} is not in "
                f"{cache}; check the network or HF_ENDPOINT"
            ) from exc
        log.warning(
            "%s: cannot reach %s (%s); using the cached snapshot %s",
            what,
            url,
            type(exc).__name__,
            folder,
        )
    except Exception as exc:  # noqa: BLE001 - turned into one clear message per failure kind
        raise _hub_error(exc, what, repo_id, url, cache) from exc
    _check_snapshot(Path(folder), what, weights, need_config)
    return folder


def cached_snapshot(
    repo_id: str, revision: str | None, cache: str, need_config: bool = True
) -> str | None:
    """The snapshot folder the cache holds for ``revision`` (a commit, or a branch/tag through
    ``refs/``), or None. Reads huggingface_hub's cache layout directly: its own offline lookup
    also wants every file of the repo's listing, and we fetch only a subset."""
    storage = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    commit = revision
    if not _COMMIT.match(revision):
        ref = storage / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    folder = storage / "snapshots" / commit
    found = (folder / "config.json").is_file() if need_config else folder.is_dir()
    return str(folder) if found else None


def _plan(
    repo_id: str,
    revision: str | None,
    cache: str,
    url: str,
    token: str | None,
    weights: bool,
    need_config: bool,
) -> list[str]:
    """Lists the repo (one API call) and picks the files; reads the safetensors index if any."""
    from huggingface_hub import HfApi, hf_hub_download

    info = HfApi(endpoint=url, token=token).model_info(repo_id, revision=revision)
    repo_files = [s.rfilename for s in info.siblings or []]
    weight_map_files = None
    if weights and _SAFETENSORS_INDEX in repo_files:
        index = hf_hub_download(
            repo_id,
            _SAFETENSORS_INDEX,
            revision=info.sha,
            cache_dir=cache,
            endpoint=url,
            token=token,
        )
        weight_map_files = set(json.loads(Path(index).read_text()).get("weight_map", {}).values())
    files = select_files(repo_files, weight_map_files, weights)
    if weights and not any(f.endswith(".safetensors") for f in files):
        raise ValueError(
            f"{_describe(repo_id, revision)}: the repo has no *.safetensors weights "
            "(prefixserve reads safetensors only, not .bin/.pth)"
        )
    if need_config and "config.json" not in files:
        raise ValueError(f"{_describe(repo_id, revision)}: the repo has no config.json")
    return files


def _check_snapshot(folder: Path, what: str, weights: bool, need_config: bool) -> None:
    if need_config and not (folder / "config.json").is_file():
        raise ValueError(f"{what}: the snapshot {folder} has no config.json")
    if weights and not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"{what}: the snapshot {folder} has no *.safetensors weights "
            "(a tokenizer-only download? "
            "fetch the model once online)"
        )


def _hub_error(exc: Exception, what: str, repo_id: str, url: str, cache: str) -> Exception:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, ValueError) and not isinstance(exc, HfHubHTTPError):
        return exc  # ours, already clear
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, GatedRepoError):
        return ValueError(
            f"{what} is gated on {url}: accept its licence on the model's page, then set HF_TOKEN "
            "to a token of that account"
        )
    if isinstance(exc, RevisionNotFoundError):
        return ValueError(f"{what}: revision not found in {repo_id} on {url}")
    if status in (401, 403):
        return ValueError(
            f"{what}: {url} refused access ({status}); the repo is private, gated or missing: "
            "set HF_TOKEN to a token that can read it"
            + (" (the one set was refused)" if _token() else "")
        )
    if isinstance(exc, RepositoryNotFoundError) or status == 404:
        return ValueError(
            f"{what}: repository not found on {url}, and no local folder {repo_id!r} exists "
            "(check the id or the path; a private repo needs HF_TOKEN)"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return ValueError(
            f"{what}: cannot reach {url} and {repo_id} is not in {cache} "
            f"({type(exc.__cause__ or exc).__name__}); check the network or HF_ENDPOINT"
        )
    return ValueError(f"{what}: download from {url} failed: {type(exc).__name__}: {exc}")
