"""Tables at 80 columns without a terminal: `demo`, `verify`, `upload --dry-run`, `inspect` and
`convert --dry-run` piped to a file (COLUMNS=80, stdout not a TTY).

Evidence:
* no output line is wider than 80 columns (except a single name longer than 80, which stays whole);
* every file name, tensor name and metadata key appears whole on one line (a path longer than a line
  may break after a `/`, its file name whole);
* every word of every cell is present (nothing cut), checked against the command's `--json` output;
* `specconv.tables` keeps the table layout when it fits, shares the width without splitting words
  when the natural widths do not fit, and stacks rows otherwise.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
from rich.cells import cell_len
from rich.console import Console

from specconv.tables import Col, layout, print_table
from tests.fixtures.paths import ROOT

WIDTH = 80
LONG = "Qwen3.5-Tiny-Long-Name-Instruct-Preview"


def piped(*args: str, columns: int = WIDTH, merge: bool = True) -> tuple[int, str]:
    """`python -m specconv ARGS` with stdout (and stderr) redirected to a file, as in a CI log."""
    env = {**os.environ, "COLUMNS": str(columns), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("FORCE_COLOR", None)
    env.pop("TTY_COMPATIBLE", None)
    proc = subprocess.run([sys.executable, "-m", "specconv", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.DEVNULL,
                          text=True, timeout=600)
    return proc.returncode, proc.stdout


def json_of(*args: str) -> dict:
    code, out = piped(*args, "--json", merge=False)
    assert code == 0, out
    return json.loads(out)


def words(text: str) -> set[str]:
    return set(re.split(r"[\s│┃┏┓┗┛┡┩━─┳┻╇╈┼┤├┬┴└┘┌┐╭╮╰╯]+", text))


def lines_of(text: str) -> list[str]:
    return [line.rstrip() for line in text.split("\n")]


def check_width(text: str, width: int = WIDTH) -> None:
    long = [line for line in lines_of(text) if cell_len(line) > width and len(line.split()) > 1]
    print(f"{len(lines_of(text))} lines, widest {max(cell_len(line) for line in lines_of(text))} columns")
    assert not long, "lines wider than the terminal:\n" + "\n".join(long)


def joined_paths(text: str) -> str:
    """The output with paths that were broken after a `/` joined again (one per line)."""
    return re.sub(r"/\n(?=\S)", "/", "\n".join(lines_of(text)))


def check_whole(text: str, names) -> None:
    lines = lines_of(joined_paths(text))
    missing = [n for n in names if not any(n in line for line in lines)]
    assert not missing, f"names not whole on one line: {missing}"
    for n in names:  # a file name is never split, even where its path is
        base = n.rsplit("/", 1)[-1]
        assert any(base in line for line in lines_of(text)), base


def check_cells(text: str, cells) -> None:
    have = words(joined_paths(text))
    absent = sorted({w for c in cells for w in str(c).split() if w not in have})
    assert not absent, f"cell text missing: {absent[:20]}"


# ---------------------------------------------------------------------------------------- layouts


def render(width: int, cols, rows, title=None) -> tuple[str, str]:
    console = Console(file=io.StringIO(), width=width, record=True)
    kind = print_table(console, cols, rows, title=title)
    return kind, console.export_text()


FILES = [["Qwen3.5-9B-Q8_0/Qwen3.5-9B-Q8_0-00001-of-00003.gguf", "12.3 GB", "Q8_0", "trunk only", "split 1/3 of a.gguf"],
         ["mtp-Qwen3.5-9B-Q8_0.gguf", "1.2 GB", "Q8_0", "MTP sidecar", "mtp-Qwen3.5-9B-Q8_0.gguf"]]
FILE_COLS = [Col("path", whole=True), Col("size", "right"), Col("quant"), Col("role"), Col("from")]


@pytest.mark.parametrize("width,expected", [(200, "table"), (80, "stacked"), (30, "stacked")])
def test_layout_by_width(width, expected):
    kind, text = render(width, FILE_COLS, FILES, title="plan")
    print(f"width {width}: {kind}\n{text}")
    assert kind == expected
    if width >= 80:
        check_width(text, width)
    check_whole(text, [r[0] for r in FILES])
    check_cells(text, [c for r in FILES for c in r])


def test_shared_widths_wrap_only_at_spaces():
    cols = [Col("check"), Col("result"), Col("detail")]
    detail = "the sidecar's KV equals the trunk's apart from block_count, and its tokenizer round-trips " * 2
    rows = [["structure", "pass", detail], ["parity: MTP head vs transformers MtpModel", "FAIL", "max 3.2e-01"]]
    widths = layout(80, cols, [[__import__("rich.text", fromlist=["Text"]).Text(c) for c in r] for r in rows])
    assert widths is not None and sum(widths) + 3 * 3 + 1 <= 80
    kind, text = render(80, cols, rows, title="specconv verify x.gguf")
    print(text)
    assert kind == "table"
    check_width(text)
    check_cells(text, [c for r in rows for c in r])


def test_without_a_box_when_only_the_rules_do_not_fit():
    from specconv.tables import TENSOR_COLUMNS

    note = "F32 rule (1-D, norm, router, conv, non-weight)"
    rows = [["blk.0.ffn_gate_inp_shexp.weight", "F32", "[64, 1]", "256 B", note],
            ["blk.4.nextn.shared_head_norm.weight", "F32", "[64]", "256 B", note],
            ["output.weight", "Q8_0", "[64, 512]", "34.0 KiB", ""]]
    kind, text = render(80, TENSOR_COLUMNS + [Col("note")], rows, title="x.gguf: tensors")
    print(text)
    assert kind == "plain table" and "┃" not in text and "│" not in text
    check_width(text)
    check_whole(text, [r[0] for r in rows] + [r[2] for r in rows])
    check_cells(text, [c for r in rows for c in r])


def test_a_single_overlong_name_stays_whole():
    name = "x" * 100 + ".gguf"
    kind, text = render(80, FILE_COLS, [[name, "1 kB", "F32", "trunk only", "here"]])
    assert kind == "stacked" and name in text


# ------------------------------------------------------------------------------------ commands


def test_upload_dry_run_piped_at_80(tmp_path):
    from tests.fixtures.hub.ggufs import write_tiny_gguf

    folder = tmp_path / "out"
    folder.mkdir()
    write_tiny_gguf(folder / "model.gguf", "trunk", seed=1, basename=LONG)
    write_tiny_gguf(folder / "mtp.gguf", "sidecar", seed=2, basename=LONG)
    for extra in ([], ["--max-file-size", "60K"]):  # whole files; a re-split into a folder of shards
        args = ["upload", str(folder), "--repo", f"someone/{LONG}-GGUF", "--dry-run", *extra]
        code, text = piped(*args)
        print(text)
        assert code == 0, text
        plan = json_of(*args)
        paths = [f["path_in_repo"] for a in plan["artifacts"] for f in a["files"]]
        assert len(paths) == (3 if extra else 2) and all(LONG in p for p in paths)
        check_width(text)
        check_whole(text, paths + ["README.md"])
        check_cells(text, ["model.gguf", "mtp.gguf", "trunk only", "MTP sidecar", "model card", "Q8_0"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    return build_qwen35(tmp_path_factory.mktemp("tables80") / "hf", moe=True)


def test_convert_dry_run_piped_at_80(checkpoint, tmp_path):
    out = tmp_path / f"{LONG}-Q8_0.gguf"
    args = ["convert", str(checkpoint), "-o", str(out), "--outtype", "q8_0", "--mtp", "separate", "--dry-run"]
    code, text = piped(*args)
    print(text[:3000])
    assert code == 0, text
    summary = json_of(*args)
    tensors = [t for f in summary["files"] for t in f["tensors"]]
    keys = [k for f in summary["files"] for k in f["metadata"]]
    check_width(text)
    check_whole(text, [f["path"] for f in summary["files"]] + [t["name"] for t in tensors] + keys)
    check_whole(text, {str(t["shape"]) for t in tensors})
    check_cells(text, [t["type"] for t in tensors] + [t.get("note", "") for t in tensors])


def test_inspect_piped_at_80(checkpoint, tmp_path):
    from tests.fixtures.gguf_files import convert_gguf

    path = convert_gguf(checkpoint, tmp_path / f"{LONG}-Q8_0.gguf", outtype="q8_0", mtp="embed")
    code, text = piped("inspect", str(path), "--all-tensors")
    print(text[:3000])
    assert code == 0, text
    info = json_of("inspect", str(path))
    check_width(text)
    keys = list(info["general"]) + [f"{info['arch']}.{k}" for k in info["hparams"]] + list(info["tokenizer"])
    check_whole(text, [path.name] + [t["name"] for t in info["tensors"]] + keys + [str(t["shape"]) for t in info["tensors"]])
    check_cells(text, [json.dumps(v) for v in info["hparams"].values()])


def test_verify_report_at_80():
    from specconv.verify.report import Check, Report

    report = Report(model=f"/models/{LONG}-Q8_0.gguf")
    report.checks = [Check("structure: block_count and nextn_predict_layers", True,
                           "block_count 5 = 4 trunk + 1 MTP; every tensor of the qwen35 table present with its "
                           "shape; sidecar KV equal to the trunk's"),
                     Check(f"sidecar mtp-{LONG}-Q8_0.gguf", False, "tokenizer differs at id 17")]
    console = Console(file=io.StringIO(), width=WIDTH, record=True)
    report.render(console)
    text = console.export_text()
    print(text)
    check_width(text)
    check_cells(text, [w for c in report.checks for w in (c.name, c.detail)])


@pytest.mark.skipif(not (ROOT / "specconv" / "data" / "tiny-qwen35-mtp").exists(), reason="bundled model absent")
def test_demo_and_verify_piped_at_80(tmp_path):
    out = tmp_path / "demo"
    code, text = piped("demo", "--out", str(out), "-n", "8", "--draft-max", "2", "--prompts", "1", "--repeats", "1")
    print(text)
    assert code == 0, text
    check_width(text)
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 3
    check_whole(text, names)
    check_cells(text, ["draft_max:", "speed-up:", "PASSED", "trunk + MTP head in one file", "MTP head only (mtp- sidecar)"])

    # `verify` on the converted file, piped the same way; its checks against its own JSON report.
    sidecar = next(n for n in names if n.startswith("mtp-"))  # mtp- + its trunk's name
    embedded = next(n for n in names if not n.startswith("mtp-") and n != sidecar.removeprefix("mtp-"))
    report_path = tmp_path / "report.json"
    code, text = piped("verify", str(out / embedded), "-n", "8", "--draft-max", "2", "--report", str(report_path))
    print(text)
    assert code == 0, text
    report = json.loads(report_path.read_text())
    check_width(text)
    check_whole(text, [embedded])
    check_cells(text, [w for c in report["checks"] for w in (c["name"], c["detail"])])
