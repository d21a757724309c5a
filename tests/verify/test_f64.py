"""`verify --dtype f64 --hf`: the runtime and transformers both in float64 (parity.reference_precision,
parity.round_as_stored_), so an F32 file is judged on arithmetic alone: max |Δlogit| ≤ 1e-9 on the
tiny fixtures of every family with a transformers reference, Gated DeltaNet families included (in
float32 they can only be judged within ~4e-4, docs/runtime.md). Figures: docs/robustness.md.

Every family whose releases wrap the text model's config in `text_config` (Qwen3.5 dense and MoE,
Gemma 4 dense and MoE, Step-3.7) is run in that release layout too: the reference must load the
text config the way transformers' own `from_pretrained` does, not the wrapper's."""

from __future__ import annotations

import json

import pytest

FAMILIES = ["qwen35", "qwen35moe", "qwen3next", "glm4moe", "deepseek2", "deepseek2-yarn", "gemma4", "llama", "qwen3",
            "qwen3moe", "hy_v3", "step35", "mimo2",
            # the release layouts with the text config nested in `text_config`
            "qwen35-release", "qwen35moe-release", "gemma4-release", "gemma4moe-release", "step37-release"]
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)


def _checkpoint(name: str, root):
    if name.startswith(("qwen35", "qwen35moe")):
        from tests.fixtures.tiny_qwen35 import build_qwen35

        layout = "release" if name.endswith("-release") else "save_pretrained"
        return build_qwen35(root / name, moe=name.startswith("qwen35moe"), layout=layout)
    if name.startswith("gemma4"):
        from tests.fixtures import tiny_gemma4

        # "hub": the Hub's config form; "conditional": the release layout (Gemma4ForConditionalGeneration)
        layout = "conditional" if name.endswith("-release") else "causal"
        return tiny_gemma4.tiny_gemma4("hub", layout, **(GEMMA4_MOE if name.startswith("gemma4moe") else {}))
    if name in ("hy_v3", "step35", "mimo2", "step37-release"):
        from tests.fixtures.tiny_chained import build_tiny, step37_release

        if name == "step37-release":
            return step37_release(build_tiny(root / "step35", "step35"), root / name)
        return build_tiny(root / name, name)
    if name == "qwen3next":
        from tests.fixtures.tiny_qwen3next import build_qwen3next

        return build_qwen3next(root / name)
    if name in ("glm4moe", "deepseek2", "deepseek2-yarn"):
        from tests.fixtures.tiny_glm_deepseek import build_tiny

        return build_tiny(root / name, name.split("-")[0], yarn=name.endswith("yarn"))
    if name == "llama":
        from tests.fixtures.tiny_eagle3 import build_llama_target

        return build_llama_target(root / name)
    from tests.fixtures.tiny_qwen3 import build_qwen3

    return build_qwen3(root / name, moe=name == "qwen3moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_f64_parity_within_1e9(family, tmp_path):
    from specconv.verify import VerifyOptions, run_verify
    from tests.fixtures.gguf_files import convert_gguf

    src = _checkpoint(family, tmp_path)
    model = convert_gguf(src, tmp_path / f"{family}.gguf", outtype="f32")
    report = run_verify(VerifyOptions(model=model, hf=src, dtype="f64", n_predict=4, draft_max=2, device="cpu"))
    if family.endswith("-release"):  # the layout under test: the text model's config nested
        assert "text_config" in json.loads((src / "config.json").read_text())
    p = report.parity
    print(f"{family}: verify --dtype f64 --hf: trunk max |Δlogit| {p.get('trunk'):.2e}"
          + (f", MTP {p['mtp']:.2e}" if "mtp" in p else "") + f" (reference {p.get('reference_dtype')})")
    failed = [c for c in report.checks if not c.passed]
    assert report.passed, failed
    assert p["criterion"] == "max_abs" and p["tolerance"] == 1e-9 and p["reference_dtype"] == "float64"
    assert p["trunk"] <= 1e-9 and p.get("mtp", 0.0) <= 1e-9
