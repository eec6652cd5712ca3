"""A stand-in for the Hugging Face hub: the endpoints huggingface_hub's snapshot_download and model_info use, serving
local directories as repositories. Point HF_ENDPOINT at it.

Read from huggingface_hub 2.x (hf_api.py, file_download.py, _snapshot_download.py): model_info asks
`GET /api/models/{repo}/revision/{rev}` (JSON with `sha` and `siblings`, with sizes when `blobs` is asked),
snapshot_download lists `GET /api/models/{repo}/tree/{commit}?recursive=...` (JSON entries `type`, `path`,
`size`, `oid`), then per file `HEAD /{repo}/resolve/{commit}/{path}` (headers X-Repo-Commit, ETag,
Content-Length) and `GET` of the same (a Range request resumes). An unknown repository is a 404 with
X-Error-Code: RepoNotFound, which the client turns into RepositoryNotFoundError.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class Repo:
    def __init__(self, repo_id: str, root: Path):
        self.id, self.root = repo_id, root
        self.sha = hashlib.sha1(repo_id.encode()).hexdigest()  # one commit per repository, stable

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def oid(self, path: str) -> str:
        return hashlib.sha1((self.root / path).read_bytes()).hexdigest()


class StandinHub:
    """`with StandinHub({"owner/name": directory}) as hub:` serves at hub.url; hub.requests lists what was asked."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = {repo_id: Repo(repo_id, Path(root)) for repo_id, root in repos.items()}
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[tuple[str, str]] = []  # (file, Range header) of each GET that asked for part of a file
        # file name -> bytes: the next GET of that file sends this many bytes of it, then drops the connection
        self.cut_once: dict[str, int] = {}
        # private repositories: repo id -> the token a request must bear (as HF_TOKEN makes the client send it)
        self.tokens: dict[str, str] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the test asserts on hub.requests
                pass

            def do_GET(self):
                hub.handle(self, send_body=True)

            def do_HEAD(self):
                hub.handle(self, send_body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandinHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def fetched(self) -> list[str]:
        """The files whose content was downloaded (GET of a resolve URL)."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path in self.requests
                if method == "GET" and "/resolve/" in path]

    # --- routes ---------------------------------------------------------------------------------------------

    def handle(self, request: BaseHTTPRequestHandler, send_body: bool) -> None:
        path = unquote(urlsplit(request.path).path)
        self.requests.append((request.command, path))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?(/.*)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = self.repos.get((api or resolve).group(1)) if (api or resolve) else None
        token = self.tokens.get(repo.id) if repo else None
        if token and request.headers.get("Authorization") != f"Bearer {token}":
            repo = None  # the hub answers for a private repository as for one that does not exist
        if repo is None:
            return self.reply(request, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"},
                              send_body)
        revision = (api.group(3) if api else resolve.group(2)) or "main"
        if revision not in ("main", repo.sha):
            return self.reply(request, 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"},
                              send_body)
        if api and api.group(2) == "tree":
            entries = [{"type": "file", "path": f, "size": (repo.root / f).stat().st_size, "oid": repo.oid(f)}
                       for f in repo.files()]
            return self.reply(request, 200, entries, {}, send_body)
        if api:
            siblings = [{"rfilename": f, "size": (repo.root / f).stat().st_size} for f in repo.files()]
            return self.reply(request, 200, {"id": repo.id, "modelId": repo.id, "sha": repo.sha, "private": False,
                                             "siblings": siblings, "tags": ["openvino"]}, {}, send_body)
        return self.file(request, repo, resolve.group(3), send_body)

    def file(self, request: BaseHTTPRequestHandler, repo: Repo, name: str, send_body: bool) -> None:
        target = repo.root / name
        if not target.is_file():
            return self.reply(request, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"}, send_body)
        data = target.read_bytes()
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", request.headers.get("Range", ""))
        if ranged:
            start = min(int(ranged.group(1)), len(data))
            if send_body:
                self.ranges.append((name, request.headers["Range"]))
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{repo.oid(name)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if ranged:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = self.cut_once.pop(name, None) if send_body else None
        self.send(request, 206 if ranged else 200, data[start:], headers, send_body, cut)

    def reply(self, request, status: int, body, headers: dict, send_body: bool) -> None:
        self.send(request, status, json.dumps(body).encode(), {"Content-Type": "application/json", **headers},
                  send_body)

    @staticmethod
    def send(request: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict, send_body: bool,
             cut: int | None = None) -> None:
        request.send_response(status)
        for key, value in headers.items():
            request.send_header(key, value)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        if send_body:
            request.wfile.write(body[:cut])
        if cut is not None:  # a connection lost mid-file: what arrived so far is all the client gets
            request.wfile.flush()
            request.close_connection = True
            request.connection.shutdown(2)
