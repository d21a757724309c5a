"""`specconv verify MODEL --draft EAGLE3.gguf`: passes for a head converted against its target, fails
(exit 1, the failed check named in the JSON report) for the same head converted against another target.
On a Llama target with `--hf` (trunk parity with LlamaForCausalLM) and `--draft-hf` (the head against the
reference computed from its checkpoint on transformers' hidden states): passes for the right conversion,
fails a head whose layers are moved by one or that was converted against another target."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specconv import cli
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_eagle3 import build_eagle3_head, build_llama_target
from tests.fixtures.tiny_qwen35 import build_qwen35


def _verify(tmp_path, model, head, name):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return a + b\n")
    report = tmp_path / f"{name}.json"
    res = CliRunner().invoke(cli.cli, ["verify", str(model), "--draft", str(head), "--prompts", str(prompts), "-n", "6",
                                       "--draft-max", "2", "--device", "cpu", "--report", str(report)])
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
    assert "target layer input 5" in failed.get("draft: EAGLE-3 head fits the model", ""), failed


# ---- a Llama target (GGUF arch llama) with --hf, and the head against its own checkpoint (--draft-hf)

FAST = ["-n", "4", "--draft-max", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """An 8-layer Llama target, a SpecForge-style head (eagle_config ids [1, 4, 6]: hidden_states[2, 5, 7]),
    the same head converted with its ids unshifted (layers [1, 4, 6]), and heads without ids converted
    against deeper Llamas (same tokenizer and width): 10 layers (default layers [2, 5, 7], inside the target)
    and 12 layers ([2, 6, 9]: beyond it)."""
    root = tmp_path_factory.mktemp("e3verify")
    target = build_llama_target(root / "llama8", n_layers=8)
    files = {"target": convert_gguf(target, root / "target.gguf")}
    head = build_eagle3_head(root / "head", target, layout="speculators", layer_ids=[1, 4, 6], seed=5)
    files["head"] = convert_gguf(head, root / "head.gguf", extra_args=["--target", str(target)])
    files["moved"] = convert_gguf(head, root / "moved.gguf",
                                  extra_args=["--target", str(target), "--target-layers", "1,4,6"])
    plain = build_eagle3_head(root / "plain", target, layout="eagle", seed=6)  # no ids: the default layers
    for n in (10, 12):
        deeper = build_llama_target(root / f"llama{n}", n_layers=n, seed=n)
        files[f"against{n}"] = convert_gguf(plain, root / f"against{n}.gguf", extra_args=["--target", str(deeper)])
    files["plain"] = convert_gguf(plain, root / "plain.gguf", extra_args=["--target", str(target)])
    return root, {"target": target, "head": head, "plain": plain}, files


def _run(tmp_path, *args):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return a + b\nThe quick brown fox\n")
    report = tmp_path / "report.json"
    res = CliRunner().invoke(cli.cli, ["verify", *map(str, args), "--prompts", str(prompts), "--report", str(report),
                                       *FAST])
    assert report.exists(), res.output
    rep = json.loads(report.read_text())
    return res.exit_code, rep, {c["name"]: c["detail"] for c in rep["checks"] if not c["passed"]}


def test_verify_hf_llama_target_with_head(llama, tmp_path):
    _, dirs, files = llama
    code, rep, failed = _run(tmp_path, files["target"], "--draft", files["head"], "--hf", dirs["target"],
                             "--draft-hf", dirs["head"])
    checks = {c["name"]: c["detail"] for c in rep["checks"]}
    print(f"\nllama target + head: parity {rep['parity']}\n  {checks['draft: EAGLE-3 target layers match its checkpoint']}"
          f"\n  {checks['parity: EAGLE-3 head vs its checkpoint']}")
    assert code == 0 and not failed, failed
    assert rep["parity"]["reference"].endswith("LlamaForCausalLM") and rep["parity"]["trunk"] < 1e-4
    assert rep["parity"]["eagle3_hidden_states"] == [2, 5, 7] and rep["parity"]["eagle3"] < 1e-4
    assert rep["parity"]["eagle3_draft_agreement"] == 1.0
    assert rep["speculative"]["drafter"] == "eagle3" and rep["speculative"]["exact"] is True


def test_verify_fails_the_head_moved_by_one(llama, tmp_path):
    _, dirs, files = llama
    code, rep, failed = _run(tmp_path, files["target"], "--draft", files["moved"], "--hf", dirs["target"],
                             "--draft-hf", dirs["head"])
    print(f"\nmoved by one: {failed}")
    assert code == 1 and set(failed) == {"draft: EAGLE-3 target layers match its checkpoint",
                                         "parity: EAGLE-3 head vs its checkpoint"}
    assert "off by one" in failed["draft: EAGLE-3 target layers match its checkpoint"]
    assert rep["parity"]["eagle3"] > 0.1


def test_verify_fails_a_head_converted_against_the_wrong_target(llama, tmp_path):
    _, dirs, files = llama
    # its layers lie beyond the target: --hf alone fails it (the head does not fit)
    code, _, failed = _run(tmp_path, files["target"], "--draft", files["against12"], "--hf", dirs["target"])
    print(f"\nconverted against a 12-layer model: {failed}")
    assert code == 1 and "target layer input 9, but the target has 8 layers" in failed["draft: EAGLE-3 head fits the model"]
    # its layers fit but are not the ones its checkpoint means for this target: the reference catches it
    code, _, failed = _run(tmp_path, files["target"], "--draft", files["against10"], "--hf", dirs["target"],
                           "--draft-hf", dirs["plain"])
    print(f"converted against a 10-layer model: {failed}")
    assert code == 1 and "parity: EAGLE-3 head vs its checkpoint" in failed
    assert "GGUF: layer inputs [2, 5, 7]" in failed["draft: EAGLE-3 target layers match its checkpoint"]
    assert "hidden_states [2, 4, 5]" in failed["draft: EAGLE-3 target layers match its checkpoint"]
    # the same head converted against its own target passes
    code, _, failed = _run(tmp_path, files["target"], "--draft", files["plain"], "--hf", dirs["target"],
                           "--draft-hf", dirs["plain"])
    assert code == 0 and not failed, failed


def test_target_with_a_head_beyond_it_is_one_line(llama):
    """generate refuses a head whose layers lie beyond the target, in one line."""
    _, _, files = llama
    res = CliRunner().invoke(cli.cli, ["generate", str(files["target"]), "--spec", "eagle3", "--draft",
                                       str(files["against12"]), "--tokens", "5,6,7", "-n", "2", "--device", "cpu"])
    message = str(res.exception)
    assert res.exit_code != 0 and "reads target layer input 9, but the target has 8 layers" in message
    assert "\n" not in message.strip()


def test_draft_hf_needs_hf_and_an_eagle3_draft(llama):
    _, dirs, files = llama
    cases = (([files["target"], "--draft", files["head"], "--draft-hf", dirs["head"]],
              "needs --draft HEAD.gguf and --hf"),
             ([files["target"], "--draft", files["target"], "--hf", dirs["target"], "--draft-hf", dirs["head"]],
              "--draft-hf is for an EAGLE-3 head"))
    for args, needle in cases:
        res = CliRunner().invoke(cli.cli, ["verify", *map(str, args), "--device", "cpu"])
        assert res.exit_code != 0 and needle in str(res.exception) and "\n" not in str(res.exception).strip()
