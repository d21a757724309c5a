"""`specconv upload --compare REPORT.json`: the card's "Quality against the source" table from a real
`specconv compare --json` run on a ladder of the bundled tiny Qwen3.5 (F32, Q8_0 and Q4_K_M, each with its
mtp- sidecar), uploaded to the loopback fake Hub (tests/fixtures/hub/server.py).

Every figure in a row must be the report's figure of that very file (formatted as the card prints it);
bits per weight are recomputed here from gguf-py's reading of each file; a report of other bytes (size or
sha256) is refused in one line, before anything is sent.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specconv.demo.bundled import bundled_model_dir, heldout_files
from specconv.hub.naming import human_size
from tests.fixtures.cli import run_cli
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.hub.cards import table_rows
from tests.fixtures.hub.server import WRITE_TOKEN, FakeHub
from tests.fixtures.hub.client import loopback_client

torch.set_num_threads(1)
pytestmark = pytest.mark.slow

REPO = "me/Tiny-Quality-GGUF"
CTX = 64
N_CHUNKS = 2
K = 2
QUANTS = ["Q8_0", "Q4_K_M"]
HEADER = "| File | Quant type | Size | Bits per weight |"


@pytest.fixture(autouse=True)
def hub_client_env(monkeypatch, tmp_path):
    loopback_client(monkeypatch, tmp_path)  # the loopback Hub; each test gives its token
    monkeypatch.setenv("COLUMNS", "250")


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """The converted ladder and the `specconv compare --json` report of Q8_0 and Q4_K_M against F32."""
    root = tmp_path_factory.mktemp("quality")
    src = bundled_model_dir()
    out = root / "out"
    convert_gguf(src, out / "Tiny.gguf", outtype="f32,q8_0,q4_k_m", mtp="separate")
    names = sorted(p.name for p in out.iterdir())
    model = {q: next(out / n for n in names if n.endswith(f"-{q}.gguf") and not n.startswith("mtp-"))
             for q in ["F32", *QUANTS]}
    text = heldout_files(src)
    if not text:
        pytest.skip("the held-out stdlib files of the bundled model are not on this interpreter")
    (root / "text.txt").write_text(text[0].read_text(encoding="utf-8")[:6000], encoding="utf-8")
    from specconv.cli import main

    args = ["compare", str(model["F32"]), str(model["Q8_0"]), str(model["Q4_K_M"]),
            "--source-mtp", str(out / f"mtp-{model['F32'].name}"), "--text", str(root / "text.txt"),
            "--ctx", str(CTX), "--chunks", str(N_CHUNKS), "--draft-max", str(K), "--device", "cpu", "--json"]
    capture = root / "report.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main(args)
        except SystemExit as exc:
            assert exc.code in (0, None), f"specconv compare failed ({exc.code})"
    report = json.loads(buf.getvalue())
    capture.write_text(json.dumps(report), encoding="utf-8")
    return {"root": root, "out": out, "model": model, "report": capture, "data": report}


@pytest.fixture
def hub():
    with FakeHub(lifetime=120) as server:
        yield server


def gguf_bits_per_weight(path: Path) -> float:
    reader = gguf.GGUFReader(path)
    n_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    n_params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    return 8.0 * n_bytes / n_params


def head_cells(own: dict | None, k: int) -> list[str]:
    """Acceptance at positions 1..k and the predicted speed-up of one head, as the card prints them."""
    own = own or {}
    speed = (own.get("speedup") or {}).get("at_draft_max")
    return [*(f"{r:.3f}" for r in (own.get("per_position") or [])[:k]), f"{speed:.2f}×" if speed is not None else "n/a"]


def expected_cells(entry: dict, k: int) -> list[str]:
    return [f"{entry['kld']['mean']:.6f}", f"{entry['kld']['99.0%']:.6f}", f"{100 * entry['same_top_p']['value']:.2f} %",
            f"{entry['ppl_ratio']['value']:.4f}", *head_cells(entry["mtp"]["own_head"], k)]


def upload(ladder, hub, monkeypatch, capsys, report: Path):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    return run_cli(capsys, "upload", str(ladder["out"]), "--repo", REPO, "--compare", str(report))


def test_card_rows_carry_the_compare_figures(ladder, hub, monkeypatch, capsys):
    data = ladder["data"]
    code, _, err = upload(ladder, hub, monkeypatch, capsys, ladder["report"])
    assert code == 0, err
    card = hub.content(REPO, "README.md").decode()
    print(card[card.index("## Quality"):card.index("## How to run")])
    rows = table_rows(card, HEADER)
    # the repository names each quant's file {Base}-{QUANT}.gguf; the report names the local files
    assert sorted(r[1] for r in rows) == sorted(["F32", *QUANTS])  # the source's row and one per quant
    by_quant = {r[1]: r for r in rows}
    entries = {Path(q["path"]).name: q for q in data["quants"]}
    for quant, path in ladder["model"].items():
        row = by_quant[quant]
        assert row[0].strip("`").endswith(f"-{quant}.gguf")
        bpw = gguf_bits_per_weight(path)
        print(f"{path.name}: {bpw:.4f} bits per weight (gguf-py)")
        assert row[2:4] == [human_size(path.stat().st_size), f"{bpw:.2f}"]
        if quant == "F32":  # the reference: its own head's acceptance, the one the quants' are read against
            assert row[4:8] == ["source"] * 4
            assert row[8:] == head_cells(data["source"]["mtp"], K)
            continue
        entry = entries[path.name]
        assert row[4:] == expected_cells(entry, K)
        assert len(entry["mtp"]["own_head"]["per_position"]) == K  # every position measured, none invented
    assert f"against `{by_quant['F32'][0].strip('`')}` (F32)" in card
    assert f"on {N_CHUNKS} chunks of {CTX} tokens of a {data['text']['tokens']}-token text" in card
    # the figures differ per file, so a row carrying another file's figures would fail above
    assert expected_cells(entries[ladder["model"]["Q8_0"].name], K) != expected_cells(
        entries[ladder["model"]["Q4_K_M"].name], K)


def test_report_of_other_bytes_refused(ladder, hub, monkeypatch, capsys, tmp_path):
    data = json.loads(ladder["report"].read_text())
    name = Path(data["quants"][1]["path"]).name
    data["quants"][1]["size_bytes"] += 1
    bad = tmp_path / "other-size.json"
    bad.write_text(json.dumps(data))
    code, _, err = upload(ladder, hub, monkeypatch, capsys, bad)
    assert code != 0 and "the report is of other bytes" in err and name in err
    assert len(err.strip().splitlines()) == 1, err
    assert hub.requests == []

    data = json.loads(ladder["report"].read_text())
    data["quants"][0]["sha256"] = "0" * 64
    bad.write_text(json.dumps(data))
    code, _, err = upload(ladder, hub, monkeypatch, capsys, bad)
    assert code != 0 and "sha256 000000000000" in err and "the report is of other bytes" in err
    assert hub.requests == []


def test_sha256_recorded_and_equal_is_accepted(ladder, tmp_path):
    from specconv.digest import sha256_file
    from specconv.hub.plan import build_plan

    data = json.loads(ladder["report"].read_text())
    assert all(q["sha256"] == sha256_file(q["path"]).hex() for q in data["quants"])  # compare records them
    plan = build_plan(ladder["out"], repo_id=REPO, compares=[ladder["report"]])
    card = plan.readme.content.decode()
    assert len(table_rows(card, HEADER)) == 3


def test_same_size_other_bytes_is_refused(ladder, tmp_path):
    """A file changed in place after compare measured it (same size, other bytes) is not its report's file."""
    from specconv.hub.plan import build_plan
    from specconv.errors import SpecconvError

    out = tmp_path / "changed"
    shutil.copytree(ladder["out"], out)
    q4 = out / ladder["model"]["Q4_K_M"].name
    raw = bytearray(q4.read_bytes())
    raw[-1] ^= 0xFF
    q4.write_bytes(bytes(raw))
    data = json.loads(ladder["report"].read_text())
    for q in data["quants"]:
        q["path"] = str(out / Path(q["path"]).name)
    report = tmp_path / "report.json"
    report.write_text(json.dumps(data))
    with pytest.raises(SpecconvError, match="the report is of other bytes"):
        build_plan(out, repo_id=REPO, compares=[report])


def test_quant_not_uploaded_is_left_out_with_a_warning(ladder, tmp_path):
    from specconv.hub.plan import build_plan

    only = tmp_path / "only"
    only.mkdir()
    q8 = ladder["model"]["Q8_0"]
    for p in (q8, q8.parent / f"mtp-{q8.name}"):
        shutil.copy(p, only / p.name)
    plan = build_plan(only, repo_id=REPO, compares=[ladder["report"]])
    rows = table_rows(plan.readme.content.decode(), HEADER)
    assert [r[1] for r in rows] == ["Q8_0"]
    assert any(ladder["model"]["Q4_K_M"].name in w and "left out" in w for w in plan.warnings)
