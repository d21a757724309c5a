"""The real huggingface_hub client against a loopback fake Hub (tests/fixtures/hub/server.py).

What lands in the repository, the card the Hub received, shards that load back, retries on server
errors, one-line errors for 401/403/missing token/network failure, and an interrupted upload that a
rerun completes without re-sending what was already sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket

import gguf
import pytest
import yaml
from huggingface_hub import constants

from specconv.errors import SpecconvError
from specconv.hub.client import RetryPolicy, UploadEvents, upload_plan
from specconv.hub.plan import build_plan
from tests.fixtures.cli import run_cli
from tests.fixtures.hub.ggufs import tensor_bytes, write_tiny_gguf
from tests.fixtures.hub.server import READ_TOKEN, WRITE_TOKEN, Fault, FakeHub

FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)
REPO = "me/Tiny-GGUF"


@pytest.fixture(autouse=True)
def hub_client_env(monkeypatch, tmp_path):
    # huggingface_hub reads these at import time; tests/conftest.py turns offline mode on for the suite.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # The Xet protocol needs a CAS service; the fake speaks the legacy LFS protocol (docs/reference/hub.md §5).
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


@pytest.fixture
def hub():
    with FakeHub(lifetime=120) as server:
        yield server


@pytest.fixture
def outputs(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    write_tiny_gguf(folder / "model.gguf", "trunk", seed=1)
    write_tiny_gguf(folder / "mtp.gguf", "sidecar", seed=2)
    (folder / "notes.txt").write_text("private notes, not for upload")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.gguf").write_bytes(b"junk")
    return folder


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_upload_lands_exactly_the_plan_with_lfs_models_and_the_card(hub, outputs):
    plan = build_plan(outputs, repo_id=REPO, max_file_size=60_000)
    result = upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)

    files = hub.files(REPO)
    assert set(files) == {".gitattributes"} | {f.path_in_repo for f in plan.files}
    assert not any("notes" in p or ".cache" in p for p in files)
    assert {p for p, b in files.items() if b.is_lfs} == {f.path_in_repo for f in plan.files if f.path_in_repo.endswith(".gguf")}
    assert not files["README.md"].is_lfs
    assert sorted(result.uploaded) == sorted(f.path_in_repo for f in plan.files) and result.skipped == []

    trunk = next(a for a in plan.artifacts if a.role.value == "trunk only")
    assert len(trunk.files) == 2  # 70 kB trunk over a 60 kB limit
    shard_bytes = {}
    for f in trunk.files:
        shard_bytes[f.path_in_repo] = hub.content(REPO, f.path_in_repo)
        assert len(shard_bytes[f.path_in_repo]) <= 60_000
    # the shards as the Hub holds them load back, tensor for tensor identical to the source
    local = outputs.parent / "downloaded"
    local.mkdir()
    paths = []
    for name, data in shard_bytes.items():
        path = local / name.rsplit("/", 1)[-1]
        path.write_bytes(data)
        paths.append(path)
    assert tensor_bytes(sorted(paths)) == tensor_bytes([outputs / "model.gguf"])
    assert gguf.GGUFReader(sorted(paths)[0]).fields["split.count"].contents() == 2

    sidecar = hub.content(REPO, "mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf")
    assert sha256(sidecar) == sha256((outputs / "mtp.gguf").read_bytes())

    card = hub.content(REPO, "README.md").decode()
    assert card == plan.readme.content.decode()
    meta = yaml.safe_load(re.match(r"^---\n(.*?)\n---\n", card, flags=re.S).group(1))
    assert meta["library_name"] == "gguf" and meta["base_model_relation"] == "quantized"
    assert "| `mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf` | Q8_0 |" in card

    messages = set(hub.repos[REPO].messages.values())
    assert {f"Upload {f.path_in_repo} with specconv" for f in plan.files} == messages
    assert hub.count("POST", "/api/validate-yaml") == 1  # the card was validated by the Hub
    # staged shards are removed after success; only the small manifests stay
    assert [p.suffix for p in plan.staging_dir.rglob("*") if p.is_file()] == [".json"]


def test_rerun_skips_everything_already_there(hub, outputs):
    plan = build_plan(outputs, repo_id=REPO)
    upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    before = len(hub.requests)
    commits = len(hub.repos[REPO].commits)
    result = upload_plan(build_plan(outputs, repo_id=REPO), token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    assert result.uploaded == [] and len(result.skipped) == 3
    assert len(hub.repos[REPO].commits) == commits
    new = hub.requests[before:]
    assert not any("/commit/" in p or "/lfs-upload/" in p or "/preupload/" in p for _, p in new), new


class Stages(UploadEvents):
    def __init__(self):
        self.stages = []

    def stage(self, name):
        self.stages.append(name)


def test_rerun_after_success_does_not_split_again(hub, outputs):
    upload_plan(build_plan(outputs, repo_id=REPO, max_file_size=60_000), token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    events = Stages()
    mark = len(hub.requests)
    plan = build_plan(outputs, repo_id=REPO, max_file_size=60_000)
    result = upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST, events=events)
    assert result.uploaded == [] and len(result.skipped) == 4
    assert not any(s.startswith("splitting") for s in events.stages), events.stages
    assert not any(f.staged.exists() for f in plan.artifacts[0].files)
    assert not any("/commit/" in p for _, p in hub.requests[mark:])

    # a changed source is split again and its shards replace the old ones
    write_tiny_gguf(outputs / "model.gguf", "trunk", seed=5)
    events = Stages()
    plan = build_plan(outputs, repo_id=REPO, max_file_size=60_000)
    result = upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST, events=events)
    assert any(s.startswith("splitting Tiny-Qwen3.5-0.1M-Q8_0.gguf") for s in events.stages)
    assert result.uploaded[:2] == plan.artifacts[0].paths
    got = outputs.parent / "got"
    got.mkdir()
    for path in plan.artifacts[0].paths:
        (got / path.rsplit("/", 1)[-1]).write_bytes(hub.content(REPO, path))
    assert tensor_bytes(sorted(got.iterdir())) == tensor_bytes([outputs / "model.gguf"])


def test_server_errors_are_retried_with_back_off(hub, outputs):
    delays = []
    retry = RetryPolicy(attempts=4, base_delay=0.5, max_delay=1.5, sleep=delays.append)
    hub.faults.append(Fault("POST", r"/commit/", status=503, times=3))
    plan = build_plan(outputs, repo_id=REPO)
    upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=retry)
    assert delays == [0.5, 1.0, 1.5]  # exponential, capped
    assert set(hub.files(REPO)) == {".gitattributes"} | {f.path_in_repo for f in plan.files}
    # the retried file's LFS content was sent once: the batch endpoint reported it present afterwards
    assert len(hub.puts) == len(set(hub.puts)) == 2


def test_rate_limits_are_waited_out_as_the_hub_asks(hub, outputs):
    delays = []
    retry = RetryPolicy(attempts=3, base_delay=0.5, sleep=delays.append)
    hub.faults.append(Fault("POST", r"/commit/", status=429, headers={"Retry-After": "7"}, message="commit rate limit"))
    hub.faults.append(
        Fault("POST", r"/commit/", status=429, headers={"RateLimit": '"commits";r=0;t=42'}, message="commit rate limit")
    )
    plan = build_plan(outputs, repo_id=REPO)
    result = upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=retry)
    assert delays == [7.0, 42.0]
    assert len(result.uploaded) == 3


def test_a_dropped_connection_is_retried(hub, outputs):
    hub.faults.append(Fault("POST", r"/commit/", status=None, times=1))
    plan = build_plan(outputs, repo_id=REPO)
    result = upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    assert len(result.uploaded) == 3


def test_interrupted_upload_resumes_without_resending_completed_files(hub, outputs):
    plan = build_plan(outputs, repo_id=REPO, max_file_size=60_000)
    paths = [f.path_in_repo for f in plan.files]  # shard 1, shard 2, sidecar, README
    # the two shard commits go through, then every commit fails: the sidecar's LFS content is sent,
    # its commit is retried and the run gives up
    hub.faults.append(Fault("POST", r"/commit/", status=500, times=99, after=2, message="storage backend unavailable"))
    with pytest.raises(SpecconvError) as info:
        upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    message = str(info.value)
    print("interrupted:", message)
    assert "\n" not in message and "500" in message and "rerun the same command to resume" in message
    assert set(hub.files(REPO)) == {".gitattributes", paths[0], paths[1]}
    sidecar_oid = sha256((outputs / "mtp.gguf").read_bytes())
    assert hub.puts.count(sidecar_oid) == 1  # sent before the failing commit

    hub.faults.clear()
    mark = len(hub.requests)
    puts_before = list(hub.puts)
    result = upload_plan(build_plan(outputs, repo_id=REPO, max_file_size=60_000), token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    assert result.skipped == paths[:2]
    assert result.uploaded == paths[2:]
    assert hub.puts == puts_before  # nothing re-sent: shards skipped, sidecar content already stored
    assert set(hub.files(REPO)) == {".gitattributes", *paths}
    assert sum(1 for m, p in hub.requests[mark:] if "/commit/" in p) == 2


def test_wrong_token_is_a_one_line_401_error(hub, outputs):
    plan = build_plan(outputs, repo_id=REPO)
    with pytest.raises(SpecconvError) as info:
        upload_plan(plan, token="hf_wrong", endpoint=hub.url, retry=FAST)
    message = str(info.value)
    print("401:", message)
    assert "401" in message and "HF_TOKEN" in message and "\n" not in message
    assert REPO not in hub.repos
    assert hub.count("GET", "/api/whoami-v2") == 1  # not retried


def test_read_only_token_is_a_one_line_403_error(hub, outputs):
    plan = build_plan(outputs, repo_id=REPO)
    with pytest.raises(SpecconvError) as info:
        upload_plan(plan, token=READ_TOKEN, endpoint=hub.url, retry=FAST)
    message = str(info.value)
    print("403:", message)
    assert "403" in message and "write access" in message and "\n" not in message
    assert REPO not in hub.repos


def test_namespace_without_permission_is_403(hub, outputs):
    plan = build_plan(outputs, repo_id="someone-else/x")
    with pytest.raises(SpecconvError, match="403.*someone-else/x"):
        upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)


def test_missing_token_is_reported_before_any_request(hub, outputs):
    plan = build_plan(outputs, repo_id=REPO)
    with pytest.raises(SpecconvError, match="no Hugging Face token: set HF_TOKEN"):
        upload_plan(plan, endpoint=hub.url, retry=FAST)
    assert hub.requests == []


def test_network_failure_retries_then_says_to_rerun(outputs):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    delays = []
    retry = RetryPolicy(attempts=3, base_delay=0.001, sleep=delays.append)
    plan = build_plan(outputs, repo_id=REPO)
    with pytest.raises(SpecconvError) as info:
        upload_plan(plan, token=WRITE_TOKEN, endpoint=f"http://127.0.0.1:{port}", retry=retry)
    message = str(info.value)
    print("network:", message)
    assert message.startswith("network failure while checking the token after 3 attempts")
    assert "rerun" in message and "\n" not in message
    assert len(delays) == 2


def test_pull_request_and_branch_targets(hub, outputs):
    upload_plan(build_plan(outputs, repo_id=REPO), token=WRITE_TOKEN, endpoint=hub.url, retry=FAST, private=True)
    assert hub.repos[REPO].private
    main_before = hub.files(REPO)
    (outputs / "extra.gguf").unlink(missing_ok=True)
    write_tiny_gguf(outputs / "model.gguf", "trunk", seed=11)  # changed trunk
    result = upload_plan(build_plan(outputs, repo_id=REPO), token=WRITE_TOKEN, endpoint=hub.url, retry=FAST, create_pr=True)
    repo = hub.repos[REPO]
    assert repo.n_pr == 1 and result.revision == "refs/pr/1"
    assert result.pr_url.endswith("/discussions/1")
    assert hub.files(REPO) == main_before  # main untouched
    changed = "Tiny-Qwen3.5-0.1M-Q8_0.gguf"
    assert result.uploaded == [changed]
    assert sha256(hub.content(REPO, changed, ref="refs/pr/1")) == sha256((outputs / "model.gguf").read_bytes())

    result = upload_plan(build_plan(outputs, repo_id=REPO), token=WRITE_TOKEN, endpoint=hub.url, retry=FAST, revision="q8-dev")
    assert result.revision == "q8-dev" and result.uploaded == [changed]
    assert sha256(hub.content(REPO, changed, ref="q8-dev")) == sha256((outputs / "model.gguf").read_bytes())


def test_an_interrupted_pull_request_is_resumed_into_the_same_pr(hub, outputs):
    plan = build_plan(outputs, repo_id=REPO)
    hub.faults.append(Fault("POST", r"/commit/", status=500, times=99, after=1))
    with pytest.raises(SpecconvError) as info:
        upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST, create_pr=True)
    message = str(info.value)
    print("pr:", message)
    assert message.endswith("rerun the same command to resume (with --revision refs/pr/1 instead of --create-pr)")
    hub.faults.clear()
    result = upload_plan(build_plan(outputs, repo_id=REPO), token=WRITE_TOKEN, endpoint=hub.url, retry=FAST, revision="refs/pr/1")
    assert hub.repos[REPO].n_pr == 1
    assert len(result.skipped) == 1 and len(result.uploaded) == 2
    assert set(hub.files(REPO, ref="refs/pr/1")) == {".gitattributes", *(f.path_in_repo for f in plan.files)}
    assert set(hub.files(REPO)) == {".gitattributes"}  # main untouched



def test_cli_dry_run_sends_nothing(hub, outputs, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich folds long names in narrow terminals
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    code, out, err = run_cli(capsys, "upload", str(outputs), "--repo", REPO, "--dry-run", "--max-file-size", "60K")
    assert code == 0, err
    assert "Tiny-Qwen3.5-0.1M-Q8_0-00001-of-00002.gguf" in err and "mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf" in err
    assert "notes.txt" in err  # listed as not uploaded
    assert hub.requests == []
    assert not (outputs / ".specconv-upload").exists()  # nothing written locally either

    code, out, err = run_cli(capsys, "upload", str(outputs), "--repo", REPO, "--dry-run", "--json")
    data = json.loads(out)
    assert [f["path_in_repo"] for f in data["files"]] == [
        "Tiny-Qwen3.5-0.1M-Q8_0.gguf",
        "mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf",
        "README.md",
    ]
    assert data["readme"].startswith("---\n")
    assert hub.requests == []


def test_cli_upload_uses_env_token_and_endpoint(hub, outputs, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    code, out, err = run_cli(capsys, "upload", str(outputs), "--repo", REPO, "--json", "--retry-delay", "0.001")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["uploaded"]) == 3
    assert set(hub.files(REPO)) == {".gitattributes", "README.md", "Tiny-Qwen3.5-0.1M-Q8_0.gguf", "mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf"}

    monkeypatch.setenv("HF_TOKEN", "hf_bad")
    code, out, err = run_cli(capsys, "upload", str(outputs), "--repo", REPO)
    assert code == 2
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "401" in error_lines[0]
    assert "Traceback" not in err


def test_cli_refuses_bad_repo_ids_before_reading_anything(outputs, capsys):
    code, out, err = run_cli(capsys, "upload", str(outputs), "--repo", "../etc")
    assert code == 2 and err.startswith("error: --repo '../etc' is not a valid Hub repository id")


def test_token_from_the_credential_store(hub, outputs, monkeypatch, tmp_path):
    token_file = tmp_path / "stored-token"
    token_file.write_text(WRITE_TOKEN + "\n")  # what `hf auth login` writes
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(token_file))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    result = upload_plan(build_plan(outputs, repo_id=REPO), retry=FAST)
    assert len(result.uploaded) == 3
    assert result.url.startswith(hub.url)
