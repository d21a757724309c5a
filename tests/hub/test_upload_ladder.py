"""A quant ladder on the Hub: `convert --outtype q8_0,q6_k,q4_k_m --mtp separate` uploaded to one repository
with one model card whose table gives each file's type, tensor-type mix, size and the verify figures of that
file's own report.

The ladder is a real conversion of a tiny Qwen3.5 (rows of 256, so the K-quant rules apply) with its
`mtp-` sidecars. Reports get distinct figures per file, so a figure in the wrong row fails the test; a report
whose recorded file is not the uploaded one (size, sha256, path) is refused; the fake Hub
(tests/fixtures/hub/server.py) receives every file once, and an interrupted upload rerun sends only what
is missing. `--verify` runs the real `specconv verify` on each file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from specconv.errors import SpecconvError
from specconv.hub.client import RetryPolicy, upload_plan
from specconv.hub.plan import build_plan
from specconv.hub.verified import run_verify_missing
from specconv.verify.report import file_identity
from tests.fixtures.cli import run_cli
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.hub.cards import table_rows
from tests.fixtures.hub.llamacpp_rules import lc_find_best_model, lc_find_best_sibling
from tests.fixtures.hub.server import WRITE_TOKEN, Fault, FakeHub
from tests.fixtures.kquant_files import write_qwen35
from tests.fixtures.hub.client import loopback_client

torch.set_num_threads(1)
pytestmark = pytest.mark.slow

FAST = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.01)
REPO = "me/Tiny-Ladder-GGUF"
QUANTS = ["Q8_0", "Q6_K", "Q4_K_M"]
# distinct figures per file: (max |Δlogit|, acceptance rate, acceptance length, measured speed-up, passed)
FIGURES = {"Q8_0": (1.25e-2, 0.812, 2.44, 1.71, True), "Q6_K": (4.5e-2, 0.733, 2.2, 1.52, True),
           "Q4_K_M": (0.375, 0.625, 1.88, 1.33, False)}


@pytest.fixture(autouse=True)
def hub_client_env(monkeypatch, tmp_path):
    loopback_client(monkeypatch, tmp_path)  # the loopback Hub; each test gives its token


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ladder")
    src = write_qwen35(root / "src", moe=False, n_layers=4)
    convert_gguf(src, root / "out" / "Tiny.gguf", outtype=",".join(QUANTS).lower(), mtp="separate")
    return root


@pytest.fixture
def ladder(converted, tmp_path) -> Path:
    """A private copy of the six files (model + mtp- sidecar per quant)."""
    out = tmp_path / "out"
    shutil.copytree(converted / "out", out)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{p}Tiny-{q}.gguf" for q in QUANTS for p in ("", "mtp-"))
    return out


@pytest.fixture
def hub():
    with FakeHub(lifetime=120) as server:
        yield server


def write_report(folder: Path, quant: str, *, where: Path | None = None, **changes) -> Path:
    """A `specconv verify --json` report of Tiny-{quant}.gguf with its sidecar, figures from FIGURES."""
    parity, rate, length, speedup, passed = FIGURES[quant]
    model, mtp = folder / f"Tiny-{quant}.gguf", folder / f"mtp-Tiny-{quant}.gguf"
    data = {"passed": passed, "model": str(model),
            "checks": [{"name": "greedy exact: mtp", "passed": passed, "detail": f"{quant} run"}],
            "parity": {"max_abs_logit_diff": parity, "reference": "transformers 5.23.0"},
            "speculative": {"exact": passed, "drafted": 300, "accepted": round(300 * rate),
                            "acceptance_rate": rate, "acceptance_length": length, "speedup": speedup,
                            "per_position": [rate, rate / 2]},
            "files": {"model": file_identity(model), "mtp": file_identity(mtp)}}
    for key, value in changes.items():
        data["files"]["model"][key] = value
    path = (where or folder.parent) / f"verify-{quant}.json"
    path.write_text(json.dumps(data))
    return path


def type_mix_of(path: Path) -> dict[str, float]:
    """Share of tensor bytes per type, read with gguf-py (independently of the upload's header scan)."""
    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_bytes)
    total = sum(counts.values())
    return {k: 100 * v / total for k, v in counts.items()}


