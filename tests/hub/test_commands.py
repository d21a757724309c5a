"""The commands with Hub ids, end to end against the loopback Hub: `convert OWNER/NAME` writes the bytes
a local conversion writes, a local folder of the same name keeps priority, `--local-dir`; `generate`,
`inspect`, `verify` and `upload` with `-hf` read the files (and the drafter sibling) they would read
from local paths.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from specconv.cli import main
from tests.fixtures.hub.client import loopback_client
from tests.fixtures.hub.ggufs import write_tiny_gguf
from tests.fixtures.hub.server import WRITE_TOKEN, FakeHub

REPO = "me/Tiny-Qwen35"


@pytest.fixture(autouse=True)
def hub_client_env(monkeypatch, tmp_path):
    loopback_client(monkeypatch, tmp_path)


@pytest.fixture
def hub(monkeypatch):
    with FakeHub(lifetime=300) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


@pytest.fixture
def checkpoint(qwen35_dir, tmp_path):
    """A tiny Qwen3.5 checkpoint with an MTP layer, in shards with an index, in a folder named as the repository."""
    folder = tmp_path / "local" / REPO.split("/")[1]
    shutil.copytree(qwen35_dir(sharded=True), folder)
    return folder


def publish_folder(hub, repo_id: str, folder, extra: dict | None = None) -> str:
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    return hub.publish(repo_id, {**files, **(extra or {})})


def run(capsys, argv) -> str:
    """stdout of a command that must succeed."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    assert info.value.code in (0, None), out.err
    return out.out


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_convert_by_hub_id_writes_the_bytes_a_local_conversion_writes(hub, checkpoint, tmp_path, capsys):
    publish_folder(hub, REPO, checkpoint, {"pytorch_model.bin": b"pickle", "optimizer.pt": b"state",
                                           "extra/model.safetensors": b"not read"})
    args = ["--outtype", "q8_0", "--mtp", "separate", "--json"]
    run(capsys, ["convert", str(checkpoint), "-o", str(tmp_path / "local-out") + "/", *args])
    run(capsys, ["convert", REPO, "-o", str(tmp_path / "hub-out") + "/", *args])
    local = sorted((tmp_path / "local-out").iterdir())
    converted = sorted((tmp_path / "hub-out").iterdir())
    assert [p.name for p in local] == [p.name for p in converted] and len(local) == 2
    for a, b in zip(local, converted):
        assert sha256(a) == sha256(b), a.name
    assert {path for path, _, _ in hub.downloads} == {p.name for p in checkpoint.iterdir()}

    # a rerun reads the cache: the repository is listed again, no file is requested
    n_requests = len(hub.requests)
    run(capsys, ["convert", REPO, "-o", str(tmp_path / "again") + "/", *args])
    assert not any("/resolve/" in p for _, p in hub.requests[n_requests:])

    # --local-dir: plain files in a folder of the user's, the same output bytes
    run(capsys, ["convert", REPO, "--local-dir", str(tmp_path / "Tiny-Qwen35"), "-o",
                 str(tmp_path / "dir-out") + "/", *args])
    assert not (tmp_path / "Tiny-Qwen35" / "config.json").is_symlink()
    assert [sha256(p) for p in sorted((tmp_path / "dir-out").iterdir())] == [sha256(p) for p in local]


def test_a_local_folder_named_like_a_hub_id_keeps_priority(hub, checkpoint, tmp_path, capsys):
    hub.publish(REPO, {"config.json": b"{}"})  # not a checkpoint: reading it would fail
    shutil.copytree(checkpoint, tmp_path / REPO)
    n_requests = len(hub.requests)
    run(capsys, ["convert", REPO, "-o", str(tmp_path / "out") + "/", "--outtype", "f16", "--json"])
    assert len(hub.requests) == n_requests
    with pytest.raises(SystemExit):
        main(["convert", "no/such/folder", "-o", str(tmp_path / "out2") + "/"])
    err = capsys.readouterr().err.strip()
    assert err == "error: no/such/folder: no such checkpoint folder, and not a Hub id (OWNER/NAME[@REVISION])"


@pytest.fixture
def gguf_repo(hub, tmp_path, capsys):
    """The bundled model (its MTP head trained: drafts are accepted) converted to a trunk and its mtp-
    sidecar, published as me/Tiny-GGUF."""
    from specconv.demo.bundled import bundled_model_dir

    out = tmp_path / "gguf"
    out.mkdir()
    run(capsys, ["convert", str(bundled_model_dir()), "-o", str(out / "Tiny-Q8_0.gguf"), "--outtype", "q8_0", "--mtp",
                 "separate", "--json"])
    hub.publish("me/Tiny-GGUF", {"Tiny-Q8_0.gguf": (out / "Tiny-Q8_0.gguf").read_bytes(),
                                 "mtp-Tiny-Q8_0.gguf": (out / "mtp-Tiny-Q8_0.gguf").read_bytes()})
    return out


