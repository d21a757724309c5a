"""Output folders of `convert`, `quantize` and `mtp extract` / `mtp merge` (specconv/commands/outputs.py).

Evidence:
* an output whose folder does not exist fails with one line naming the missing folder, exit 2, and
  creates nothing (a mistyped path never grows folders);
* `-o DIR/` names a folder to write into: created when its parent exists, refused when not;
* `--mkdir` creates the missing folders at any depth;
* a folder that cannot be created (under /sys, or below a file) or written (/sys) ends in the same
  one-line exit-2 error, never `error: PermissionError: ...` with exit 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.cli import run_cli



@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("outputs")
    src = build_qwen35(root / "hf")
    return {"src": src, "embedded": convert_gguf(src, root / "in" / "e.gguf", mtp="embed"),
            "trunk": convert_gguf(src, root / "in" / "t.gguf", mtp="separate")}


def runs(inputs, out: Path) -> dict[str, list]:
    """Each command writing `out` (a .gguf path, or a folder when it ends in /)."""
    return {"convert": ["convert", inputs["src"], "-o", out],
            "quantize": ["quantize", inputs["embedded"], out, "Q4_K_M"],
            "mtp extract": ["mtp", "extract", inputs["embedded"], "-o", out],
            "mtp merge": ["mtp", "merge", inputs["trunk"], inputs["trunk"].with_name("mtp-t.gguf"), "-o", out]}


def one_line_error(capsys, argv) -> str:
    code, _, err = run_cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    print(f"{' '.join(map(str, argv[:2]))}: exit {code}: {lines[-1:]}")
    errors = [line for line in lines if line.startswith("error")]  # the plan and progress lines may precede it
    assert code == 2 and errors == lines[-1:] and "Traceback" not in err, err
    assert "Error:" not in errors[0] and "Errno" not in errors[0], err
    return errors[0]


@pytest.mark.parametrize("what", ["convert", "quantize", "mtp extract", "mtp merge"])
def test_missing_folder_is_an_error_and_mkdir_creates_it(inputs, tmp_path, capsys, what):
    out = tmp_path / "typo" / "deeper" / "m.gguf"
    line = one_line_error(capsys, runs(inputs, out)[what])
    assert f"the folder {tmp_path / 'typo'} does not exist" in line and "--mkdir" in line
    assert list(tmp_path.iterdir()) == []
    code, _, err = run_cli(capsys, *runs(inputs, out)[what], "--mkdir")
    assert code == 0, err
    assert out.is_file() and out.read_bytes()[:4] == b"GGUF"


def test_folder_target_is_created_only_inside_an_existing_folder(inputs, tmp_path, capsys):
    code, out, err = run_cli(capsys, "convert", inputs["src"], "-o", f"{tmp_path / 'new'}/")
    assert code == 0, err
    assert [p.suffix for p in (tmp_path / "new").iterdir()] == [".gguf"]
    line = one_line_error(capsys, ["convert", inputs["src"], "-o", f"{tmp_path / 'no' / 'new'}/"])
    assert f"the folder {tmp_path / 'no'} does not exist" in line and not (tmp_path / "no").exists()
    code, _, err = run_cli(capsys, "convert", inputs["src"], "-o", f"{tmp_path / 'no' / 'new'}/", "--mkdir")
    assert code == 0 and any((tmp_path / "no" / "new").iterdir()), err


def test_dry_run_checks_the_folder_and_creates_nothing(inputs, tmp_path, capsys):
    one_line_error(capsys, ["convert", inputs["src"], "-o", tmp_path / "typo" / "m.gguf", "--dry-run"])
    code, _, err = run_cli(capsys, "convert", inputs["src"], "-o", tmp_path / "typo" / "m.gguf", "--dry-run", "--mkdir")
    assert code == 0 and not (tmp_path / "typo").exists(), err


@pytest.mark.parametrize("what", ["convert", "quantize", "mtp extract", "mtp merge"])
def test_a_file_in_the_way(inputs, tmp_path, capsys, what):
    (tmp_path / "f").write_text("a file, not a folder")
    line = one_line_error(capsys, runs(inputs, tmp_path / "f" / "m.gguf")[what])
    assert "f is a file, not a folder" in line
    line = one_line_error(capsys, [*runs(inputs, tmp_path / "f" / "sub" / "m.gguf")[what], "--mkdir"])
    assert f"cannot create folder {tmp_path / 'f' / 'sub'}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


SYS = Path("/sys")


def _sys_refuses() -> bool:
    try:
        (SYS / "specconv-probe").mkdir()
    except OSError:
        return True
    (SYS / "specconv-probe").rmdir()
    return False


@pytest.mark.skipif(not SYS.is_dir() or not _sys_refuses(), reason="needs a folder nobody may write (/sys)")
@pytest.mark.parametrize("what", ["convert", "quantize", "mtp extract", "mtp merge"])
def test_folders_that_cannot_be_created_or_written(inputs, capsys, what):
    line = one_line_error(capsys, [*runs(inputs, SYS / "specconv-x" / "m.gguf")[what], "--mkdir"])
    assert f"cannot create folder {SYS / 'specconv-x'}" in line
    line = one_line_error(capsys, runs(inputs, SYS / "m.gguf")[what])
    assert "cannot write m.gguf" in line
