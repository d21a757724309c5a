"""Send an upload plan to the Hub with huggingface_hub, resumably.

One commit per file, the model card last. Before each file the remote tree is consulted: a file
already present with the same size and hash (sha256 for LFS, git blob id otherwise) is skipped, so
a rerun after an interruption resumes where it stopped; LFS content uploaded before an interrupted
commit is not sent again either (the LFS batch endpoint reports it present). Transient failures
(HTTP 429/5xx, network errors) are retried with exponential back-off; every other failure becomes
a one-line SpecconvError that says what to do.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

import huggingface_hub
from huggingface_hub import CommitOperationAdd, HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.utils import sha as hf_sha

from specconv.errors import SpecconvError
from specconv.hub.plan import PlanFile, UploadPlan
from specconv.hub.staging import recorded_digests, remove_shards, stage
from specconv.digest import sha256_file

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def _transport_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        try:
            errors.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


TRANSPORT_ERRORS = _transport_errors()


@dataclass
class RetryPolicy:
    """`attempts` tries in all, waiting base·2^k seconds (capped) between them."""

    attempts: int = 6
    base_delay: float = 2.0
    max_delay: float = 60.0
    max_server_wait: float = 900.0  # how long a rate limit's Retry-After is honoured
    sleep: Callable[[float], None] = time.sleep

    def delay(self, attempt: int, server_wait: float | None = None) -> float:
        backoff = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
        if server_wait is None:
            return backoff
        return max(backoff, min(float(server_wait), self.max_server_wait))


class UploadEvents:
    """Progress callbacks; the CLI draws a progress bar from them. All are optional no-ops."""

    def stage(self, name: str) -> None: ...
    def start(self, total_bytes: int, n_files: int) -> None: ...
    def file_start(self, pf: PlanFile, action: str) -> None: ...
    def file_done(self, pf: PlanFile, action: str) -> None: ...
    def retry(self, what: str, attempt: int, delay: float, error: str) -> None: ...


@dataclass
class UploadResult:
    repo_id: str
    revision: str
    url: str
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    commits: list[str] = field(default_factory=list)
    pr_url: str | None = None

    def to_dict(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "url": self.url,
            "uploaded": self.uploaded,
            "skipped": self.skipped,
            "commits": self.commits,
            "pr_url": self.pr_url,
        }


# --- errors ----------------------------------------------------------------------------------


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException) -> int | None:
    for e in _chain(exc):
        if isinstance(e, HfHubHTTPError) and getattr(e, "response", None) is not None:
            return e.response.status_code
    return None


def is_transient(exc: BaseException) -> bool:
    status = _status(exc)
    if status is not None:
        return status in TRANSIENT_STATUS
    return any(isinstance(e, TRANSPORT_ERRORS) for e in _chain(exc))


def server_wait(exc: BaseException) -> float | None:
    """Seconds the Hub asked us to wait (Retry-After, or the RateLimit header's reset), if any."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if not isinstance(e, HfHubHTTPError) or response is None:
            continue
        value = response.headers.get("Retry-After", "").strip()
        if value.isdigit():
            return float(value)
        try:
            from huggingface_hub.utils import parse_ratelimit_headers
        except ImportError:
            return None
        info = parse_ratelimit_headers(response.headers)
        if info is not None and info.remaining == 0:
            return float(info.reset_in_seconds)
    return None


def _server_message(exc: BaseException) -> str:
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(e, HfHubHTTPError) and response is not None:
            message = response.headers.get("X-Error-Message")
            if not message:
                try:
                    body = response.json()
                    message = body.get("error") if isinstance(body, dict) else None
                except Exception:
                    message = None
            if message:
                return " ".join(str(message).split())[:300]
    return " ".join(str(exc).split())[:300]


def user_error(exc: BaseException, action: str, repo_id: str, attempts: int) -> SpecconvError:
    """One line that names the cause and the remedy."""
    if any(isinstance(e, OfflineModeIsEnabled) for e in _chain(exc)):
        return SpecconvError("HF_HUB_OFFLINE is set: unset it to upload")
    status = _status(exc)
    detail = _server_message(exc)
    resume = "rerun the same command to resume"
    if status == 401:
        return SpecconvError(
            f"the Hub rejected the token (401 Unauthorized) while {action}: set a valid HF_TOKEN or run `hf auth login`"
        )
    if status == 403:
        return SpecconvError(
            f"permission denied (403 Forbidden) while {action}: the token cannot write to {repo_id}; "
            f"use a token with write access to that namespace ({detail})"
        )
    if status is not None and status in TRANSIENT_STATUS:
        return SpecconvError(
            f"the Hub kept failing while {action} (HTTP {status} after {attempts} attempts: {detail}); {resume}"
        )
    if status is not None:
        return SpecconvError(f"the Hub refused {action} (HTTP {status}: {detail})")
    if is_transient(exc):
        return SpecconvError(f"network failure while {action} after {attempts} attempts ({detail}); {resume}")
    if isinstance(exc, ValueError) and "README.md" in str(exc):
        return SpecconvError(f"the Hub rejected the model card metadata: {detail}")
    return SpecconvError(f"{action} failed: {type(exc).__name__}: {detail}")


def with_retries(fn, *, action: str, repo_id: str, retry: RetryPolicy, events: UploadEvents, before_retry=None):
    """Call `fn()`; retry transient failures with back-off. `before_retry()` may return a value that
    makes a retry unnecessary (the operation turned out to have succeeded)."""
    for attempt in range(1, retry.attempts + 1):
        try:
            return fn()
        except SpecconvError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised as one line
            if not is_transient(exc) or attempt == retry.attempts:
                raise user_error(exc, action, repo_id, attempt) from exc
            delay = retry.delay(attempt, server_wait(exc))
            events.retry(action, attempt, delay, _server_message(exc))
            retry.sleep(delay)
            if before_retry is not None:
                done = before_retry()
                if done is not None:
                    return done
    raise AssertionError("unreachable")


# --- hashing ---------------------------------------------------------------------------------


def _same_remote(pf: PlanFile, remote) -> tuple[bool, bytes | None]:
    """(identical?, local sha256 if known or computed). Hashes only when the sizes already agree."""
    if remote is None or remote.size != pf.size:
        return False, pf.sha256
    data = pf.content
    if remote.lfs is not None:
        digest = pf.sha256
        if digest is None:
            digest = hashlib.sha256(data).digest() if data is not None else sha256_file(pf.local_path)
        return digest.hex() == remote.lfs.sha256, digest
    raw = data if data is not None else pf.local_path.read_bytes()
    return hf_sha.git_hash(raw) == remote.blob_id, pf.sha256


def _already_published(plan: UploadPlan, remote: dict) -> set[str]:
    """Re-split artifacts whose recorded shard digests all match the remote tree: no need to split."""
    done = set()
    for a in plan.artifacts:
        digests = recorded_digests(plan, a) if a.layout is not None else None
        if digests is None:
            continue
        entries = [remote.get(f.path_in_repo) for f in a.files]
        if all(
            e is not None and e.lfs is not None and e.size == f.size and e.lfs.sha256 == d.hex()
            for e, f, d in zip(entries, a.files, digests)
        ):
            for f, d in zip(a.files, digests):
                f.sha256 = d
            done.add(a.name)
    return done


# --- the upload ------------------------------------------------------------------------------


def resolve_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def resolve_token(token: str | None = None) -> str:
    token = token or huggingface_hub.get_token()
    if not token:
        raise SpecconvError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a write token is needed)")
    return token


