"""`specconv verify` with a DFlash `--draft`: the pair's checks and greedy round trips, and with
`--draft-hf` the drafter against a reference computed from its checkpoint
(specconv/verify/dflash_reference.py) on transformers' hidden states.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures import tiny_dflash as tiny
from tests.fixtures.gguf_files import convert_gguf


torch.set_num_threads(1)
built = tiny.built


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash-verify")


def test_verify_with_a_dflash_draft(root, tmp_path):
    """`specconv verify TARGET --draft DFLASH --hf TARGET_DIR`: passes for the right pair (structure, fit,
    greedy exactness with the DFlash drafter, statistics); fails for a drafter of another target."""
    from specconv.cli import main as cli_main

    t_dir, t_gguf, _, d_gguf = built(root, "qwen3")
    _, other_gguf, _, _ = built(root, "qwen35")
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\\n    return x\nimport os\n")

    def verify(target, draft, *extra):
        report = tmp_path / "r.json"
        with pytest.raises(SystemExit) as exc:
            cli_main(["verify", str(target), "--draft", str(draft), "--prompts", str(prompts), "--report", str(report),
                      "-n", "6", "--draft-max", "3", "--device", "cpu", *extra])
        rep = json.loads(report.read_text())
        return exc.value.code, rep, {c["name"]: c for c in rep["checks"]}

    code, rep, checks = verify(t_gguf, d_gguf, "--hf", str(t_dir))
    print(f"\n[verify qwen3 + dflash] passed {rep['passed']}; speculative {rep['speculative'].get('drafter')}, "
          f"exact {rep['speculative'].get('exact')}")
    assert code == 0 and rep["passed"] and checks["greedy exact: dflash"]["passed"]
    assert checks["draft: DFlash drafter fits the model"]["passed"] and rep["speculative"]["exact"] is True
    code, rep, checks = verify(other_gguf, d_gguf)  # the qwen3 drafter reads layer input 5 of a 4-layer target
    assert code != 0 and not checks["draft: DFlash drafter fits the model"]["passed"]


def test_verify_draft_hf_checks_the_drafter_against_its_checkpoint(root, tmp_path):
    """`verify --draft D.gguf --hf TARGET --draft-hf DFLASH_DIR`: the drafter's block logits against a
    reference computed from its checkpoint on transformers' hidden states (specconv/verify/dflash_reference.py)
    pass for the right file and fail for a file converted with other target layers."""
    from specconv.cli import main as cli_main

    t_dir, t_gguf, d_dir, d_gguf = built(root, "qwen3")
    shifted = convert_gguf(d_dir, tmp_path / "shifted.gguf", extra_args=["--target", str(t_dir), "--target-layers", "0,2,4"])
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\\n    return x\nimport os\n")

    def verify(draft):
        report = tmp_path / "r.json"
        with pytest.raises(SystemExit) as exc:
            cli_main(["verify", str(t_gguf), "--draft", str(draft), "--hf", str(t_dir), "--draft-hf", str(d_dir),
                      "--prompts", str(prompts), "--report", str(report), "-n", "4", "--draft-max", "2", "--device", "cpu"])
        rep = json.loads(report.read_text())
        return exc.value.code, rep, {c["name"]: c for c in rep["checks"]}

    code, rep, checks = verify(d_gguf)
    print(f"\n[verify --draft-hf dflash] {checks['parity: DFlash drafter vs its checkpoint']['detail']}")
    assert code == 0 and checks["parity: DFlash drafter vs its checkpoint"]["passed"]
    assert checks["draft: DFlash target layers match its checkpoint"]["passed"] and rep["parity"]["dflash"] < 1e-4
    code, rep, checks = verify(shifted)  # layer inputs 0,2,4 = the checkpoint's ids taken as inputs: off by one
    print(f"[verify --draft-hf, layers off by one] {checks['draft: DFlash target layers match its checkpoint']['detail']}")
    assert code != 0 and not checks["parity: DFlash drafter vs its checkpoint"]["passed"]
    assert "off by one" in checks["draft: DFlash target layers match its checkpoint"]["detail"]
