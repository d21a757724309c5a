"""`specconv verify MODEL --draft EAGLE3.gguf`: passes for a head converted against its target, fails
(exit 1, the failed check named in the JSON report) for the same head converted against another target."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specconv import cli
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_eagle3 import build_eagle3_head
from tests.fixtures.tiny_qwen35 import build_qwen35


def _verify(tmp_path, model, head, name):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return a + b\n")
    report = tmp_path / f"{name}.json"
    res = CliRunner().invoke(cli.cli, ["verify", str(model), "--draft", str(head), "--prompts", str(prompts), "-n", "6",
                                       "--draft-max", "2", "--device", "cpu", "--json", str(report)])
    return res, json.loads(report.read_text())


def test_verify_draft_eagle3(tmp_path):
    target = build_qwen35(tmp_path / "target", mtp=False, n_layers=4)
    other = build_qwen35(tmp_path / "other", mtp=False, n_layers=8, seed=1)  # same tokenizer and width, deeper
    model = convert_gguf(target, tmp_path / "target.gguf")

    good = build_eagle3_head(tmp_path / "good", target, layer_ids=[1, 2, 4])
    res, report = _verify(tmp_path, model, convert_gguf(good, tmp_path / "good.gguf", extra_args=["--target", str(target)]),
                          "good")
    failed = [c for c in report["checks"] if not c["passed"]]
    assert res.exit_code == 0 and report["passed"] and not failed, failed
    assert report["speculative"]["drafter"] == "eagle3" and report["speculative"]["exact"] is True
    assert len(report["speculative"]["per_position"]) == 2

    # no layer ids in its config: converted against the 8-layer model it reads layers [2, 4, 5]
    stray = build_eagle3_head(tmp_path / "stray", target)
    wrong = convert_gguf(stray, tmp_path / "wrong.gguf", extra_args=["--target", str(other)])
    res, report = _verify(tmp_path, model, wrong, "wrong")
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}
    assert res.exit_code != 0 and not report["passed"]
    assert "target layer 5" in failed.get("draft: EAGLE-3 head fits the model", ""), failed
