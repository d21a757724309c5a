"""specconv's runtime on converted tiny Qwen3-Next files (qwen3next graph).

* MAIN logits (batch; cached prefill + decode; recurrent and chunked delta rule) equal transformers'
  forward and llama.cpp on the same file; greedy tokens equal transformers' generate;
* the MTP head equals transformers' MtpModel on llama.cpp's rows and on transformers' rows, from the
  embedded file and from the mtp- sidecar; its greedy draft chain equals llama.cpp's;
* snapshot rollback of the Gated DeltaNet state after a verification batch (any number of accepted
  drafts) equals a fresh evaluation of the committed tokens, and greedy speculative decoding with
  the MTP drafter (snapshot and checkpoint rollback) returns plain greedy decoding;
* `specconv verify --hf` passes and fails on a file whose MTP head was perturbed; `inspect` names it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from tests.fixtures import mtp_checks
from tests.fixtures import tiny_qwen3next as tiny

torch.set_num_threads(1)
N = tiny.N_LAYERS
IDS = [int(x) for x in np.random.default_rng(3).integers(0, tiny.VOCAB - 3, 32)]


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    return tiny.converted(tmp_path_factory.mktemp("q3nrt"))


def test_main_logits_equal_transformers_and_llamacpp(conv, llama_peer):
    """Tiny random Gated DeltaNet layers amplify float32 rounding (docs/testing.md, "Noise floor"):
    each path is compared with the same path of transformers (batched prompt; cached one-token steps),
    95 % of the positions within 1e-4 and the worst within max(1e-4, 2 x transformers' own batched-vs-
    cached difference) (tests/fixtures/runtime_common.py `parity`)."""
    from tests.fixtures.runtime_common import max_abs, parity

    src, files = conv
    ref, ref_h = tiny.hf_trunk(src, IDS)
    ref_steps = tiny.hf_logits_token_by_token(src, IDS)
    noise = max_abs(ref, ref_steps)
    model = load_model(files["embed"], device="cpu")
    measured = {}
    # the prompt in the chunked form against transformers' chunked prompt, in the recurrent form
    # (the delta rule token by token) against its token-by-token steps: the same algorithm each
    paths = {"recurrent": ref_steps, "chunked": ref, "auto": ref}
    for mode, reference in paths.items():
        out = Context(model, GraphType.MAIN, n_ctx=64, gdn_mode=mode).decode(IDS)
        measured[mode] = parity(out.logits, reference, noise)
    measured["hidden"] = parity(out.hidden["post_norm"], ref_h, noise)
    ctx = Context(model, GraphType.MAIN, n_ctx=64)
    steps = torch.cat([ctx.decode([t]).logits for t in IDS])
    measured["token-by-token"] = parity(steps, ref_steps, noise)
    ctx.clear()
    cached = torch.cat([ctx.decode(IDS[:13]).logits] + [ctx.decode([t]).logits for t in IDS[13:]])
    measured["prefill+decode"] = parity(cached, np.concatenate([ref[:13], ref_steps[13:]]), noise)
    measured["llama.cpp, same file"] = parity(llama_peer.llama_logits(files["embed"], IDS), out.logits, noise)
    print("qwen3next runtime MAIN vs transformers (max, p95 |Δlogit|): "
          + ", ".join(f"{k} {m:.3g}/{p:.3g}" for k, (m, p) in measured.items())
          + f"; transformers batched vs cached {noise:.3g}")
    ids2 = [int(x) for x in np.random.default_rng(11).integers(0, tiny.VOCAB - 3, 32)]  # test_qwen3next's prompt
    d2 = max_abs(Context(model, GraphType.MAIN, n_ctx=64).decode(ids2).logits, tiny.hf_trunk(src, ids2)[0])
    print(f"qwen3next runtime MAIN vs transformers on a second prompt: max |Δlogit| {d2:.3g}")
    assert d2 < 1e-4
    assert model.serves == {GraphType.MAIN, GraphType.MTP}
    mtp_checks.check_greedy(model, tiny, src, (IDS[:1], IDS[:12]), 12)


def test_mtp_logits_equal_mtpmodel(conv):
    src, files = conv
    mtp_checks.check_mtp_heads("qwen3next", tiny, src, files, IDS)


def test_snapshot_rollback_equals_fresh_evaluation(conv):
    """Prompt, then a verification batch of 1 + 3 tokens; keeping j + 1 of them is an index change in
    the snapshot ring. Every Gated DeltaNet layer's state and the next logits equal a fresh evaluation."""
    _, files = conv
    model = load_model(files["none"], device="cpu")
    prompt, batch = IDS[:20], IDS[20:24]
    worst_state = worst_logit = 0.0
    for j in range(4):
        ctx = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=4)
        ctx.decode(prompt)
        ctx.decode(batch)
        assert ctx.seq_rm(0, len(prompt) + j + 1)
        ref = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=4)
        ref.decode(prompt + batch[:j + 1])
        for layer in (0, 1, 2):
            for a, b in zip(ctx.recurrent_state(0, layer), ref.recurrent_state(0, layer)):
                worst_state = max(worst_state, float((a - b).abs().max()))
        nxt = [IDS[25]]
        worst_logit = max(worst_logit, float((ctx.decode(nxt).logits - ref.decode(nxt).logits).abs().max()))
    print(f"qwen3next snapshot rollback (keep 1..4 of 4): max |Δstate| {worst_state:.3g}, "
          f"next-token max |Δlogit| {worst_logit:.3g}")
    assert worst_state < 1e-5 and worst_logit < 1e-4


