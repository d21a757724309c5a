"""`specconv verify TARGET.gguf --draft HEAD.gguf --hf TARGET_DIR --draft-hf HEAD_DIR` for EAGLE-3 heads over
Qwen3 and Qwen3-MoE targets (trunk parity with Qwen3ForCausalLM / Qwen3MoeForCausalLM, the head against the
reference computed from its checkpoint on transformers' hidden states), and what the converter says.

Passes the good pairs (SpecForge layout on the dense target, AngelSlim layout on the MoE target); fails a
head whose target layers were changed (converted with --target-layers shifted by one) and heads converted
against the wrong target (no ids in the config: against a 10-layer Qwen3 its default layers [2, 5, 7] fit
the 8-layer target but are not the ones the checkpoint means there; against a 12-layer one, [2, 6, 9] lie
beyond it).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specconv import cli
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_eagle3_qwen3 import build_head
from tests.fixtures.tiny_qwen3 import build_qwen3

torch.set_num_threads(1)
SHAPE = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 32}
FAST = ["-n", "4", "--draft-max", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("e3q3v")
    dirs = {"qwen3": build_qwen3(root / "qwen3", tie=True, n_layers=8, **SHAPE),
            "qwen3moe": build_qwen3(root / "qwen3moe", moe=True, n_layers=8, seed=1, **SHAPE)}
    files = {t: convert_gguf(d, root / f"{t}.gguf") for t, d in dict(dirs).items()}
    dirs["specforge"] = build_head(root / "specforge", dirs["qwen3"], layout="specforge", ids=[0, 2, 6], seed=1)
    dirs["angelslim"] = build_head(root / "angelslim", dirs["qwen3moe"], layout="angelslim", ids=[0, 4, 6], seed=2)
    dirs["plain"] = build_head(root / "plain", dirs["qwen3"], layout="specforge", seed=3)  # no ids: the default
    files["specforge"] = convert_gguf(dirs["specforge"], root / "sf.gguf", extra_args=["--target", str(dirs["qwen3"])])
    files["angelslim"] = convert_gguf(dirs["angelslim"], root / "as.gguf", extra_args=["--target", str(dirs["qwen3moe"])])
    files["moved"] = convert_gguf(dirs["specforge"], root / "moved.gguf",
                                  extra_args=["--target", str(dirs["qwen3"]), "--target-layers", "0,2,6"])
    files["plain"] = convert_gguf(dirs["plain"], root / "plain.gguf", extra_args=["--target", str(dirs["qwen3"])])
    for n in (10, 12):
        deeper = build_qwen3(root / f"qwen3-{n}", tie=True, n_layers=n, seed=n, **SHAPE)
        files[f"against{n}"] = convert_gguf(dirs["plain"], root / f"against{n}.gguf", extra_args=["--target", str(deeper)])
    return root, dirs, files


def _run(tmp_path, *args):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return a + b\nThe quick brown fox\n")
    report = tmp_path / "report.json"
    res = CliRunner().invoke(cli.cli, ["verify", *map(str, args), "--prompts", str(prompts), "--report", str(report), *FAST])
    assert report.exists(), res.output
    rep = json.loads(report.read_text())
    return res.exit_code, rep, {c["name"]: c["detail"] for c in rep["checks"] if not c["passed"]}


LAYERS_CHECK = "draft: EAGLE-3 target layers match its checkpoint"
PARITY_CHECK = "parity: EAGLE-3 head vs its checkpoint"


@pytest.mark.parametrize("head,target,reference,hidden_states",
                         [("specforge", "qwen3", "Qwen3ForCausalLM", [1, 3, 7]),
                          ("angelslim", "qwen3moe", "Qwen3MoeForCausalLM", [1, 5, 7])])
def test_verify_passes_the_good_pair(built, tmp_path, head, target, reference, hidden_states):
    _, dirs, files = built
    code, rep, failed = _run(tmp_path, files[target], "--draft", files[head], "--hf", dirs[target],
                             "--draft-hf", dirs[head])
    checks = {c["name"]: c["detail"] for c in rep["checks"]}
    print(f"\n{head} on {target}: parity {rep['parity']}\n  {checks[LAYERS_CHECK]}\n  {checks[PARITY_CHECK]}")
    assert code == 0 and not failed, failed
    assert rep["parity"]["reference"].endswith(reference) and rep["parity"]["trunk"] < 1e-4
    assert rep["parity"]["eagle3_hidden_states"] == hidden_states and rep["parity"]["eagle3"] < 1e-4
    assert rep["parity"]["eagle3_draft_agreement"] == 1.0
    assert rep["speculative"]["drafter"] == "eagle3" and rep["speculative"]["exact"] is True


def test_verify_fails_changed_target_layers(built, tmp_path):
    _, dirs, files = built
    code, rep, failed = _run(tmp_path, files["qwen3"], "--draft", files["moved"], "--hf", dirs["qwen3"],
                             "--draft-hf", dirs["specforge"])
    print(f"\nlayers [0, 2, 6] instead of [1, 3, 7]: {failed}")
    assert code == 1 and set(failed) == {LAYERS_CHECK, PARITY_CHECK}
    assert "off by one" in failed[LAYERS_CHECK] and rep["parity"]["eagle3"] > 0.1


def test_verify_fails_a_head_converted_against_the_wrong_target(built, tmp_path):
    _, dirs, files = built
    code, _, failed = _run(tmp_path, files["qwen3"], "--draft", files["against12"], "--hf", dirs["qwen3"])
    print(f"\nconverted against a 12-layer Qwen3: {failed}")
    assert code == 1 and "target layer input 9, but the target has 8 layers" in failed["draft: EAGLE-3 head fits the model"]
    code, rep, failed = _run(tmp_path, files["qwen3"], "--draft", files["against10"], "--hf", dirs["qwen3"],
                             "--draft-hf", dirs["plain"])
    print(f"converted against a 10-layer Qwen3: {failed}")
    assert code == 1 and PARITY_CHECK in failed and rep["parity"]["eagle3"] > 0.1
    assert "GGUF: layer inputs [2, 5, 7]" in failed[LAYERS_CHECK] and "hidden_states [2, 4, 5]" in failed[LAYERS_CHECK]
    code, _, failed = _run(tmp_path, files["qwen3"], "--draft", files["plain"], "--hf", dirs["qwen3"],
                           "--draft-hf", dirs["plain"])
    assert code == 0 and not failed, failed


def _convert(head, target, out, *extra):
    return CliRunner().invoke(cli.cli, ["convert", str(head), "-o", str(out), "--outtype", "f32", "--target",
                                        str(target), "--json", *extra])


def test_converter_notices_and_refusals(built, tmp_path):
    """An AngelSlim-named head without ids gets the default layers and a notice naming AngelSlim's own default
    ([1, (L+1)//2-1, L-3] outputs = inputs [2, 4, 6] for L = 8); EAGLE-3.1 options are refused in one line."""
    _, dirs, _ = built
    head = build_head(tmp_path / "as-noids", dirs["qwen3"], layout="angelslim", seed=4)
    res = _convert(head, dirs["qwen3"], tmp_path / "as.gguf")
    assert res.exit_code == 0, res.output
    notices = json.loads(res.output)["notices"]
    print(f"\nAngelSlim head without ids: {notices}")
    assert any("default [2, L//2, L-3]" in n for n in notices)
    assert any("--target-layers 2,4,6" in n for n in notices)
    res = _convert(dirs["plain"], dirs["qwen3"], tmp_path / "sf.gguf")  # SpecForge's name: no AngelSlim notice
    assert not any("AngelSlim" in n for n in json.loads(res.output)["notices"])
    cfg = json.loads((dirs["plain"] / "config.json").read_text())
    for key in ("fc_norm", "norm_output"):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "model.safetensors").symlink_to(dirs["plain"] / "model.safetensors")
        (bad / "config.json").write_text(json.dumps({**cfg, key: True}))
        res = _convert(bad, dirs["qwen3"], tmp_path / f"{key}.gguf")
        message = str(res.exception)
        assert res.exit_code != 0 and f"{key}=true (an EAGLE-3.1 head) is not supported" in message
        assert "\n" not in message.strip() and not (tmp_path / f"{key}.gguf").exists()
