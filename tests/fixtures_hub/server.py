"""A loopback fake of the Hugging Face Hub endpoints that huggingface_hub 2.4 calls for an upload.

The real `HfApi` client talks to it over HTTP on 127.0.0.1 (docs/reference/hub.md §6.2): whoami-v2,
repos/create, repo info, branch creation, tree listing, validate-yaml, preupload, the LFS batch API,
the LFS PUT and verify, and the ndjson commit endpoint (with pull requests). Downloads go through
`/{repo}/resolve/{revision}/{path}` (HEAD and GET, with the Hub's X-Repo-Commit / X-Linked-Etag /
X-Linked-Size headers and byte ranges); public repositories are readable without a token. It keeps
repositories in memory as commits of {path: blob}, so tests can assert exactly what landed
(`publish` commits files directly), and it supports failure injection (HTTP errors, dropped
connections, or an answer cut off after some bytes of its body on chosen requests).

Safety: it binds 127.0.0.1 on a free port, answers at most `max_requests` requests and shuts
itself down after `lifetime` seconds even if a test forgets to stop it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import yaml

USER = "me"
ORGS = ("team",)
WRITE_TOKEN = "hf_write_token"
READ_TOKEN = "hf_read_token"
LFS_MIN_SIZE = 10 * 1024 * 1024  # the real Hub's threshold for non-.gguf files
GITATTRIBUTES = b"*.gguf filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Blob:
    size: int
    data: bytes | None = None  # regular files
    sha256: str | None = None  # LFS files

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None

    def tree_entry(self, path: str) -> dict:
        if self.is_lfs:
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n"
            return {
                "type": "file",
                "path": path,
                "size": self.size,
                "oid": git_blob_sha1(pointer.encode()),
                "lfs": {"oid": self.sha256, "size": self.size, "pointerSize": len(pointer)},
            }
        return {"type": "file", "path": path, "size": self.size, "oid": git_blob_sha1(self.data)}


@dataclass
class Repo:
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # ref -> commit id
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # commit id -> tree
    messages: dict[str, str] = field(default_factory=dict)
    n_pr: int = 0

    def tree(self, ref: str = "main") -> dict[str, Blob]:
        return self.commits[self.refs[ref]]


@dataclass
class Fault:
    """Let `after` matching requests through, then answer the next `times` requests matching
    `method` and `path` (regex) with `status` (None: drop the connection without an answer)."""

    method: str
    path: str
    status: int | None = 500
    times: int = 1
    message: str = "injected failure"
    after: int = 0
    headers: dict = field(default_factory=dict)
    cut_after: int | None = None  # answer normally, but drop the connection after this many body bytes


@dataclass(frozen=True)
class RawResponse:
    """A file's bytes (or part of them) with the Hub's download headers, not a JSON answer."""

    body: bytes
    headers: dict


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


class FakeHub:
    def __init__(self, *, max_requests: int = 5000, lifetime: float = 120.0):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.puts: list[str] = []  # LFS oids received by PUT
        self.commit_payloads: list[list[dict]] = []
        self.downloads: list[tuple[str, int, int]] = []  # (path, first byte, bytes answered) per file GET
        self.faults: list[Fault] = []
        self.max_requests = max_requests
        self.lifetime = lifetime
        self._lock = threading.Lock()
        self._counter = 0
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._timer = threading.Timer(self.lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        self._timer.cancel()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- helpers for tests ---------------------------------------------------------------------

    def files(self, repo_id: str, ref: str = "main") -> dict[str, Blob]:
        return dict(self.repos[repo_id].tree(ref))

    def content(self, repo_id: str, path: str, ref: str = "main") -> bytes:
        blob = self.repos[repo_id].tree(ref)[path]
        return self.lfs[blob.sha256] if blob.is_lfs else blob.data

    def count(self, method: str, pattern: str) -> int:
        return sum(1 for m, p in self.requests if m == method and re.search(pattern, p))

    def publish(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main", private: bool = False,
                message: str = "publish") -> str:
        """Commit `files` onto `branch` of `repo_id` (both created if missing), as a push would; returns the
        commit id. Model weights and binary files are stored as LFS objects, as the Hub does."""
        with self._lock:
            repo = self.repos.get(repo_id)
            if repo is None:
                repo = self.repos[repo_id] = Repo(private=private)
                first = hashlib.sha1(f"init {repo_id}".encode()).hexdigest()
                repo.commits[first] = {".gitattributes": Blob(len(GITATTRIBUTES), data=GITATTRIBUTES)}
                repo.refs["main"] = first
            tree = dict(repo.commits[repo.refs.get(branch, repo.refs["main"])])
            for path, data in files.items():
                if path.endswith((".gguf", ".safetensors")) or len(data) >= LFS_MIN_SIZE or b"\0" in data[:512]:
                    oid = hashlib.sha256(data).hexdigest()
                    self.lfs[oid] = data
                    tree[path] = Blob(len(data), sha256=oid)
                else:
                    tree[path] = Blob(len(data), data=data)
            oid = hashlib.sha1(f"{len(repo.commits)} {repo_id} {branch} {sorted(files)}".encode()).hexdigest()
            repo.commits[oid] = tree
            repo.messages[oid] = message
            repo.refs[branch] = oid
        return oid

    # -- request handling ----------------------------------------------------------------------

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and re.search(fault.path, path):
                    if fault.after > 0:
                        fault.after -= 1
                        continue
                    fault.times -= 1
                    return fault
        return None

    def _auth(self, headers, write: bool) -> str:
        auth = headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip()
        if token not in (WRITE_TOKEN, READ_TOKEN):
            raise HubError(401, "Invalid credentials in Authorization header")
        if write and token != WRITE_TOKEN:
            raise HubError(403, "You don't have the rights to write to this repository: use a write token")
        return token

    def _repo(self, ns: str, name: str) -> Repo:
        repo = self.repos.get(f"{ns}/{name}")
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _readable_repo(self, ns: str, name: str, headers) -> Repo:
        """Reads need no token for a public repository; a token sent must be valid, and a private
        repository read without one looks missing (401 with RepoNotFound, as the Hub answers)."""
        token = headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if token and token not in (WRITE_TOKEN, READ_TOKEN):
            raise HubError(401, "Invalid credentials in Authorization header")
        repo = self.repos.get(f"{ns}/{name}")
        if repo is None or (repo.private and not token):
            raise HubError(401 if not token else 404, "Repository not found", "RepoNotFound")
        return repo

    def _resolve(self, method: str, ns: str, name: str, ref: str, path: str, headers) -> tuple[int, RawResponse]:
        repo = self._readable_repo(ns, name, headers)
        tree = self._tree_of(repo, ref)
        blob = tree.get(path)
        if blob is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        data = self.lfs[blob.sha256] if blob.is_lfs else blob.data
        etag = blob.sha256 if blob.is_lfs else git_blob_sha1(data)
        out = {"X-Repo-Commit": repo.refs.get(ref, ref), "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if blob.is_lfs:
            out.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(blob.size)})
        status, start = 200, 0
        if g := re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("Range", "")):
            start = int(g.group(1))
            end = int(g.group(2)) if g.group(2) else len(data) - 1
            if start >= len(data):
                raise HubError(416, "Requested range not satisfiable")
            data = data[start:end + 1]
            status = 206
            out["Content-Range"] = f"bytes {start}-{start + len(data) - 1}/{blob.size}"
        if method == "GET":
            with self._lock:
                self.downloads.append((path, start, len(data)))
        return status, RawResponse(data, out)

    def handle(self, method: str, raw_path: str, headers, body: bytes) -> tuple[int, object]:
        url = urlparse(raw_path)
        path, query = url.path, parse_qs(url.query)
        m = re.fullmatch
        if method == "GET" and path == "/api/whoami-v2":
            token = self._auth(headers, write=False)
            role = "write" if token == WRITE_TOKEN else "read"
            return 200, {"type": "user", "name": USER, "orgs": [{"name": o} for o in ORGS], "auth": {"accessToken": {"role": role}}}
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo(headers, json.loads(body))
        if method == "POST" and path == "/api/validate-yaml":
            return self._validate_yaml(json.loads(body))
        if method == "PUT" and (g := m(r"/lfs-upload/([0-9a-f]{64})", path)):
            return self._lfs_put(g.group(1), body)
        if method == "POST" and (g := m(r"/lfs-verify/([0-9a-f]{64})", path)):
            if g.group(1) not in self.lfs:
                raise HubError(404, "LFS object not found")
            return 200, {}
        if method in ("GET", "HEAD") and (g := m(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)", path)):
            ns, name, ref, file = g.group(1), g.group(2), unquote(g.group(3)), unquote(g.group(4))
            return self._resolve(method, ns, name, ref, file, headers)
        if method == "POST" and (g := m(r"/([^/]+)/([^/]+)\.git/info/lfs/objects/batch", path)):
            self._auth(headers, write=True)
            self._repo(g.group(1), g.group(2))
            return self._lfs_batch(json.loads(body))
        if g := m(r"/api/models/([^/]+)/([^/]+)(?:/(.*))?", path):
            ns, name, rest = g.group(1), g.group(2), g.group(3) or ""
            return self._model_api(method, ns, name, rest, query, headers, body)
        raise HubError(404, f"no route for {method} {path}")

    def _create_repo(self, headers, payload) -> tuple[int, object]:
        self._auth(headers, write=True)
        ns = payload.get("organization") or USER
        if ns != USER and ns not in ORGS:
            raise HubError(403, f"You don't have the rights to create a model under the namespace {ns}")
        repo_id = f"{ns}/{payload['name']}"
        if repo_id in self.repos:
            raise HubError(409, "You already created this model repo", extra={"url": f"{self.url}/{repo_id}"})
        repo = Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
        first = hashlib.sha1(f"init {repo_id}".encode()).hexdigest()
        repo.commits[first] = {".gitattributes": Blob(len(GITATTRIBUTES), data=GITATTRIBUTES)}
        repo.refs["main"] = first
        self.repos[repo_id] = repo
        return 200, {"url": f"{self.url}/{repo_id}"}

    def _validate_yaml(self, payload) -> tuple[int, object]:
        content = payload.get("content", "")
        match = re.match(r"^---\n(.*?)\n---\n", content, flags=re.S)
        if match:
            try:
                meta = yaml.safe_load(match.group(1))
                if not isinstance(meta, dict):
                    raise ValueError("metadata must be a mapping")
            except Exception as exc:  # noqa: BLE001
                return 400, {"errors": [{"message": f"Invalid YAML: {exc}"}], "warnings": []}
        return 200, {"errors": [], "warnings": []}

    def _lfs_batch(self, payload) -> tuple[int, object]:
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], obj["size"]
            if oid in self.lfs and len(self.lfs[oid]) == size:
                objects.append({"oid": oid, "size": size})  # present: no actions, the client skips it
            else:
                objects.append(
                    {
                        "oid": oid,
                        "size": size,
                        "authenticated": True,
                        "actions": {
                            "upload": {"href": f"{self.url}/lfs-upload/{oid}", "header": {}},
                            "verify": {"href": f"{self.url}/lfs-verify/{oid}", "header": {}},
                        },
                    }
                )
        return 200, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, oid: str, body: bytes) -> tuple[int, object]:
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, "sha256 of the uploaded content does not match the oid")
        with self._lock:
            self.lfs[oid] = body
            self.puts.append(oid)
        return 200, {}

    def _model_api(self, method, ns, name, rest, query, headers, body) -> tuple[int, object]:
        m = re.fullmatch
        if method == "GET":
            repo = self._readable_repo(ns, name, headers)
        else:
            self._auth(headers, write=True)
            repo = self._repo(ns, name)
        if method == "GET" and (rest == "" or (g := m(r"revision/(.+)", rest))):
            ref = unquote(g.group(1)) if rest else "main"
            tree = self._tree_of(repo, ref)
            return 200, {
                "id": f"{ns}/{name}",
                "modelId": f"{ns}/{name}",
                "sha": repo.refs.get(ref, ref),
                "private": repo.private,
                "siblings": [{"rfilename": p} for p in sorted(tree)],
            }
        if method == "GET" and (g := m(r"tree/([^/]+)(?:/(.*))?", rest)):
            return 200, self._list_tree(repo, unquote(g.group(1)), unquote(g.group(2) or ""), query)
        if method == "POST" and (g := m(r"branch/(.+)", rest)):
            branch = unquote(g.group(1))
            if branch in repo.refs:
                raise HubError(409, "Reference already exists")
            repo.refs[branch] = repo.refs["main"]
            return 200, {}
        if method == "POST" and (g := m(r"preupload/(.+)", rest)):
            return self._preupload(repo, unquote(g.group(1)), json.loads(body))
        if method == "POST" and (g := m(r"commit/(.+)", rest)):
            create_pr = query.get("create_pr", ["0"])[0] == "1"
            return self._commit(ns, name, repo, unquote(g.group(1)), body, create_pr)
        raise HubError(404, f"no route for {method} /api/models/{ns}/{name}/{rest}")

    def _tree_of(self, repo: Repo, ref: str) -> dict[str, Blob]:
        if ref in repo.refs:
            return repo.tree(ref)
        if ref in repo.commits:
            return repo.commits[ref]
        raise HubError(404, f"Invalid rev id: {ref}", "RevisionNotFound")

    def _list_tree(self, repo: Repo, ref: str, prefix: str, query) -> list[dict]:
        tree = self._tree_of(repo, ref)
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        base = prefix.rstrip("/") + "/" if prefix else ""
        entries, folders = [], set()
        for path in sorted(tree):
            if not path.startswith(base):
                continue
            rel = path[len(base):]
            parts = rel.split("/")
            for depth in range(1, len(parts)):
                folder = base + "/".join(parts[:depth])
                if (recursive or depth == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "path": folder, "oid": hashlib.sha1(folder.encode()).hexdigest()})
            if recursive or len(parts) == 1:
                entries.append(tree[path].tree_entry(path))
        return entries

    def _preupload(self, repo: Repo, ref: str, payload) -> tuple[int, object]:
        tree = self._tree_of(repo, ref) if ref in repo.refs or ref in repo.commits else {}
        files = []
        for f in payload["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["path"].endswith((".gguf", ".safetensors")) or f["size"] >= LFS_MIN_SIZE or b"\0" in sample
            existing = tree.get(f["path"])
            oid = None
            if existing is not None:
                oid = existing.sha256 if existing.is_lfs else git_blob_sha1(existing.data)
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return 200, {"files": files, "commitOid": repo.refs.get(ref)}

    def _commit(self, ns, name, repo: Repo, ref: str, body: bytes, create_pr: bool) -> tuple[int, object]:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the first line must be the commit header")
        tree = dict(self._tree_of(repo, ref))
        for item in lines[1:]:
            key, value = item["key"], item["value"]
            path = value["path"]
            if path.startswith("/") or ".." in path.split("/"):
                raise HubError(400, f"invalid path {path}")
            if key == "file":
                data = base64.b64decode(value["content"])
                tree[path] = Blob(len(data), data=data)
            elif key == "lfsFile":
                oid = value["oid"]
                if oid not in self.lfs or len(self.lfs[oid]) != value.get("size", len(self.lfs[oid])):
                    raise HubError(422, f"LFS object {oid} for {path} was never uploaded")
                tree[path] = Blob(len(self.lfs[oid]), sha256=oid)
            elif key == "deletedFile":
                tree.pop(path, None)
            else:
                raise HubError(400, f"unsupported commit operation {key}")
        with self._lock:
            self.commit_payloads.append(lines)
            oid = hashlib.sha1(f"{len(repo.commits)} {ref} {body[:256]!r}".encode()).hexdigest()
            repo.commits[oid] = tree
            repo.messages[oid] = lines[0]["value"]["summary"]
            pr_url = None
            if create_pr:
                repo.n_pr += 1
                repo.refs[f"refs/pr/{repo.n_pr}"] = oid
                pr_url = f"{self.url}/{ns}/{name}/discussions/{repo.n_pr}"
            elif ref in repo.refs:
                repo.refs[ref] = oid
            else:
                raise HubError(404, f"Invalid rev id: {ref}", "RevisionNotFound")
        return 200, {"commitUrl": f"{self.url}/{ns}/{name}/commit/{oid}", "commitOid": oid, "pullRequestUrl": pr_url}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _serve(self):
        fake = self.fake
        body = self._read_body()
        with fake._lock:
            fake._counter += 1
            over = fake._counter > fake.max_requests
            fake.requests.append((self.command, self.path))
        if over:
            threading.Thread(target=fake.stop, daemon=True).start()
            return self._send(503, {"error": "fake hub request budget exhausted"})
        fault = fake._take_fault(self.command, self.path)
        if fault is not None and fault.cut_after is None:
            if fault.status is None:
                self.close_connection = True
                self.connection.close()  # a dropped connection: the client sees a transport error
                return
            return self._send(fault.status, {"error": fault.message}, message=fault.message, extra=fault.headers)
        try:
            status, payload = fake.handle(self.command, self.path, self.headers, body)
        except HubError as exc:
            return self._send(exc.status, {"error": exc.message, **exc.extra}, message=exc.message, code=exc.code)
        if isinstance(payload, RawResponse):
            return self._send_raw(status, payload, cut_after=fault.cut_after if fault is not None else None)
        self._send(status, payload)

    def _send_raw(self, status: int, response: RawResponse, cut_after: int | None):
        self.send_response(status)
        for key, value in response.headers.items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if cut_after is None:
            self.wfile.write(response.body)
            return
        self.wfile.write(response.body[:cut_after])  # then a dropped connection: the client sees a short body
        self.wfile.flush()
        self.close_connection = True
        self.connection.close()

    def _send(self, status: int, payload, message: str | None = None, code: str | None = None, extra=None):
        data = json.dumps(payload).encode()
        self.send_response(status)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if message:
            self.send_header("X-Error-Message", message)
        if code:
            self.send_header("X-Error-Code", code)
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer has headers only
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_HEAD = _serve
