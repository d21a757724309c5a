"""Models by Hub id against the loopback Hub (tests/fixtures/hub/server.py), through the real
huggingface_hub client: which files travel, revisions, quant tags and split models, drafter
siblings, a download cut off mid-file and resumed, a failed run resumed by a rerun, offline mode
reading the cache, tokens, and one-line errors for bad ids and missing repositories.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time

import pytest
from huggingface_hub import constants

from specconv.cli import main
from specconv.errors import SpecconvError
from specconv.hub.fetch import DownloadEvents, fetch_checkpoint, fetch_gguf, parse_ref
from tests.fixtures.hub.server import READ_TOKEN, Fault, FakeHub

CHUNK = 64 * 1024  # huggingface_hub's download chunk in these tests (a dropped download resumes from a chunk)


@pytest.fixture(autouse=True)
def hub_client_env(monkeypatch, tmp_path):
    # huggingface_hub reads these at import time; tests/conftest.py turns offline mode on for the suite.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_ASSETS_CACHE", str(tmp_path / "assets"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


@pytest.fixture
def hub(monkeypatch):
    with FakeHub(lifetime=300) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def blob(seed: int, size: int) -> bytes:
    return hashlib.shake_256(f"{seed}".encode()).digest(size)


GGUF_REPO = {
    "README.md": b"---\nlibrary_name: gguf\n---\n# X\n",
    "X-Q8_0.gguf": blob(1, 300_000),
    "X.BF16.gguf": blob(2, 5_000),
    "X-Q4_K_M/X-Q4_K_M-00001-of-00003.gguf": blob(3, 4_000),
    "X-Q4_K_M/X-Q4_K_M-00002-of-00003.gguf": blob(4, 4_000),
    "X-Q4_K_M/X-Q4_K_M-00003-of-00003.gguf": blob(5, 4_000),
    "mtp-X-Q8_0.gguf": blob(6, 2_000),
    "mtp-X-Q4_K_M.gguf": blob(7, 2_000),
    "eagle3-X-Q8_0.gguf": blob(8, 2_000),
    "mmproj-X-F16.gguf": blob(9, 2_000),
}


class Notices(DownloadEvents):
    def __init__(self):
        self.seen = []

    def notice(self, text: str) -> None:
        self.seen.append(text)


def downloaded(hub) -> set[str]:
    return {path for path, _, _ in hub.downloads}


def one_error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    with capsys.disabled():
        print(argv, "->", err)
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_quant_tags_pick_the_file_and_a_split_model_comes_whole(hub):
    hub.publish("me/X-GGUF", GGUF_REPO)
    got = fetch_gguf(parse_ref("me/X-GGUF", quant=True))
    shards = [f"X-Q4_K_M/X-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert got.model.name == "X-Q4_K_M-00001-of-00003.gguf" and got.draft is None
    assert downloaded(hub) == set(shards)  # Q4_K_M by default, every shard, no drafter unasked
    for path in shards:
        assert (got.model.parent / path.split("/")[1]).read_bytes() == GGUF_REPO[path]

    got = fetch_gguf(parse_ref("me/X-GGUF:bf16", quant=True))
    assert got.model.read_bytes() == GGUF_REPO["X.BF16.gguf"]
    with pytest.raises(SpecconvError) as info:
        fetch_gguf(parse_ref("me/X-GGUF:Q5_K_M", quant=True))
    assert "no model file with quant tag Q5_K_M" in str(info.value) and "BF16, Q4_K_M, Q8_0" in str(info.value)


def test_a_drafter_asked_for_is_the_sibling_llama_cpp_would_take(hub):
    hub.publish("me/X-GGUF", GGUF_REPO)
    got = fetch_gguf(parse_ref("me/X-GGUF:Q8_0", quant=True), draft="mtp")
    assert got.draft.read_bytes() == GGUF_REPO["mtp-X-Q8_0.gguf"]
    got = fetch_gguf(parse_ref("me/X-GGUF:Q4_K_M", quant=True), draft="mtp")
    assert got.draft.read_bytes() == GGUF_REPO["mtp-X-Q4_K_M.gguf"]  # one folder above the shards
    got = fetch_gguf(parse_ref("me/X-GGUF:Q8_0", quant=True), draft="eagle3")
    assert got.draft.name == "eagle3-X-Q8_0.gguf"
    assert "mmproj-X-F16.gguf" not in downloaded(hub) and "eagle3-X-Q8_0.gguf" in downloaded(hub)
    with pytest.raises(SpecconvError, match="no dflash- file next to X-Q8_0.gguf"):
        fetch_gguf(parse_ref("me/X-GGUF:Q8_0", quant=True), draft="dflash")
    # no mtp- file: none is fetched (the model file may carry its own head), and the caller is told
    hub.publish("me/Embedded-GGUF", {"E-Q8_0.gguf": blob(10, 1000)})
    events = Notices()
    got = fetch_gguf(parse_ref("me/Embedded-GGUF", quant=True), draft="mtp", events=events)
    assert got.draft is None and events.seen == [f"{got.source} holds no mtp- file next to E-Q8_0.gguf"]


def test_a_split_model_missing_a_shard_on_the_hub_is_one_line(hub):
    files = dict(GGUF_REPO)
    del files["X-Q4_K_M/X-Q4_K_M-00002-of-00003.gguf"]
    hub.publish("me/X-GGUF", files)
    with pytest.raises(SpecconvError) as info:
        fetch_gguf(parse_ref("me/X-GGUF:Q4_K_M", quant=True))
    assert "lists 2 of the 3 shards" in str(info.value) and "X-Q4_K_M-00002-of-00003.gguf missing" in str(info.value)


def test_revisions_pin_a_commit_or_branch_and_every_file_comes_from_one_commit(hub):
    first = hub.publish("me/X-GGUF", {"X-Q8_0.gguf": blob(20, 1000), "mtp-X-Q8_0.gguf": blob(21, 500)})
    hub.publish("me/X-GGUF", {"X-Q8_0.gguf": blob(22, 1000), "mtp-X-Q8_0.gguf": blob(23, 500)})
    hub.publish("me/X-GGUF", {"X-Q8_0.gguf": blob(24, 1000)}, branch="v2")
    latest = fetch_gguf(parse_ref("me/X-GGUF:Q8_0", quant=True), draft="mtp")
    assert latest.model.read_bytes() == blob(22, 1000) and latest.draft.read_bytes() == blob(23, 500)
    pinned = fetch_gguf(parse_ref(f"me/X-GGUF@{first}:Q8_0", quant=True), draft="mtp")
    assert pinned.model.read_bytes() == blob(20, 1000) and pinned.draft.read_bytes() == blob(21, 500)
    assert pinned.source == f"me/X-GGUF@{first[:7]}"
    branch = fetch_gguf(parse_ref("me/X-GGUF@v2:Q8_0", quant=True), draft="mtp")
    assert branch.model.read_bytes() == blob(24, 1000) and branch.draft.read_bytes() == blob(23, 500)
    with pytest.raises(SpecconvError, match="has no revision 'v3'"):
        fetch_gguf(parse_ref("me/X-GGUF@v3:Q8_0", quant=True))


def test_a_download_cut_off_mid_file_resumes_from_where_it_stopped(hub):
    hub.publish("me/X-GGUF", GGUF_REPO)
    cut = 200_000
    hub.faults.append(Fault("GET", r"/resolve/[^/]+/X-Q8_0\.gguf$", cut_after=cut))
    got = fetch_gguf(parse_ref("me/X-GGUF:Q8_0", quant=True))
    assert got.model.read_bytes() == GGUF_REPO["X-Q8_0.gguf"]
    gets = [(start, n) for path, start, n in hub.downloads if path == "X-Q8_0.gguf"]
    size = len(GGUF_REPO["X-Q8_0.gguf"])
    print(f"first answer cut after {cut} of {size} bytes; the resumed request asks from byte {gets[1][0]}: "
          f"{cut + gets[1][1]} bytes sent in all")
    assert len(gets) == 2 and gets[0][0] == 0
    assert 0 < gets[1][0] <= cut and gets[1][0] % CHUNK == 0  # a Range request from the last whole chunk written
    assert gets[1][0] + gets[1][1] == size


def test_a_failed_download_is_resumed_by_a_rerun_without_fetching_complete_files_again(hub, capsys):
    hub.publish("me/X-GGUF", GGUF_REPO)
    hub.faults.append(Fault("GET", r"X-Q4_K_M-00002-of-00003\.gguf$", status=500, times=99, message="storage down"))
    line = one_error_line(capsys, ["inspect", "-hf", "me/X-GGUF:Q4_K_M", "--json"])
    assert line.startswith("error: downloading from me/X-GGUF@")
    assert "failed (storage down); rerun the same command to resume" in line
    hub.faults.clear()
    before = list(hub.downloads)
    got = fetch_gguf(parse_ref("me/X-GGUF:Q4_K_M", quant=True))
    again = [path for path, _, _ in hub.downloads[len(before):]]
    assert again == ["X-Q4_K_M/X-Q4_K_M-00002-of-00003.gguf"], again  # shards 1 and 3 were kept
    assert (got.model.parent / "X-Q4_K_M-00002-of-00003.gguf").read_bytes() == GGUF_REPO[
        "X-Q4_K_M/X-Q4_K_M-00002-of-00003.gguf"]
    n_requests = len(hub.requests)
    fetch_gguf(parse_ref("me/X-GGUF:Q4_K_M", quant=True))
    assert not any("/resolve/" in p for _, p in hub.requests[n_requests:])  # all cached: no file request


def test_offline_reads_the_cache_and_names_what_is_missing(hub, monkeypatch):
    hub.publish("me/X-GGUF", GGUF_REPO)
    online = fetch_gguf(parse_ref("me/X-GGUF:Q4_K_M", quant=True), draft="mtp")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n_requests = len(hub.requests)
    offline = fetch_gguf(parse_ref("me/X-GGUF:q4_k_m", quant=True), draft="mtp")
    assert (offline.model, offline.draft) == (online.model, online.draft) and len(hub.requests) == n_requests

    def offline_error(ref: str, draft=None) -> str:
        with pytest.raises(SpecconvError) as info:
            fetch_gguf(parse_ref(ref, quant=True), draft=draft)
        message = str(info.value)
        print(message)
        assert message.startswith("HF_HUB_OFFLINE is set and ") and "\n" not in message
        return message

    assert "me/Other@main is not in the cache" in offline_error("me/Other:Q8_0")
    assert "lacks a model file with quant tag Q8_0 (cached: Q4_K_M)" in offline_error("me/X-GGUF:Q8_0")
    assert "lacks a eagle3- file next to" in offline_error("me/X-GGUF:Q4_K_M", draft="eagle3")
    (online.model.parent / "X-Q4_K_M-00003-of-00003.gguf").unlink()
    assert "lacks X-Q4_K_M/X-Q4_K_M-00003-of-00003.gguf" in offline_error("me/X-GGUF:Q4_K_M")
    assert len(hub.requests) == n_requests


def test_an_unreachable_hub_falls_back_to_the_cache(hub, monkeypatch):
    hub.publish("me/X-GGUF", GGUF_REPO)
    online = fetch_gguf(parse_ref("me/X-GGUF:Q8_0", quant=True))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # huggingface_hub's back-off between connection tries
    events = Notices()
    assert fetch_gguf(parse_ref("me/X-GGUF:Q8_0", quant=True), events=events).model == online.model
    assert events.seen == [f"the Hub cannot be reached ([Errno 111] Connection refused): reading the cached snapshot "
                           f"of {online.source}"]
    with pytest.raises(SpecconvError) as info:
        fetch_gguf(parse_ref("me/Other:Q8_0", quant=True))
    print(info.value)
    assert str(info.value).startswith("the Hub cannot be reached (") and "me/Other@main is not in the cache" in str(
        info.value)


def test_private_repositories_need_hf_token_and_missing_ones_are_one_line(hub, monkeypatch, capsys):
    hub.publish("me/Private-GGUF", {"P-Q8_0.gguf": blob(30, 1000)}, private=True)
    line = one_error_line(capsys, ["inspect", "-hf", "me/Private-GGUF"])
    assert "me/Private-GGUF: no such repository on the Hub, or it is private" in line and "HF_TOKEN" in line
    assert "no such repository" in one_error_line(capsys, ["generate", "-hf", "me/Missing:Q8_0", "-p", "x"])
    assert "not a Hub id" in one_error_line(capsys, ["verify", "-hf", "not-an-id"])
    assert "not a Hub id" in one_error_line(capsys, ["inspect", "-hf", "me/a/b:Q8_0"])
    hub.publish("me/Gated-GGUF", {"G-Q8_0.gguf": blob(31, 1000)})
    hub.faults.append(Fault("GET", r"/api/models/me/Gated-GGUF", status=403, headers={"X-Error-Code": "GatedRepo"},
                            message="Access to model me/Gated-GGUF is restricted"))
    line = one_error_line(capsys, ["inspect", "-hf", "me/Gated-GGUF"])
    assert "me/Gated-GGUF is gated: accept its conditions on the Hub, then set HF_TOKEN" in line
    monkeypatch.setenv("HF_TOKEN", READ_TOKEN)
    got = fetch_gguf(parse_ref("me/Private-GGUF", quant=True))
    assert got.model.read_bytes() == blob(30, 1000)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    line = one_error_line(capsys, ["inspect", "-hf", "me/Other-GGUF"])
    assert "401" in line and "HF_TOKEN" in line


def test_a_checkpoint_by_id_fetches_only_what_convert_reads(hub, tmp_path):
    files = {"config.json": b'{"architectures": ["X"]}', "tokenizer.json": b'{"model": 1}',
             "tokenizer_config.json": b"{}", "README.md": b"# X",
             "model.safetensors.index.json": b'{"weight_map": {"a": "model-1.safetensors"}}',
             "model-1.safetensors": blob(40, 3000), "model-2.safetensors": blob(41, 3000),
             "pytorch_model.bin": blob(42, 3000), "original/consolidated.pth": blob(43, 3000), "X-Q8_0.gguf": b"x"}
    hub.publish("me/Ckpt", files)
    folder = fetch_checkpoint(parse_ref("me/Ckpt", quant=False))
    assert folder.name == "Ckpt"  # convert names outputs after the folder, as for `hf download --local-dir Ckpt`
    assert downloaded(hub) == {"config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
                               "model.safetensors.index.json", "model-1.safetensors"}
    assert (folder / "model-1.safetensors").read_bytes() == files["model-1.safetensors"]
    local = fetch_checkpoint(parse_ref("me/Ckpt", quant=False), local_dir=tmp_path / "here")
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == sorted(downloaded(hub))
    assert not (local / "config.json").is_symlink()

    hub.publish("me/Pickles", {"config.json": b"{}", "pytorch_model.bin": b"x"})
    with pytest.raises(SpecconvError, match="no safetensors weights .pytorch_model.bin is a pickle"):
        fetch_checkpoint(parse_ref("me/Pickles", quant=False))
    hub.publish("me/Only-GGUF", {"X-Q8_0.gguf": b"x"})
    with pytest.raises(SpecconvError, match="no config.json at its root.*-hf me/Only-GGUF"):
        fetch_checkpoint(parse_ref("me/Only-GGUF", quant=False))


def test_a_checkpoint_offline_names_the_missing_shard(hub, monkeypatch):
    index = b'{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}'
    hub.publish("me/Ckpt", {"config.json": b"{}", "model.safetensors.index.json": index,
                            "model-1.safetensors": blob(50, 100), "model-2.safetensors": blob(51, 100)})
    folder = fetch_checkpoint(parse_ref("me/Ckpt", quant=False))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert fetch_checkpoint(parse_ref("me/Ckpt", quant=False)) == folder
    os.unlink(folder / "model-2.safetensors")
    with pytest.raises(SpecconvError) as info:
        fetch_checkpoint(parse_ref("me/Ckpt", quant=False))
    print(info.value)
    assert str(info.value) == (f"HF_HUB_OFFLINE is set and the cache of me/Ckpt@{folder.parent.name[:7]} lacks "
                               "model-2.safetensors: unset HF_HUB_OFFLINE to download")