def test_generate_with_hf_and_spec_mtp_runs_the_files_a_local_run_uses(hub, gguf_repo, capsys):
    args = ["--spec", "mtp", "-p", "def read_lines(path):\n", "-n", "16", "--json", "--no-baseline"]
    local = json.loads(run(capsys, ["generate", str(gguf_repo / "Tiny-Q8_0.gguf"), "--mtp",
                                    str(gguf_repo / "mtp-Tiny-Q8_0.gguf"), *args]))
    remote = json.loads(run(capsys, ["generate", "-hf", "me/Tiny-GGUF:q8_0", *args]))
    assert {path for path, _, _ in hub.downloads} == {"Tiny-Q8_0.gguf", "mtp-Tiny-Q8_0.gguf"}
    assert remote["tokens"] == local["tokens"]
    for key in ("drafted", "accepted", "drafter"):
        assert remote["speculative"][key] == local["speculative"][key], key
    with capsys.disabled():
        print(f"MTP drafts from the fetched sidecar: {remote['speculative']['accepted']} of "
              f"{remote['speculative']['drafted']} accepted")
    assert remote["speculative"]["accepted"] > 0  # the trunk-only file has no head: these drafts are the sidecar's
    plain = json.loads(run(capsys, ["generate", "-hf", "me/Tiny-GGUF", "-p", "def read_lines(path):\n", "-n",
                                    "16", "--json"]))
    assert plain["tokens"] == local["tokens"]


def test_inspect_with_hf_shows_what_inspect_of_the_file_shows(hub, gguf_repo, capsys):
    local = json.loads(run(capsys, ["inspect", str(gguf_repo / "mtp-Tiny-Q8_0.gguf"), "--json"]))
    hub.publish("me/Sidecar-Only", {"Tiny-Q8_0.gguf": (gguf_repo / "mtp-Tiny-Q8_0.gguf").read_bytes()})
    remote = json.loads(run(capsys, ["inspect", "-hf", "me/Sidecar-Only:Q8_0", "--json"]))
    for info in (local, remote):
        info.pop("path")
        info.pop("shards")
    assert remote == local


def test_verify_with_hf_passes_the_fetched_files_and_the_checkpoint_on(hub, gguf_repo, checkpoint, monkeypatch):
    """The wiring only (what verify then checks is tests/verify/'s)."""
    import specconv.verify
    from specconv.commands.verify import command

    publish_folder(hub, REPO, checkpoint)
    seen = {}

    class Stop(Exception):
        pass

    def run_verify(opts, progress=None):
        seen.update(model=opts.model, mtp=opts.mtp, draft=opts.draft, hf=opts.hf)
        raise Stop

    monkeypatch.setattr(specconv.verify, "run_verify", run_verify)
    with pytest.raises(Stop):
        command.main(["-hf", "me/Tiny-GGUF:Q8_0", "--spec", "mtp", "--hf", REPO], standalone_mode=False)
    assert sha256(seen["model"]) == sha256(gguf_repo / "Tiny-Q8_0.gguf")
    assert sha256(seen["mtp"]) == sha256(gguf_repo / "mtp-Tiny-Q8_0.gguf") and seen["draft"] is None
    assert seen["hf"].name == "Tiny-Qwen35" and sha256(seen["hf"] / "config.json") == sha256(checkpoint / "config.json")


def test_upload_with_hf_republishes_the_model_and_its_sidecar(hub, tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    src.mkdir()
    names = {"Tiny-Qwen3.5-0.1M-Q8_0.gguf": "trunk", "mtp-Tiny-Qwen3.5-0.1M-Q8_0.gguf": "sidecar"}
    hub.publish("me/Source-GGUF", {name: write_tiny_gguf(src / name, layout, seed=i).read_bytes()
                                   for i, (name, layout) in enumerate(names.items())})
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    run(capsys, ["upload", "-hf", "me/Source-GGUF:Q8_0", "--repo", "me/Copy-GGUF", "--retry-delay", "0.01",
                 "--json"])
    copied = hub.files("me/Copy-GGUF")
    for name in names:
        assert copied[name].sha256 == sha256(src / name), name
    assert "README.md" in copied


def test_local_inputs_do_not_import_the_hub_client(tmp_path):
    """A local file or folder needs no huggingface_hub (its import costs a local `verify` a few tenths
    of a second); a Hub id does."""
    import subprocess
    import sys

    from tests.fixtures.paths import ROOT

    probe = ("import sys; from specconv.commands.hub_inputs import checkpoint_input, gguf_input; "
             "gguf_input(sys.argv[1], None); checkpoint_input(sys.argv[2]); "
             "print('huggingface_hub' in sys.modules, end=' '); "
             "from specconv.hub.fetch import looks_like_hub_id; print('huggingface_hub' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "m.gguf"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.split() == ["False", "True"], out.stderr
