"""A small stand-in for the Hugging Face Hub's file API, for ``huggingface_hub`` through ``HF_ENDPOINT``.

The hub is outside the project: as huggingface_hub's own tests do, these serve a few repositories
from memory on a local port: ``/api/models/<repo>/revision/<rev>`` (repo_info), ``/api/models/<repo>/
tree/<rev>`` (list_repo_tree) and ``/<repo>/resolve/<rev>/<path>`` (HEAD and GET, with ``Range`` for
a resumed download). ``rate`` throttles every body to so many bytes a second; ``corrupt`` flips one
byte in the next N bodies served (the size stays right, the digest does not); ``cut_after`` ends
the next body after so many bytes (a download broken half-way).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    lfs_from: int = 64  # files this large or larger are LFS (their etag is their sha256), as on the hub


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    rate: float = 0.0  # bytes per second per body; 0: as fast as it goes
    corrupt: int = 0  # the next N bodies served each have one byte flipped
    cut_after: int = 0  # the next body ends after this many bytes (then 0 again)
    served: list[str] = field(default_factory=list)  # "GET repo/path range-start" per body
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def meta(self, repo: Repo, path: str) -> tuple[str, bool]:
        data = repo.files[path]
        lfs = len(data) >= repo.lfs_from
        return (hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)), lfs


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            pass

        def _json(self, body: object, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _missing(self, what: str) -> None:
            data = json.dumps({"error": f"{what} not found"}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound" if "file" in what else "RepoNotFound")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def do_HEAD(self) -> None:  # noqa: N802
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            path = unquote(urlparse(self.path).path)
            if path.startswith("/api/models/"):
                return self._api(path.removeprefix("/api/models/"))
            if "/resolve/" in path:
                repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                _, _, file = rest.partition("/")
                return self._file(repo_id, file)
            self._missing("route")

        def _api(self, rest: str) -> None:
            for kind in ("/revision/", "/tree/"):
                if kind in rest:
                    repo_id = rest.partition(kind)[0]
                    break
            else:
                repo_id, kind = rest, "/revision/"
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._missing(f"repository {repo_id}")
            if kind == "/revision/":
                return self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                                   "siblings": [{"rfilename": p} for p in sorted(repo.files)]})
            entries = []
            for p in sorted(repo.files):
                digest, lfs = hub.meta(repo, p)
                entry: dict[str, object] = {"type": "file", "oid": git_sha1(repo.files[p]), "size": len(repo.files[p]),
                                            "path": p}
                if lfs:
                    entry["lfs"] = {"oid": digest, "size": len(repo.files[p]), "pointerSize": 130}
                entries.append(entry)
            self._json(entries)

        def _file(self, repo_id: str, file: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._missing(f"repository {repo_id}")
            if file not in repo.files:
                return self._missing(f"file {file}")
            data = repo.files[file]
            digest, _ = hub.meta(repo, file)
            start = 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes="):
                start = int(rng.removeprefix("bytes=").split("-")[0] or 0)
            body = data[start:]
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("X-Linked-Etag", f'"{digest}"')
            self.send_header("ETag", f'"{digest}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            with hub.lock:
                hub.served.append(f"GET {repo_id}/{file} {start}")
                flip = hub.corrupt > 0 and len(body) > 0
                hub.corrupt -= 1 if flip else 0
                cut, hub.cut_after = hub.cut_after, 0
            if flip:
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            if cut:
                body = body[:cut]
            chunk = max(1, int(hub.rate / 20)) if hub.rate else 1 << 20
            for i in range(0, len(body), chunk):
                try:
                    self.wfile.write(body[i:i + chunk])
                except (BrokenPipeError, ConnectionResetError):
                    return
                if hub.rate:
                    time.sleep(chunk / hub.rate)
            if cut:
                self.close_connection = True

    return Handler


@contextmanager
def serving(hub: Hub) -> Iterator[Hub]:
    """Serve ``hub`` on a free local port (``hub.url``) until the block ends.

    huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported: a test before this one
    that set it (as the planner's tests do, monkeypatched back afterwards) would leave it offline
    for the whole process, and every fetch from this stand-in refused. Online while it serves.
    """
    from huggingface_hub import constants

    was = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        constants.HF_HUB_OFFLINE = was
