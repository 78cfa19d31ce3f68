"""A local stand-in for the Hugging Face Hub: enough of its API for the real huggingface_hub client, with
HF_ENDPOINT pointed at it. What the client calls (read from huggingface_hub 2.x): model_info
(GET /api/models/{repo}/revision/{rev}?blobs=true), the tree listing snapshot_download walks
(GET /api/models/{repo}/tree/{rev}), and each file's HEAD / GET at /{repo}/resolve/{rev}/{file}
(X-Repo-Commit, ETag and Content-Length on both; Range answered with 206, as the hub does for resumes and for
safetensors headers). Errors carry the hub's X-Error-Code / X-Error-Message headers, which the client maps to its
exception types.

Faults, per file: `drop_once` sends half of the file and closes the connection (the first GET only);
`fail_gets` answers 500 to every GET; `sizes` reports a size other than the real one in the repo's metadata;
`hold` sends the first MiB of a file, then waits until `HubServer.release` is set (a download caught mid-file,
for as long as a test needs: to cancel it).
Every request is recorded, so a test can say which bytes of which file were asked for.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    sizes: dict[str, int] = field(default_factory=dict)  # size the metadata reports instead of the real one
    drop_once: set[str] = field(default_factory=set)
    fail_gets: set[str] = field(default_factory=set)
    hold: set[str] = field(default_factory=set)  # sent in part, the rest once the server's `release` is set

    @classmethod
    def from_folder(cls, folder: Path, **extra_files: bytes) -> "Repo":
        files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
        files.update({name.replace("__", "/"): data for name, data in extra_files.items()})
        return cls(files)


@dataclass
class Request:
    method: str
    path: str  # the file, for resolve requests; the API path otherwise
    range: str | None
    sent: int  # body bytes sent


class HubServer:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()  # a held file's handler ends, so shutdown does not wait on it
        self._server.shutdown()
        self._server.server_close()

    def file_requests(self, name: str, method: str = "GET") -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.method == method and r.path == name]

    def full_downloads(self) -> set[str]:
        """Files whose whole body was asked for (a GET without Range)."""
        with self._lock:
            return {r.path for r in self.requests if r.method == "GET" and r.range is None
                    and not r.path.startswith("/api/")}

    def _record(self, r: Request) -> None:
        with self._lock:
            self.requests.append(r)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client expects; every answer has a Content-Length

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._answer(body=True)

            def do_HEAD(self):
                self._answer(body=False)

            def do_POST(self):
                self._error(404, "EntryNotFound", "not served here")

            def _answer(self, body: bool):
                path = unquote(urlsplit(self.path).path)
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?", path):
                    hub._record(Request(self.command, path, None, 0))
                    return self._api(m.group(1), m.group(2), m.group(3))
                if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    return self._file(m.group(1), m.group(2), m.group(3), body)
                self._error(404, None, "no such endpoint")

            def _repo(self, repo_id: str, revision: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound", "Repository not found")
                    return None
                if revision not in ("main", repo.sha):
                    self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
                    return None
                return repo

            def _api(self, repo_id: str, kind: str, revision: str):
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                if kind == "revision":
                    data = {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                            "siblings": [{"rfilename": name, "size": repo.sizes.get(name, len(data)),
                                          "blobId": _oid(data), **_lfs(name, data, repo)}
                                         for name, data in repo.files.items()]}
                else:
                    data = [{"type": "file", "path": name, "size": repo.sizes.get(name, len(content)),
                             "oid": _oid(content), **_lfs(name, content, repo)}
                            for name, content in repo.files.items()]
                self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"}, True)

            def _file(self, repo_id: str, revision: str, name: str, body: bool):
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                wanted = self.headers.get("Range")
                if name not in repo.files:
                    hub._record(Request(self.command, name, wanted, 0))
                    return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.sha})
                data = repo.files[name]
                headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                           "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                if body and name in repo.fail_gets and not wanted:  # the download fails, not a header read
                    hub._record(Request(self.command, name, wanted, 0))
                    return self._error(500, None, "Internal Error", {"X-Repo-Commit": repo.sha})
                status, part = 200, data
                if wanted and (r := re.fullmatch(r"bytes=(\d+)-(\d*)", wanted)):
                    start = int(r.group(1))
                    end = min(int(r.group(2)) if r.group(2) else len(data) - 1, len(data) - 1)
                    status, part = 206, data[start:end + 1]
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                if body and name in repo.drop_once and status == 200:
                    repo.drop_once.discard(name)
                    hub._record(Request(self.command, name, wanted, len(part) // 2))
                    return self._drop(part, headers)
                hub._record(Request(self.command, name, wanted, len(part) if body else 0))
                if body and name in repo.hold and status == 200:
                    return self._held(part, headers)
                self._send(status, part, headers, body)

            def _held(self, data: bytes, headers: dict):
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data[:1 << 20])
                    self.wfile.flush()
                    hub.release.wait(60)
                    self.wfile.write(data[1 << 20:])
                except OSError:  # the client went away (a cancelled download)
                    self.close_connection = True

            def _drop(self, data: bytes, headers: dict):
                """Promise the whole file, send half of it, then close the connection."""
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            def _error(self, status: int, code: str | None, message: str, extra: dict | None = None):
                headers = {"X-Error-Message": message, **(extra or {})}
                if code:
                    headers["X-Error-Code"] = code
                self._send(status, json.dumps({"error": message}).encode(), headers, self.command != "HEAD")

            def _send(self, status: int, data: bytes, headers: dict, body: bool):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _lfs(name: str, data: bytes, repo: Repo) -> dict:
    """Large files live in LFS on the hub (weights, pickles); the metadata says so."""
    if not name.endswith((".safetensors", ".bin", ".gguf", ".pt")):
        return {}
    size = repo.sizes.get(name, len(data))
    return {"lfs": {"size": size, "sha256": hashlib.sha256(data).hexdigest(), "oid": hashlib.sha256(data).hexdigest(),
                    "pointerSize": 134}}
