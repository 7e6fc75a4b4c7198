"""A tiny Hugging Face hub on loopback: the API routes huggingface_hub's ``snapshot_download``
calls, serving repos held in memory, so the download path is tested without a network.

Routes (as the hub answers them): ``GET /api/models/{repo}[/revision/{rev}]`` (model info with
``sha`` and ``siblings``), ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (the file listing),
``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (a file, with ``X-Repo-Commit`` and ``ETag``).
Errors carry the hub's ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``, ``GatedRepo``). ``token`` makes every repo need ``Authorization: Bearer
<token>`` (401 otherwise); every request's method, path and Authorization is recorded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    revisions: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """Revision name (branch or tag) -> {path: content}."""
    gated: bool = False

    def add_revision(self, name: str, files: dict[str, bytes]) -> str:
        self.revisions[name] = files
        return self.sha(name)

    @staticmethod
    def sha(name: str) -> str:
        return hashlib.sha1(f"commit-{name}".encode()).hexdigest()

    def lookup(self, rev: str) -> tuple[str, dict[str, bytes]] | None:
        for name, files in self.revisions.items():
            if rev in (name, self.sha(name)):
                return self.sha(name), files
        return None


def folder_files(folder: str | Path, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """A local model folder's files as a repo revision (plus ``extra`` paths)."""
    files = {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in Path(folder).rglob("*")
        if p.is_file()
    }
    files.update(extra or {})
    return files


class FakeHub:
    def __init__(self, token: str | None = None):
        self.repos: dict[str, FakeRepo] = {}
        self.token = token
        self.requests: list[tuple[str, str, str | None]] = []
        """(method, path, Authorization header) of every request, in order."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                hub._handle(self, body=True)

            def do_HEAD(self):  # noqa: N802
                hub._handle(self, body=False)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fake-hub", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloaded(self) -> list[str]:
        """Paths fetched with GET .../resolve/..., in order."""
        return [
            p.split("/resolve/", 1)[1].split("/", 1)[1]
            for m, p, _ in self.requests
            if m == "GET" and "/resolve/" in p
        ]

    # -- routing ---------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            repo = self._repo(h, repo_id)
            if repo is None:
                return
            if rest[:1] == ["tree"] and len(rest) >= 2:
                found = self._revision(h, repo, rest[1])
                if found:
                    prefix = "/".join(rest[2:])
                    listing = [
                        {
                            "type": "file",
                            "path": p,
                            "size": len(c),
                            "oid": hashlib.sha1(c).hexdigest(),
                        }
                        for p, c in sorted(found[1].items())
                        if p.startswith(prefix)
                    ]
                    self._json(h, 200, listing)
                return
            rev = rest[1] if rest[:1] == ["revision"] and len(rest) >= 2 else "main"
            found = self._revision(h, repo, rev)
            if found:
                sha, files = found
                self._json(
                    h,
                    200,
                    {
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": sha,
                        "private": False,
                        "gated": repo.gated and "manual",
                        "siblings": [{"rfilename": p} for p in sorted(files)],
                    },
                )
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo(h, "/".join(parts[:2]))
            found = repo and self._revision(h, repo, parts[3])
            if not found:
                return
            sha, files = found
            name = "/".join(parts[4:])
            if name not in files:
                self._error(h, 404, "EntryNotFound", f"{name} not found")
                return
            content = files[name]
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Length", str(len(content)))
            h.send_header("X-Repo-Commit", sha)
            h.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
            h.end_headers()
            if body:
                h.wfile.write(content)
            return
        self._error(h, 404, None, "no such route")

    def _repo(self, h, repo_id: str) -> FakeRepo | None:
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 401, None, "Invalid username or password.")
            return None
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", "Repository not found")
        elif repo.gated:
            self._error(h, 403, "GatedRepo", "Access to this model is restricted")
            return None
        return repo

    def _revision(self, h, repo: FakeRepo, rev: str):
        found = repo.lookup(rev)
        if found is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return found

    @staticmethod
    def _json(h, status: int, data) -> None:
        raw = json.dumps(data).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)

    def _error(self, h, status: int, code: str | None, message: str) -> None:
        raw = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)