def _version() -> str:
    try:
        return metadata.version("specconv")
    except metadata.PackageNotFoundError:
        return "0"


def upload_plan(
    plan: UploadPlan,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    retry: RetryPolicy | None = None,
    events: UploadEvents | None = None,
    keep_staging: bool = False,
) -> UploadResult:
    retry = retry or RetryPolicy()
    events = events or UploadEvents()
    revision = revision or plan.revision
    repo_id = plan.repo_id
    if create_pr and revision not in (None, "main"):
        raise SpecconvError("--create-pr opens a pull request against main; to resume into one use --revision refs/pr/N")
    if constants.HF_HUB_OFFLINE:
        raise SpecconvError("HF_HUB_OFFLINE is set: unset it to upload")
    endpoint = resolve_endpoint(endpoint)
    api = HfApi(endpoint=endpoint, token=resolve_token(token), library_name="specconv", library_version=_version())

    def call(fn, action, before_retry=None):
        return with_retries(fn, action=action, repo_id=repo_id, retry=retry, events=events, before_retry=before_retry)

    events.stage("checking the token")
    call(lambda: api.whoami(), "checking the token")
    events.stage(f"creating {repo_id}")
    repo_url = call(lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"), f"creating {repo_id}")
    target = revision or "main"
    if revision and not revision.startswith("refs/pr/"):
        call(lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), f"creating branch {revision}")

    def remote_files(rev: str) -> dict:
        files = api.list_repo_tree(repo_id, recursive=True, revision=rev)
        return {f.path: f for f in files if hasattr(f, "blob_id")}

    events.stage("listing the repository")
    remote = call(lambda: remote_files(target), f"listing {repo_id}@{target}")
    events.stage("writing split files")
    published = _already_published(plan, remote)
    stage(plan, on_artifact=lambda a: events.stage(f"splitting {a.name} into {len(a.files)} files"), skip=published)
    result = UploadResult(repo_id=repo_id, revision=target, url=str(repo_url))
    pr_open = create_pr
    events.start(sum(f.size for f in plan.files), len(plan.files))
    for pf in plan.files:
        same, digest = _same_remote(pf, remote.get(pf.path_in_repo))
        if same:
            result.skipped.append(pf.path_in_repo)
            events.file_done(pf, "skipped")
            continue
        events.file_start(pf, "uploading")

        def commit(pf=pf, digest=digest):
            op = CommitOperationAdd(pf.path_in_repo, pf.content if pf.content is not None else str(pf.local_path))
            if digest is not None:
                op.upload_info.sha256 = digest  # already hashed for the comparison: don't read it twice
            return api.create_commit(
                repo_id,
                [op],
                commit_message=f"Upload {pf.path_in_repo} with specconv",
                revision=None if pr_open else target,
                create_pr=pr_open,
            )

        def landed(pf=pf):
            # A commit whose response was lost may have succeeded: look before committing again.
            if pr_open:
                return None
            try:
                again = remote_files(target)
            except Exception:  # noqa: BLE001 - the retry itself will report the failure
                return None
            return "already" if _same_remote(pf, again.get(pf.path_in_repo))[0] else None

        try:
            info = call(commit, f"uploading {pf.path_in_repo}", before_retry=landed)
        except SpecconvError as exc:
            if create_pr and not pr_open:  # a PR exists: say how to continue it rather than open another
                raise SpecconvError(f"{exc} (with --revision {target} instead of --create-pr)") from exc
            raise
        if info != "already":
            result.commits.append(info.oid)
            if pr_open:
                pr_open = False
                target = info.pr_revision or target
                result.revision = target
                result.pr_url = info.pr_url
        result.uploaded.append(pf.path_in_repo)
        events.file_done(pf, "uploaded")
    if not keep_staging:
        remove_shards(plan)
    return result
