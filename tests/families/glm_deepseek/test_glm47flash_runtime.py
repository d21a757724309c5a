"""specconv's runtime on converted tiny GLM-4.7-Flash files (deepseek2 graph, MLA + sigmoid MoE + nextn).

* MAIN logits (batch, and a cached prefill + decode) equal transformers' forward and llama.cpp on the
  same file; greedy tokens equal transformers' generate;
* the MTP head equals transformers' MtpModel on llama.cpp's rows, from the embedded file and from the
  mtp- sidecar; its greedy draft chain equals llama.cpp's;
* greedy speculative decoding with the MTP drafter returns plain greedy decoding;
* `specconv verify --hf` passes, and fails on a sidecar whose MTP head was perturbed.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from specconv.runtime import GraphType, load_model
from tests.fixtures import mtp_checks
from tests.fixtures import tiny_glm_deepseek as tiny

torch.set_num_threads(1)
FAMILY = "glm4moelite"
IDS = [int(x) for x in np.random.default_rng(3).integers(0, tiny.VOCAB - 6, 40)]


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    return tiny.converted(FAMILY, tmp_path_factory.mktemp("glm47rt"))


def test_main_logits_equal_transformers_and_llamacpp(conv, llama_peer):
    src, files = conv
    ref, ref_h = tiny.hf_trunk(src, IDS)
    model = load_model(files["embed"], device="cpu")
    out, diff, dh, cached = mtp_checks.main_diffs(model, IDS, ref, ref_h, prefill=17)
    peer = float(np.abs(llama_peer.llama_logits(files["embed"], IDS) - out.logits.numpy()).max())
    print(f"glm4moelite runtime MAIN vs transformers: max |Δlogit| = {diff:.3g} (post-norm hidden {dh:.3g}); "
          f"prefill+decode {cached:.3g}; vs llama.cpp on the same file {peer:.3g}")
    assert max(diff, dh, cached) < 1e-4 and peer < 2e-5
    assert model.serves == {GraphType.MAIN, GraphType.MTP}
    mtp_checks.check_greedy(model, tiny, src, (IDS[:1], IDS[:12]), 12)


def test_mtp_logits_equal_mtpmodel(conv):
    src, files = conv
    mtp_checks.check_mtp_heads("glm4moelite", tiny, src, files, IDS)


def test_mtp_draft_chain_and_speculative_decoding(conv, llama_peer):
    _, files = conv
    ours, drafts = mtp_checks.draft_chain_vs_llamacpp(llama_peer, files, IDS[:20], 4)
    print(f"glm4moelite MTP draft chain: ours {ours}, llama.cpp {drafts}")
    assert ours == drafts
    for label, spec, plain in mtp_checks.speculative_vs_plain(files, [IDS[:12]], 16):
        assert spec == plain, label


def test_verify_passes_and_fails_a_perturbed_head(conv, tmp_path):
    src, files = conv
    code, report, out = mtp_checks.run_verify([files["none"], "--mtp", files["only"], "--hf", src], tmp_path)
    assert code == 0 and report["passed"], out
    names = [c["name"] for c in report["checks"]]
    assert any("MTP" in n for n in names), names
    print(f"glm4moelite verify (trunk + sidecar): passed; max |Δlogit| {report['parity']['max_abs_logit_diff']:.3g}")
    bad = mtp_checks.plant(files["only"], tmp_path / "mtp-bad.gguf", f"blk.{tiny.N_LAYERS}.nextn.eh_proj.weight",
                           lambda a: a * np.float32(1.5))  # the MTP head's input projection, scaled
    code, report, out = mtp_checks.run_verify([files["none"], "--mtp", bad, "--hf", src], tmp_path)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    print(f"glm4moelite verify with a perturbed nextn.eh_proj: exit {code}, failed {failed}")
    assert code != 0 and not report["passed"] and any("MTP" in n for n in failed)