def parse_mix(cell: str) -> dict[str, str]:
    return dict(part.rsplit(" ", 1) for part in cell.split(", "))


def test_ladder_card_has_one_row_per_file_with_the_figures_of_its_own_report(ladder):
    reports = [write_report(ladder, q) for q in QUANTS]
    plan = build_plan(ladder, repo_id=REPO, reports=reports, max_file_size=4_000_000)
    base = plan.artifacts[0].base
    names = {a.name: a for a in plan.artifacts}
    assert set(names) == {f"{p}{base}-{q}.gguf" for q in QUANTS for p in ("", "mtp-")}
    q8 = names[f"{base}-Q8_0.gguf"]  # 4.55 MB over the 4 MB limit: re-split into its folder
    assert q8.paths == [f"{base}-Q8_0/{base}-Q8_0-0000{i}-of-00002.gguf" for i in (1, 2)]

    # llama.cpp's -hf picks each quant's model and the mtp- sidecar of the same quant
    repo_files = [f.path_in_repo for f in plan.files]
    for q in QUANTS:
        model = lc_find_best_model(repo_files, q)
        assert model == names[f"{base}-{q}.gguf"].paths[0]
        assert lc_find_best_sibling(repo_files, model, "mtp-", q) == f"mtp-{base}-{q}.gguf"

    text = plan.readme.content.decode()
    rows = {r[0].strip("`"): r for r in table_rows(text, "| File |")}
    assert set(rows) == set(names)  # one row per file
    for q in QUANTS:
        parity, rate, length, speedup, passed = FIGURES[q]
        model = f"{base}-{q}.gguf"
        row = rows[model]
        print(q, row)
        assert row[1] == q and row[2] == f"{names[model].size / 1e6:.2f} MB"
        assert row[6] == (f"{parity:.3e}" if parity < 1e-3 else f"{parity:.3f}")
        assert row[7] == f"{rate:.3f} (length {length:.2f})"
        assert row[8] == f"{speedup:.2f}× measured"
        assert row[9] == ("passed" if passed else "FAILED")
        assert rows[f"mtp-{model}"][9] == f"with `{model}`" and rows[f"mtp-{model}"][6:9] == ["", "", ""]
        for name, path in ((model, ladder / f"Tiny-{q}.gguf"), (f"mtp-{model}", ladder / f"mtp-Tiny-{q}.gguf")):
            shown, actual = parse_mix(rows[name][5]), type_mix_of(path)
            assert set(shown) == set(actual)
            for t, share in actual.items():
                assert shown[t] == ("<1%" if share < 1 else f"{share:.0f}%"), (name, t)
        assert f"## Verification of `{model}`" in text
    assert parse_mix(rows[f"{base}-Q4_K_M.gguf"][5]).keys() >= {"Q4_K", "Q6_K"}  # the mix, not one type
    assert "not verified" not in text
    data = plan.to_dict()
    figures = {a["name"]: a["verify"] for a in data["artifacts"] if a["verify"]}
    assert figures[f"{base}-Q6_K.gguf"]["acceptance_rate"] == 0.733
    assert figures[f"{base}-Q6_K.gguf"]["report"].endswith("verify-Q6_K.json")


def test_a_file_without_a_report_is_not_verified(ladder):
    plan = build_plan(ladder, repo_id=REPO, reports=[write_report(ladder, "Q8_0"), write_report(ladder, "Q4_K_M")])
    base = plan.artifacts[0].base
    text = plan.readme.content.decode()
    rows = {r[0].strip("`"): r for r in table_rows(text, "| File |")}
    assert rows[f"{base}-Q6_K.gguf"][6:] == ["", "", "", "not verified"]
    assert rows[f"mtp-{base}-Q6_K.gguf"][9] == "not verified"
    assert f"## Verification of `{base}-Q6_K.gguf`" not in text
    assert rows[f"{base}-Q8_0.gguf"][7] == "0.812 (length 2.44)"


