"""`specconv verify` on tiny Qwen3.5 GGUFs: a clean conversion passes (exit 0, report keys), planted
defects fail (exit ≠ 0) on the check that should catch them:
* one MTP tensor perturbed (caught by the MTP parity against transformers' MtpModel, --hf);
* a sidecar from a different model (caught by the sidecar/trunk pairing: shared tensors differ);
* a trunk tensor swapped with another of the same shape (caught by the trunk parity, --hf).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from specconv.cli import main as cli_main
from tests.fixtures import speculative_models

FAST = ["-n", "6", "--draft-max", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("def f(x):\\n    return x\nimport os\n")
    return path


def verify(tmp_path, prompts, *args) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    with pytest.raises(SystemExit) as exc:
        cli_main(["verify", *map(str, args), "--prompts", str(prompts), "--report", str(report), *FAST])
    return exc.value.code, json.loads(report.read_text())


def failed(report) -> dict:
    return {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}


def _tensor_view(path, name) -> np.ndarray:
    """A writable float32 view of an F32 tensor inside a GGUF file."""
    reader = GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == name)
    assert t.tensor_type == GGMLQuantizationType.F32
    return t.data


def test_clean_model_passes(tmp_path, prompts):
    code, rep = verify(tmp_path, prompts, speculative_models.gguf("embedded"), "--hf", speculative_models.checkpoint(),
                       "--temperature", "0.8")
    print(f"clean: parity {rep['parity']}, speculative exact {rep['speculative']['exact']}")
    assert code == 0 and rep["passed"] and not failed(rep)
    assert {"passed", "checks", "parity", "speculative"} <= set(rep)
    assert {"max_abs_logit_diff", "reference"} <= set(rep["parity"]) and rep["parity"]["max_abs_logit_diff"] < 2e-3
    keys = {"exact", "drafted", "accepted", "acceptance_rate", "acceptance_length", "per_position",
            "tokens_per_target_forward", "bound", "speedup", "rollback"}
    assert keys <= set(rep["speculative"]) and rep["speculative"]["exact"] is True
    names = {c["name"] for c in rep["checks"]}
    assert {"greedy exact: mtp", "greedy exact: ngram", "parity: MTP head vs transformers MtpModel",
            "distribution at T=0.8 (compare rule)"} <= names


def test_release_layout_moe_passes(tmp_path, prompts):
    # the Hub layout (model.language_model.*, fused 3-D experts, nested text_config) as --hf
    kw = dict(moe=True, layout="release")
    code, rep = verify(tmp_path, prompts, speculative_models.gguf("embedded", **kw), "--hf",
                       speculative_models.checkpoint(**kw))
    print(f"release-layout MoE: parity {rep['parity']}")
    assert code == 0 and not failed(rep) and rep["parity"]["mtp"] is not None


def test_perturbed_mtp_tensor_fails(tmp_path, prompts):
    bad = tmp_path / "perturbed.gguf"
    shutil.copy(speculative_models.gguf("embedded"), bad)
    data = _tensor_view(bad, "blk.4.nextn.eh_proj.weight")
    data[0, 0] += 0.5  # one weight of the head's input projection
    data.flush() if hasattr(data, "flush") else None
    code, rep = verify(tmp_path, prompts, bad, "--hf", speculative_models.checkpoint())
    print(f"perturbed MTP weight: failed checks {failed(rep)}")
    assert code != 0 and not rep["passed"]
    assert set(failed(rep)) == {"parity: MTP head vs transformers MtpModel"}


def test_sidecar_from_another_model_fails(tmp_path, prompts):
    trunk = speculative_models.gguf("trunk")
    code, rep = verify(tmp_path, prompts, trunk, "--mtp", speculative_models.gguf("sidecar"))
    assert code == 0 and rep["passed"], failed(rep)
    code, rep = verify(tmp_path, prompts, trunk, "--mtp", speculative_models.gguf("sidecar", seed=1))
    print(f"foreign sidecar: failed checks {failed(rep)}")
    assert code != 0 and "sidecar: shared tensors match the trunk's" in failed(rep)


def test_swapped_trunk_tensors_fail_parity(tmp_path, prompts):
    bad = tmp_path / "swapped.gguf"
    shutil.copy(speculative_models.gguf("embedded"), bad)
    a, b = _tensor_view(bad, "blk.0.ffn_up.weight"), _tensor_view(bad, "blk.1.ffn_up.weight")
    assert a.shape == b.shape
    tmp = np.array(a)
    a[...] = b
    b[...] = tmp
    del a, b
    code, rep = verify(tmp_path, prompts, bad, "--hf", speculative_models.checkpoint())
    print(f"swapped blk.0/blk.1 ffn_up: failed checks {failed(rep)}")
    assert code != 0 and "parity: trunk logits vs transformers" in failed(rep)


def test_quantized_file_judged_on_relative_error(tmp_path, prompts):
    """A Q8_0 conversion differs from transformers by its rounding (max |Δ| ~2 on this ill-conditioned tiny
    model) and passes on the relative RMS criterion; the same file with two trunk tensors swapped fails."""
    good = speculative_models.gguf("embedded", outtype="q8_0")
    code, rep = verify(tmp_path, prompts, good, "--hf", speculative_models.checkpoint())
    print(f"q8_0: parity {rep['parity']}")
    assert code == 0 and rep["parity"]["criterion"] == "rel_rms", failed(rep)
    bad = tmp_path / "swapped-q8.gguf"
    shutil.copy(good, bad)
    reader = GGUFReader(bad, "r+")
    a, b = (next(t for t in reader.tensors if t.name == n).data for n in ("blk.0.ffn_up.weight", "blk.1.ffn_up.weight"))
    tmp = np.array(a)
    a[...] = b
    b[...] = tmp
    del a, b, reader
    code, rep = verify(tmp_path, prompts, bad, "--hf", speculative_models.checkpoint())
    print(f"q8_0 swapped: parity {rep['parity']}")
    assert code != 0 and "parity: trunk logits vs transformers" in failed(rep)


def test_identical_draft_model_and_temperature(tmp_path, prompts):
    model = speculative_models.gguf("trunk")
    code, rep = verify(tmp_path, prompts, model, "--draft", model, "--temperature", "0.8")
    s = rep["speculative"]
    print(f"identical draft: acceptance {s['acceptance_rate']}, tokens/forward {s['tokens_per_target_forward']}, "
          f"checks {[c['name'] for c in rep['checks']]}")
    assert code == 0 and s["drafter"] == "draft" and s["acceptance_rate"] == 1.0
    assert any(c["name"].startswith("distribution at T=0.8") and c["passed"] for c in rep["checks"])


def test_broken_rollback_fails_greedy_exactness(tmp_path, prompts, monkeypatch):
    # Negative control for the round-trip check: a seq_rm that keeps rejected drafts in the target's memory.
    from specconv.runtime.context import Context

    monkeypatch.setattr(Context, "seq_rm", lambda self, seq, from_pos: True)
    code, rep = verify(tmp_path, prompts, speculative_models.gguf("embedded"))
    print(f"no-op rollback: failed checks {failed(rep)}")
    assert code == 1 and "greedy exact: mtp" in failed(rep) and "greedy exact: ngram" in failed(rep)


def test_wrong_sampling_rule_fails_distribution_check(tmp_path, prompts, monkeypatch):
    # Negative control for the T > 0 check: a rule that accepts every draft unchecked.
    import specconv.verify.roundtrip as roundtrip

    monkeypatch.setattr(roundtrip, "verify_rows", lambda logits, drafts, q, t, g: (len(drafts), 0, "accept-all"))
    code, rep = verify(tmp_path, prompts, speculative_models.gguf("embedded"), "--temperature", "0.8")
    print(f"accept-all rule: failed checks {failed(rep)}")
    assert code != 0 and any(n.startswith("distribution at T=0.8") for n in failed(rep))
