"""The examples at the top of docs/generate.md, docs/quantize.md and docs/demo.md, run as written
(in a fresh folder where `specconv/data` is the repository's), and what each page says of them.

Evidence:
* every command line of each page's first bash block exits 0;
* generate: the speculative run prints the plain run's text; its --json carries the rates and
  weight_bytes_read the page lists, and the sampled run its temperature and seed;
* quantize: the files the page names exist (`quantize IN DIR/ TYPE` names them by convert's scheme),
  its --json has the keys the page lists, and inspect reads the result;
* demo: the kept folder holds convert's three names, and the --json report passed.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from specconv.cli import main
from tests.fixtures.paths import ROOT

BUNDLED = ROOT / "specconv" / "data" / "tiny-qwen35-mtp"
pytestmark = pytest.mark.skipif(not BUNDLED.exists(), reason="bundled model absent")


def doc_commands(page: str) -> list[list[str]]:
    """argv after `specconv` of every command line in the page's first bash block."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    commands = []
    for line in block.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            words = shlex.split(line, comments=True)
            assert words[0] == "specconv", line
            commands.append(words[1:])
    return commands


def run_page(page: str, tmp_path, monkeypatch, capsys) -> list[tuple[list[str], str, str]]:
    (tmp_path / "specconv").mkdir()
    (tmp_path / "specconv" / "data").symlink_to(ROOT / "specconv" / "data")
    monkeypatch.chdir(tmp_path)
    results = []
    for argv in doc_commands(page):
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            main(argv)
            raise SystemExit(0)
        out, err = capsys.readouterr()
        with capsys.disabled():
            print(f"$ specconv {shlex.join(argv)}  -> exit {info.value.code}")
        assert info.value.code in (0, None), err
        results.append((argv, out, err))
    return results


def test_generate_page(tmp_path, monkeypatch, capsys):
    runs = run_page("generate.md", tmp_path, monkeypatch, capsys)
    assert [r[0][0] for r in runs] == ["convert", "generate", "generate", "generate", "generate"]
    (_, plain, _), (_, spec, spec_err) = runs[1], runs[2]
    assert plain == spec and "accepted" in spec_err  # greedy speculative output is the plain output
    for _, out, _ in runs[3:]:
        data = json.loads(out)
        assert data["decode_tokens_per_second"] > 0 and data["weight_bytes_read"] > 0
    ngram, sampled = json.loads(runs[3][1]), json.loads(runs[4][1])
    assert ngram["speculative"]["draft_max"] == "auto" and ngram["speculative"]["timing"]["verdict"] in (
        "gain", "slower", "none")
    assert sampled["temperature"] == 0.8 and sampled["seed"] == 7 and sampled["prompt_tokens"] == [5, 17, 42]


def test_quantize_page(tmp_path, monkeypatch, capsys):
    runs = run_page("quantize.md", tmp_path, monkeypatch, capsys)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "Tiny-Qwen35-Mtp-2.4M-F32.gguf", "Tiny-Qwen35-Mtp-2.4M-Q4_K_M.gguf",
        "mtp-Tiny-Qwen35-Mtp-2.4M-F32.gguf", "mtp-Tiny-Qwen35-Mtp-2.4M-Q4_K_M.gguf"]
    result = json.loads(runs[3][1])
    assert set(result) == {"source", "written", "file_type", "tensors", "types", "bytes"}
    assert result["file_type"] == "Q6_K" and (tmp_path / "ladder" / "Tiny-Q6_K.gguf").is_file()
    assert "Tiny-Qwen35-Mtp-2.4M-Q4_K_M.gguf" in runs[4][1]


def test_demo_page(tmp_path, monkeypatch, capsys):
    runs = run_page("demo.md", tmp_path, monkeypatch, capsys)
    assert "PASSED" in runs[0][1]
    report = json.loads(runs[1][1])
    assert report["passed"] and len(report["acceptance"]["rows"]) == 2
    assert sorted(p.name for p in (tmp_path / "demo-files").iterdir()) == [
        "Tiny-Qwen35-Mtp-2.4M-F32.gguf", "Tiny-Qwen35-Mtp-2.9M-F32.gguf", "mtp-Tiny-Qwen35-Mtp-2.4M-F32.gguf"]