def test_reports_of_other_bytes_are_refused(ladder, tmp_path):
    def refused(*reports) -> str:
        with pytest.raises(SpecconvError) as info:
            build_plan(ladder, repo_id=REPO, reports=list(reports))
        message = str(info.value)
        print("refused:", message)
        assert "\n" not in message
        return message

    # Q8_0's report claiming to be of the Q6_K file: sizes differ
    report = write_report(ladder, "Q8_0")
    data = json.loads(report.read_text())
    data["files"]["model"]["path"] = data["model"] = str(ladder / "Tiny-Q6_K.gguf")
    report.write_text(json.dumps(data))
    assert "Tiny-Q6_K.gguf is " in refused(report) and "other bytes" in refused(report)

    # same size, other bytes (the file was rewritten after verify ran)
    message = refused(write_report(ladder, "Q6_K", sha256="0" * 64))
    assert "sha256 000000000000" in message and "Tiny-Q6_K.gguf" in message

    # a file that is not part of the upload
    ghost = write_report(ladder, "Q4_K_M")
    data = json.loads(ghost.read_text())
    data["files"]["model"]["path"] = data["model"] = str(tmp_path / "elsewhere" / "Tiny-Q5_K_M.gguf")
    ghost.write_text(json.dumps(data))
    assert "Tiny-Q5_K_M.gguf, which is not among the model files" in refused(ghost)

    # the sidecar verified with the model is not the one uploaded
    bad_mtp = write_report(ladder, "Q8_0")
    data = json.loads(bad_mtp.read_text())
    data["files"]["mtp"]["size"] += 1
    bad_mtp.write_text(json.dumps(data))
    assert "mtp-Tiny-Q8_0.gguf is " in refused(bad_mtp)

    # two reports of one file; a report naming no file among several
    (tmp_path / "again").mkdir()
    assert "both verify Tiny-Q8_0.gguf" in refused(write_report(ladder, "Q8_0"),
                                                   write_report(ladder, "Q8_0", where=tmp_path / "again"))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"passed": True}))
    assert "does not say which file it verified" in refused(bare)


def test_reports_follow_files_that_were_moved(ladder, tmp_path):
    """Verify ran in one folder, the upload reads another: matched by name, then by size and sha256."""
    reports = [write_report(ladder, q) for q in QUANTS]
    moved = tmp_path / "publish"
    shutil.move(ladder, moved)
    plan = build_plan(moved, repo_id=REPO, reports=reports)
    assert all(a.report is not None for a in plan.artifacts if not a.role.is_draft)
    data = bytearray((moved / "Tiny-Q6_K.gguf").read_bytes())
    data[-100] ^= 1  # one bit of tensor data: same size, other bytes
    (moved / "Tiny-Q6_K.gguf").write_bytes(bytes(data))
    with pytest.raises(SpecconvError, match=r"Tiny-Q6_K.gguf has sha256 .*other bytes"):
        build_plan(moved, repo_id=REPO, reports=reports)


def test_every_file_is_uploaded_once_and_a_rerun_sends_only_what_is_missing(ladder, hub):
    reports = [write_report(ladder, q) for q in QUANTS]
    plan = build_plan(ladder, repo_id=REPO, reports=reports)
    paths = [f.path_in_repo for f in plan.files]
    assert len(paths) == 7 and paths[-1] == "README.md"
    hub.faults.append(Fault("POST", r"/commit/", status=500, times=99, after=3, message="storage unavailable"))
    with pytest.raises(SpecconvError, match="rerun the same command to resume"):
        upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    assert set(hub.files(REPO)) == {".gitattributes", *paths[:3]}
    hub.faults.clear()
    puts = list(hub.puts)

    mark = len(hub.requests)
    plan = build_plan(ladder, repo_id=REPO, reports=reports)
    result = upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    assert result.skipped == paths[:3] and result.uploaded == paths[3:]
    assert sum(1 for _, p in hub.requests[mark:] if "/commit/" in p) == 4
    new_puts = hub.puts[len(puts):]
    sent_before = {hashlib.sha256((f.local_path).read_bytes()).hexdigest() for f in plan.files[:3]}
    assert not sent_before & set(new_puts)  # nothing committed before is sent again
    assert len(hub.puts) == len(set(hub.puts)) == 6  # each model file's content sent once in all

    files = hub.files(REPO)
    assert set(files) == {".gitattributes", *paths}
    for f in plan.files[:-1]:
        assert hub.content(REPO, f.path_in_repo) == f.local_path.read_bytes()
    assert hub.content(REPO, "README.md") == plan.readme.content
    messages = list(hub.repos[REPO].messages.values())
    assert sorted(messages) == sorted(f"Upload {p} with specconv" for p in paths)  # one commit per file

    again = upload_plan(build_plan(ladder, repo_id=REPO, reports=reports), token=WRITE_TOKEN, endpoint=hub.url,
                        retry=FAST)
    assert again.uploaded == [] and again.skipped == paths


