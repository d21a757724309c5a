"""specconv's runtime on converted tiny GLM-4.7-Flash files (deepseek2 graph, MLA + sigmoid MoE + nextn).

* MAIN logits (batch, and a cached prefill + decode) equal transformers' forward and llama.cpp on the
  same file; greedy tokens equal transformers' generate;
* the MTP head equals transformers' MtpModel on llama.cpp's rows, from the embedded file and from the
  mtp- sidecar; its greedy draft chain equals llama.cpp's;
* greedy speculative decoding with the MTP drafter returns plain greedy decoding;
* `specconv verify --hf` passes, and fails on a sidecar whose MTP head was perturbed.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import MtpDrafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures import tiny_glm_deepseek as tiny
from tests.fixtures.hf_reference import llamacpp_mtp_rows

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
    ctx = Context(model, GraphType.MAIN, n_ctx=64)
    out = ctx.decode(IDS)
    diff = float(np.abs(out.logits.numpy() - ref).max())
    dh = float(np.abs(out.hidden["post_norm"].numpy() - ref_h).max())
    ctx.clear()
    steps = [ctx.decode(IDS[:17]).logits] + [ctx.decode([t]).logits for t in IDS[17:]]
    cached = float(np.abs(torch.cat(steps).numpy() - ref).max())
    peer = float(np.abs(llama_peer.llama_logits(files["embed"], IDS) - out.logits.numpy()).max())
    print(f"glm4moelite runtime MAIN vs transformers: max |Δlogit| = {diff:.3g} (post-norm hidden {dh:.3g}); "
          f"prefill+decode {cached:.3g}; vs llama.cpp on the same file {peer:.3g}")
    assert max(diff, dh, cached) < 1e-4 and peer < 2e-5
    assert model.serves == {GraphType.MAIN, GraphType.MTP}
    for prompt in (IDS[:1], IDS[:12]):
        assert generate(model, prompt, 12).tokens == tiny.hf_greedy(src, prompt, 12)


def test_mtp_logits_equal_mtpmodel(conv):
    src, files = conv
    _, h = tiny.hf_trunk(src, IDS)
    ref = tiny.hf_mtp_llamacpp_rows(src, IDS, h)
    trunk = load_model(files["none"], device="cpu")
    heads = {"embedded": load_model(files["embed"], device="cpu"),
             "sidecar": load_model(files["only"], device="cpu", share_from=trunk)}
    t, rows, pos = llamacpp_mtp_rows(IDS, h)
    for kind, head in heads.items():
        got = Context(head, GraphType.MTP, n_ctx=64).decode(t, pos, hidden_in=torch.tensor(rows)).logits.numpy()
        diff = float(np.abs(got - ref).max())
        print(f"glm4moelite runtime MTP ({kind}) vs MtpModel (llama.cpp rows): max |Δlogit| = {diff:.3g}")
        assert diff < 1e-4


def test_mtp_draft_chain_and_speculative_decoding(conv, llama_peer):
    _, files = conv
    prompt = IDS[:20]
    id_last, drafts, _ = llama_peer.llama_mtp_draft(files["none"], prompt, 4, files["only"])
    target = load_model(files["none"], device="cpu")
    head = load_model(files["only"], device="cpu", share_from=target)
    out = Context(target, GraphType.MAIN, n_ctx=64).decode(prompt)
    assert int(out.logits[-1].argmax()) == id_last
    drafter = MtpDrafter(head, 64, target)
    drafter.start(prompt, out.hidden["post_norm"])
    ours = drafter.draft(id_last, 4).tokens
    print(f"glm4moelite MTP draft chain: ours {ours}, llama.cpp {drafts}")
    assert ours == drafts
    for rollback in ("snapshot", "checkpoint"):
        plain = generate(target, IDS[:12], 16).tokens
        res = speculative_generate(target, MtpDrafter(head, 64, target), IDS[:12], 16,
                                   SpecConfig(draft_max=3, rollback=rollback))
        assert res.tokens == plain


def _verify(args, tmp_path):
    from click.testing import CliRunner

    from specconv import cli as cli_module

    report = tmp_path / "report.json"
    result = CliRunner().invoke(cli_module.cli, ["verify", *map(str, args), "-n", "6", "--draft-max", "2",
                                                 "--device", "cpu", "--json", str(report)])
    return result.exit_code, json.loads(report.read_text()) if report.exists() else None, result.output


def test_verify_passes_and_fails_a_perturbed_head(conv, tmp_path):
    from gguf import GGUFReader

    src, files = conv
    code, report, out = _verify([files["none"], "--mtp", files["only"], "--hf", src], tmp_path)
    assert code == 0 and report["passed"], out
    names = [c["name"] for c in report["checks"]]
    assert any("MTP" in n for n in names), names
    print(f"glm4moelite verify (trunk + sidecar): passed; max |Δlogit| {report['parity']['max_abs_logit_diff']:.3g}")
    bad = shutil.copy(files["only"], tmp_path / "mtp-bad.gguf")
    reader = GGUFReader(bad, "r+")
    t = next(t for t in reader.tensors if t.name == f"blk.{tiny.N_LAYERS}.nextn.eh_proj.weight")
    t.data[...] = np.array(t.data) * np.float32(1.5)  # the MTP head's input projection, scaled
    reader.data.flush()
    code, report, out = _verify([files["none"], "--mtp", bad, "--hf", src], tmp_path)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    print(f"glm4moelite verify with a perturbed nextn.eh_proj: exit {code}, failed {failed}")
    assert code != 0 and not report["passed"] and any("MTP" in n for n in failed)
