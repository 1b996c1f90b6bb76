"""A Hugging Face hub on loopback: just the endpoints huggingface_hub's client calls.

``HF_ENDPOINT=hub.url`` sends the real client here, so its own code runs (revision
resolution, tree listing, HEAD for ETag and commit, GET with ``Range`` to resume), and
no test reaches the real hub. Repositories are a dict: repo id -> {path: bytes or Path}.

- ``GET /api/models/{repo}[/revision/{rev}]``: the model info (``sha``, ``siblings``);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file listing (one page);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: the file, with ``ETag`` (its sha256),
  ``X-Repo-Commit``, ``Content-Length`` and ``Range`` support. No Xet headers are sent,
  so the client downloads over plain HTTP.

Unknown repositories are 404 ``RepoNotFound``. A gated repository lists its files to
anyone (as the hub does) but its files answer 401 ``GatedRepo`` without a token and 403
with a token it does not accept. ``cut_once`` drops a file's connection after some bytes,
once; ``broken`` files answer every GET with 500; ``rate`` throttles every file download
(bytes per second).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

import attrs

CHUNK = 1 << 20


@attrs.define
class Logged:
    method: str
    repo: str
    path: str  # the file path in the repository, or the API route
    range: str | None
    status: int
    at: float = attrs.field(factory=time.monotonic)  # when the answer began
    ended: float | None = None  # when a file's body was sent (or cut off)


@attrs.define
class Repo:
    files: dict[str, bytes | Path]
    gated_token: str | None = None  # set: the repository is gated; this token may read it
    _etags: dict[str, str] = attrs.field(factory=dict)

    def size(self, path: str) -> int:
        content = self.files[path]
        return content.stat().st_size if isinstance(content, Path) else len(content)

    def etag(self, path: str) -> str:
        if path not in self._etags:
            digest = hashlib.sha256()
            content = self.files[path]
            if isinstance(content, Path):
                with content.open("rb") as handle:
                    while block := handle.read(1 << 20):
                        digest.update(block)
            else:
                digest.update(content)
            self._etags[path] = digest.hexdigest()
        return self._etags[path]

    @property
    def sha(self) -> str:
        listing = sorted((path, self.size(path)) for path in self.files)
        return hashlib.sha1(json.dumps(listing).encode()).hexdigest()

    def open(self, path: str) -> BinaryIO:
        content = self.files[path]
        return content.open("rb") if isinstance(content, Path) else io.BytesIO(content)


class FakeHub:
    """The hub server; ``url`` is what ``HF_ENDPOINT`` should name."""

    def __init__(self, repos: Mapping[str, Mapping[str, bytes | Path]] = ()) -> None:
        self.repos: dict[str, Repo] = {}
        for repo_id, files in dict(repos).items():
            self.add(repo_id, files)
        self.log: list[Logged] = []
        self.rate: float | None = None  # bytes per second for file bodies
        self.broken: set[tuple[str, str]] = set()  # (repo, path) whose GETs answer 500
        self._cuts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, repo_id: str, files: Mapping[str, bytes | Path], *,
            gated_token: str | None = None) -> None:
        """Serve ``repo_id`` with ``files`` (path in the repository -> bytes or a file)."""
        self.repos[repo_id] = Repo(dict(files), gated_token=gated_token)

    def cut_once(self, repo_id: str, path: str, after: int) -> None:
        """The next GET of ``path`` sends ``after`` bytes of its body, then hangs up."""
        self._cuts[(repo_id, path)] = after

    def gets(self, repo_id: str, path: str) -> list[Logged]:
        """The GETs of one file, in order."""
        return [e for e in self.log if e.method == "GET" and e.repo == repo_id
                and e.path == path]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take_cut(self, repo_id: str, path: str) -> int | None:
        with self._lock:
            return self._cuts.pop((repo_id, path), None)


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the hub keeps its own log
            pass

        def do_GET(self) -> None:
            self._route(head=False)

        def do_HEAD(self) -> None:
            self._route(head=True)

        def _route(self, *, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            api = _API.match(path)
            if api is not None:
                return self._api(api.group(1), api.group(2), api.group(4))
            resolve = _RESOLVE.match(path)
            if resolve is not None:
                return self._file(resolve.group(1), resolve.group(3), head=head)
            self._error(404, "", path, "EntryNotFound")

        def _note(self, repo: str, path: str, status: int) -> Logged:
            entry = Logged(self.command, repo, path, self.headers.get("Range"), status)
            hub.log.append(entry)
            return entry

        def _error(self, status: int, repo_id: str, path: str, code: str) -> None:
            self._note(repo_id, path, status)
            body = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _api(self, repo_id: str, kind: str | None, subpath: str | None) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, repo_id, "api", "RepoNotFound")
            if kind == "tree":
                prefix = (subpath or "").strip("/")
                entries = [_tree_entry(repo, p) for p in sorted(repo.files)
                           if not prefix or p.startswith(prefix + "/")]
                return self._json(repo_id, "api/tree", entries)
            info = {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                    "gated": "manual" if repo.gated_token else False,
                    "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
            self._json(repo_id, "api/info", info)

        def _json(self, repo_id: str, route: str, payload) -> None:
            self._note(repo_id, route, 200)
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _file(self, repo_id: str, path: str, *, head: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, repo_id, path, "RepoNotFound")
            if repo.gated_token is not None:
                auth = self.headers.get("Authorization")
                if auth is None:
                    return self._error(401, repo_id, path, "GatedRepo")
                if auth != f"Bearer {repo.gated_token}":
                    return self._error(403, repo_id, path, "GatedRepo")
            if path not in repo.files:
                return self._error(404, repo_id, path, "EntryNotFound")
            if not head and (repo_id, path) in hub.broken:
                return self._error(500, repo_id, path, "InternalError")
            size = repo.size(path)
            start, end, status = 0, size, 200
            wanted = _RANGE.match(self.headers.get("Range") or "")
            if wanted is not None and not head:
                start = int(wanted.group(1))
                end = min(size, int(wanted.group(2)) + 1) if wanted.group(2) else size
                status = 206
            entry = self._note(repo_id, path, status)
            self.send_response(status)
            self.send_header("ETag", f'"{repo.etag(path)}"')
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.end_headers()
            if head:
                return
            cut = hub._take_cut(repo_id, path)
            try:
                self._send(repo, path, start, end if cut is None else min(end, start + cut))
            finally:
                entry.ended = time.monotonic()
            if cut is not None:  # hang up mid-body: the client sees a short read
                self.close_connection = True
                self.connection.shutdown(2)

        def _send(self, repo: Repo, path: str, start: int, end: int) -> None:
            began = time.monotonic()
            sent = 0
            with repo.open(path) as body:
                body.seek(start)
                while start + sent < end:
                    block = body.read(min(CHUNK, end - start - sent))
                    self.wfile.write(block)
                    sent += len(block)
                    if hub.rate:
                        ahead = sent / hub.rate - (time.monotonic() - began)
                        if ahead > 0:
                            time.sleep(ahead)

    return Handler


def _tree_entry(repo: Repo, path: str) -> dict:
    entry = {"type": "file", "path": path, "size": repo.size(path),
             "oid": hashlib.sha1(path.encode()).hexdigest()}
    if path.endswith((".gguf", ".safetensors", ".bin")):  # LFS files, as the hub lists them
        entry["lfs"] = {"oid": repo.etag(path), "size": repo.size(path), "pointerSize": 134}
    return entry