def test_cli_takes_ladder_files_with_their_sidecars_and_reports(ladder, hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    r8, r4 = write_report(ladder, "Q8_0"), write_report(ladder, "Q4_K_M")
    args = ["upload", str(ladder / "Tiny-Q8_0.gguf"), str(ladder / "Tiny-Q4_K_M.gguf"), "--repo", REPO,
            "--report", str(r8), "--verify-report", str(r4)]
    code, out, err = run_cli(capsys, *args, "--dry-run", "--json")
    assert code == 0, err
    data = json.loads(out)
    sources = sorted(Path(s).name for a in data["artifacts"] for s in a["sources"])
    assert sources == ["Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf", "mtp-Tiny-Q4_K_M.gguf", "mtp-Tiny-Q8_0.gguf"]
    verify = {a["quant"]: a["verify"] for a in data["artifacts"] if a["verify"]}
    assert verify["Q8_0"]["max_abs_logit_diff"] == 1.25e-2 and verify["Q4_K_M"]["speedup"] == 1.33
    assert verify["Q4_K_M"]["passed"] is False
    assert "| Q6_K |" not in data["readme"]
    assert hub.requests == []

    code, out, err = run_cli(capsys, *args, "--json", "--retry-delay", "0.001")
    assert code == 0, err
    assert len(json.loads(out)["uploaded"]) == 5
    assert {p for p in hub.files(REPO) if p.endswith(".gguf")} == {
        a["files"][0]["path_in_repo"] for a in data["artifacts"]}

    code, out, err = run_cli(capsys, "upload", str(ladder), "--repo", REPO, "--hf", str(ladder), "--dry-run")
    assert code == 2 and "--hf is for --verify" in err


def test_verify_runs_on_each_file_with_its_sidecar_and_is_reused(ladder, monkeypatch):
    plan = build_plan(ladder, repo_id=REPO)
    reports = run_verify_missing(plan.artifacts, plan.staging_dir, n_predict=4, device="cpu")
    assert len(reports) == 3
    for r in reports:
        model = Path(r.files["model"]["path"]).name
        assert r.files["mtp"]["path"] == str((ladder / f"mtp-{model}").resolve())
        assert r.speculative["acceptance_rate"] is not None
    plan = build_plan(ladder, repo_id=REPO, reports=reports)
    rows = {r[0].strip("`"): r for r in table_rows(plan.readme.content.decode(), "| File |")}
    for a in plan.artifacts:
        if a.role.is_draft:
            continue
        spec = a.report.speculative
        print(a.name, "acceptance", spec["acceptance_rate"], "speed-up", spec["speedup"], "passed", a.report.passed)
        assert Path(a.report.files["model"]["path"]) == a.sources[0].resolve()
        assert rows[a.name][7].startswith(f"{spec['acceptance_rate']:.3f}")
        assert rows[a.name][8].startswith(f"{spec['speedup']:.2f}× measured")
        assert rows[a.name][9] == ("passed" if a.report.passed else "FAILED")

    import specconv.verify as verify_module

    def never(*args, **kwargs):
        raise AssertionError("verify ran again")

    monkeypatch.setattr(verify_module, "run_verify", never)
    again = run_verify_missing(build_plan(ladder, repo_id=REPO).artifacts, plan.staging_dir, n_predict=4)
    assert [r.speculative for r in again] == [r.speculative for r in reports]


def test_cli_verify_then_upload_carries_the_figures_of_the_run(ladder, hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    r8 = write_report(ladder, "Q8_0")
    args = ["upload", str(ladder / "Tiny-Q8_0.gguf"), str(ladder / "Tiny-Q4_K_M.gguf"), "--repo", REPO,
            "--report", str(r8), "--verify", "--json", "--retry-delay", "0.001"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    cached = list((ladder / ".specconv-upload" / "verify").glob("*.json"))
    assert [p.name for p in cached] == [p.name for p in cached if "Q4_K_M" in p.name] and len(cached) == 1
    run = json.loads(cached[0].read_text())["report"]
    assert run["files"]["model"]["path"] == str((ladder / "Tiny-Q4_K_M.gguf").resolve())
    card = hub.content(REPO, "README.md").decode()
    rows = {r[0].strip("`"): r for r in table_rows(card, "| File |")}
    q4 = next(r for name, r in rows.items() if name.endswith("-Q4_K_M.gguf") and not name.startswith("mtp-"))
    q8 = next(r for name, r in rows.items() if name.endswith("-Q8_0.gguf") and not name.startswith("mtp-"))
    print("verified on upload:", q4[6:])
    assert q4[7].startswith(f"{run['speculative']['acceptance_rate']:.3f}")
    assert q4[8].startswith(f"{run['speculative']['speedup']:.2f}× measured")
    assert q4[9] == ("passed" if run["passed"] else "FAILED")
    assert q8[7] == "0.812 (length 2.44)"  # the given report, not a run
    assert len(json.loads(out)["uploaded"]) == 5

    # a rerun reuses the kept report: same card, nothing sent
    capsys.readouterr()
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert out, err
    assert json.loads(out)["uploaded"] == [] and hub.content(REPO, "README.md").decode() == card


@pytest.mark.peer
def test_each_quant_fetched_as_llama_cpp_resolves_it_loads_with_its_sidecar(ladder, hub, tmp_path):
    """From the files the Hub holds: llama.cpp's `-hf REPO:QUANT` choice (model, shard 1 of the re-split
    Q8_0, and the mtp- sidecar of the quant) loads, builds the MTP context, and gives the local file's logits."""
    import numpy as np
    from tests.fixtures.peers import llama_logits, llama_mtp_context_ok, require_llama_cpp

    require_llama_cpp()
    plan = build_plan(ladder, repo_id=REPO, reports=[write_report(ladder, q) for q in QUANTS], max_file_size=4_000_000)
    upload_plan(plan, token=WRITE_TOKEN, endpoint=hub.url, retry=FAST)
    files = sorted(hub.files(REPO))
    ids = [1, 300, 17, 42, 301, 250, 99, 305]
    for q in QUANTS:
        model = lc_find_best_model(files, q)
        sidecar = lc_find_best_sibling(files, model, "mtp-", q)
        local = tmp_path / "hf" / q
        local.mkdir(parents=True)
        wanted = [model, sidecar]
        if "-00001-of-" in model:  # llama.cpp collects the other shards by the pattern
            wanted += [f for f in files if f.startswith(model.rsplit("/", 1)[0] + "/") and f != model]
        for f in wanted:
            (local / f.rsplit("/", 1)[-1]).write_bytes(hub.content(REPO, f))
        got = local / model.rsplit("/", 1)[-1]
        assert llama_mtp_context_ok(got, local / sidecar.rsplit("/", 1)[-1])
        hub_logits = llama_logits(got, ids)
        assert np.isfinite(hub_logits).all() and np.std(hub_logits) > 1e-3  # a real forward
        diff = float(np.max(np.abs(hub_logits - llama_logits(ladder / f"Tiny-{q}.gguf", ids))))
        print(f"{q}: -hf picks {model} + {sidecar}; llama.cpp logits, Hub vs local file: max |dlogit| = {diff}")
        assert diff == 0.0