def test_mtp_draft_chain_and_speculative_decoding(conv, llama_peer):
    _, files = conv
    ours, drafts = mtp_checks.draft_chain_vs_llamacpp(llama_peer, files, IDS[:20], 4)
    print(f"qwen3next MTP draft chain: ours {ours}, llama.cpp {drafts}")
    assert ours == drafts
    prompts = (IDS[:1], IDS[:12], [5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17])
    for label, spec, plain in mtp_checks.speculative_vs_plain(files, prompts, 16, embedded=True):
        assert spec == plain, label


def test_verify_and_inspect(conv, tmp_path):
    from click.testing import CliRunner

    from specconv import cli as cli_module

    src, files = conv
    for args in ([files["embed"]], [files["none"], "--mtp", files["only"]]):
        code, report, out = mtp_checks.run_verify([*args, "--hf", src], tmp_path)
        assert code == 0 and report["passed"], out
        assert any("MTP" in c["name"] for c in report["checks"])
        print(f"qwen3next verify {' '.join(str(a).split('/')[-1] for a in args)}: passed; max |Δlogit| "
              f"{report['parity']['max_abs_logit_diff']:.3g}")
    bad = mtp_checks.plant(files["only"], tmp_path / "mtp-bad.gguf", f"blk.{N}.nextn.eh_proj.weight",
                           lambda a: a * np.float32(1.5))  # the MTP head's input projection, scaled
    code, report, out = mtp_checks.run_verify([files["none"], "--mtp", bad, "--hf", src], tmp_path)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    print(f"qwen3next verify with a perturbed nextn.eh_proj: exit {code}, failed {failed}")
    assert code != 0 and not report["passed"] and failed and all("MTP" in n for n in failed)
    for name, serves in (("embed", ["main", "mtp"]), ("only", ["mtp"])):
        result = CliRunner().invoke(cli_module.cli, ["inspect", str(files[name]), "--json"])
        info = json.loads(result.output)
        assert info["arch"] == "qwen3next" and sorted(info["serves"]) == serves, info["serves"]


def test_q8_0_file_passes_verify(conv, tmp_path):
    """--outtype q8_0: the graph runs the stored Q8_0 weights; verify judges the rounded file by the
    relative RMS logit error (specconv/verify/parity.py) and passes it, trunk and MTP head."""
    from tests.fixtures.gguf_files import convert_gguf

    src, _ = conv
    path = convert_gguf(src, tmp_path / "q8.gguf", outtype="q8_0", mtp="embed")
    code, report, out = mtp_checks.run_verify([path, "--hf", src], tmp_path)
    assert code == 0 and report["passed"], out
    print(f"qwen3next q8_0 verify: passed; max |Δlogit| {report['parity']['max_abs_logit_diff']:.3g}, "
          f"checks {[c['detail'] for c in report['checks'] if 'parity' in c['name']]}")


def test_scaled_rope_file_is_refused(tmp_path):
    """A YaRN config converts (the keys are written as llama.cpp's converter writes them) but the
    runtime's graph, which ropes without scaling, refuses the file with a one-line error."""
    from specconv.archs import SpecconvError
    from specconv.runtime.gguf_reader import open_gguf
    from tests.fixtures.gguf_files import convert_gguf

    rope = {"rope_type": "yarn", "rope_theta": tiny.ROPE_THETA, "partial_rotary_factor": 0.25, "factor": 4.0,
            "original_max_position_embeddings": 64}
    src = tiny.build_qwen3next(tmp_path / "hf", layout="transformers", rope_parameters=rope)
    path = convert_gguf(src, tmp_path / "yarn.gguf", mtp="none")
    assert open_gguf(path).get("qwen3next.rope.scaling.type") == "yarn"
    with pytest.raises(SpecconvError, match="rope.scaling.type"):
        load_model(path, device="cpu")
