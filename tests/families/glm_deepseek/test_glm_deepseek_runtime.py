"""specconv's runtime on converted tiny GLM-4.5 (glm4moe) and DeepSeek-V3 (deepseek2) files.

* MAIN logits (one batch, and a cached prefill + decode) equal transformers' forward;
* the MTP head equals transformers' MtpModel on llama.cpp's rows and on transformers' rows, from
  the embedded file and from the mtp- sidecar (weights shared with the trunk);
* the MTP drafter's greedy draft chain equals llama.cpp's draft-mtp chain on the same file;
* greedy speculative decoding (MTP and n-gram drafters, snapshot and checkpoint rollback) returns
  exactly plain greedy decoding, which equals transformers' greedy generate;
* `specconv verify` passes on the converted files and fails on a planted defect.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import MtpDrafter, NgramDrafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures import mtp_checks
from tests.fixtures import tiny_glm_deepseek as tiny
from tests.fixtures.hf_reference import llamacpp_mtp_rows

IDS = [int(x) for x in np.random.default_rng(3).integers(0, tiny.VOCAB - 3, 40)]
VARIANTS = {"glm4moe": ("glm4moe", {}), "deepseek2": ("deepseek2", {}), "deepseek2-yarn": ("deepseek2", {"yarn": True})}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rt")


def _conv(root, variant):
    family, kw = VARIANTS[variant]
    return tiny.converted(family, root, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_main_logits_equal_transformers(root, variant):
    src, files = _conv(root, variant)
    ref, ref_h = tiny.hf_trunk(src, IDS)
    model = load_model(files["embed"], device="cpu")
    _, diff, dh, diff_cached = mtp_checks.main_diffs(model, IDS, ref, ref_h, prefill=17)
    trunk = load_model(files["none"], device="cpu")
    diff_trunk = float(np.abs(Context(trunk, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy() - ref).max())
    print(f"{variant} runtime MAIN vs transformers: max |Δlogit| = {diff:.3g} (post-norm hidden {dh:.3g}); "
          f"prefill+decode {diff_cached:.3g}; trunk-only file {diff_trunk:.3g}")
    assert max(diff, dh, diff_cached, diff_trunk) < 1e-4
    assert model.serves == {GraphType.MAIN, GraphType.MTP} and trunk.serves == {GraphType.MAIN}


@pytest.mark.parametrize("variant", ["glm4moe", "deepseek2"])
def test_quantized_file_runs_close_to_transformers(root, variant, tmp_path):
    """--outtype q8_0 (with the engine's F16 fallback for rows that are not multiples of 32, e.g.
    DeepSeek's 3-D attn_k_b): the graphs run dequantized weights. Rounded router inputs can flip
    near-tie expert choices at a few positions (docs/reference/model-math.md §3.2; llama.cpp's q8_0 run flips one
    too), so the check is per position: ≥ 90 % of rows within verify's Q8_0 tolerance (0.3) of
    transformers, and the same greedy token at ≥ 90 % of them."""
    from tests.fixtures.gguf_files import convert_gguf

    src, _ = _conv(root, variant)
    path = convert_gguf(src, tmp_path / "q8.gguf", outtype="q8_0", mtp="embed")
    model = load_model(path, device="cpu")
    ref, h = tiny.hf_trunk(src, IDS)
    got = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy()
    t, rows, pos = llamacpp_mtp_rows(IDS, h)
    mtp = Context(model, GraphType.MTP, n_ctx=64).decode(t, pos, hidden_in=torch.tensor(rows)).logits.numpy()
    ref_mtp = tiny.hf_mtp_llamacpp_rows(src, IDS, h)
    for what, a, b in (("trunk", got, ref), ("MTP", mtp, ref_mtp)):
        rows_diff = np.abs(a - b).max(axis=1)
        close, same = float((rows_diff < 0.3).mean()), float((a.argmax(1) == b.argmax(1)).mean())
        print(f"{variant} q8_0 file, runtime vs transformers ({what}): max |Δlogit| {rows_diff.max():.3g}, "
              f"median {np.median(rows_diff):.3g}, rows within 0.3: {close:.0%}, same argmax: {same:.0%}")
        assert close >= 0.9 and same >= 0.9


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_logits_equal_mtpmodel(root, variant):
    src, files = _conv(root, variant)
    mtp_checks.check_mtp_heads(variant, tiny, src, files, IDS)


@pytest.mark.parametrize("variant", ["glm4moe", "deepseek2"])
def test_mtp_draft_chain_equals_llamacpp(root, variant, llama_peer):
    _, files = _conv(root, variant)
    ours, drafts = mtp_checks.draft_chain_vs_llamacpp(llama_peer, files, IDS[:20], 4)
    print(f"{variant} MTP draft chain: ours {ours}, llama.cpp {drafts}")
    assert ours == drafts


@pytest.mark.parametrize("variant", ["glm4moe", "deepseek2"])
def test_mtp_cache_after_partial_acceptance_equals_fresh_start(root, variant):
    """After draft rows are dropped and catch-up rows written for j accepted drafts, the head's cache
    is the teacher-forced one: its next drafts and logits equal a head started afresh on the committed
    tokens (whatever j; acceptance is simulated, since random tiny heads are rarely right)."""
    _, files = _conv(root, variant)
    for j, diff in mtp_checks.partial_acceptance_diffs(files, IDS[:15]):
        print(f"{variant} MTP head after accepting {j} of 3 drafts vs a fresh start: max |Δlogit| = {diff:.3g}")
        assert diff < 1e-4


@pytest.mark.parametrize("variant", ["glm4moe", "deepseek2"])
@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_greedy_speculative_equals_plain(root, variant, rollback):
    src, files = _conv(root, variant)
    n = 16
    target = load_model(files["none"], device="cpu")
    head = load_model(files["only"], device="cpu", share_from=target)
    embedded = load_model(files["embed"], device="cpu")
    for prompt in (IDS[:1], IDS[:12], [5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17]):
        plain = generate(target, prompt, n).tokens
        assert plain == tiny.hf_greedy(src, prompt, n)  # the plain loop itself against transformers
        for name, drafter, tgt in (("mtp-sidecar", MtpDrafter(head, 64, target), target),
                                   ("mtp-embedded", MtpDrafter(embedded, 64, embedded), embedded),
                                   ("ngram", NgramDrafter(), target)):
            res = speculative_generate(tgt, drafter, prompt, n, SpecConfig(draft_max=3, rollback=rollback))
            s = res.stats["speculative"]
            print(f"{variant} {rollback} {name} prompt[{len(prompt)}]: accepted {s['accepted']}/{s['drafted']}")
            assert res.tokens == plain, (name, prompt)


# ------------------------------------------------------------------ specconv verify

def test_verify_passes_and_catches_planted_defects(root, tmp_path):
    src, files = _conv(root, "glm4moe")
    code, report, out = mtp_checks.run_verify([files["embed"], "--hf", src], tmp_path)
    assert code == 0 and report["passed"], out
    parity = {c["name"]: c["passed"] for c in report["checks"]}
    assert any("MTP" in n for n in parity), parity  # the MTP head was compared too
    print(f"glm4moe verify (embedded): passed; max |Δlogit| {report['parity']['max_abs_logit_diff']:.3g}")

    src_d, files_d = _conv(root, "deepseek2")
    code, report, out = mtp_checks.run_verify([files_d["none"], "--mtp", files_d["only"], "--hf", src_d], tmp_path)
    assert code == 0 and report["passed"], out
    print(f"deepseek2 verify (trunk + sidecar): passed; max |Δlogit| {report['parity']['max_abs_logit_diff']:.3g}")

    # a routing bias zeroed in the sidecar's nextn block: only the MTP head is wrong
    bad_head = mtp_checks.plant(files_d["only"], tmp_path / "mtp-bad.gguf", f"blk.{tiny.N_LAYERS}.exp_probs_b.bias",
                                np.zeros_like)
    code, report, out = mtp_checks.run_verify([files_d["none"], "--mtp", bad_head, "--hf", src_d], tmp_path)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    print(f"deepseek2 verify with a zeroed nextn routing bias: exit {code}, failed {failed}")
    assert code != 0 and not report["passed"] and any("MTP" in n for n in failed)

    # GLM attention key biases reversed in block 1: the trunk parity fails
    bad_trunk = mtp_checks.plant(files["embed"], tmp_path / "bad.gguf", "blk.1.attn_k.bias",
                                 lambda a: a[::-1].copy())
    code, report, out = mtp_checks.run_verify([bad_trunk, "--hf", src], tmp_path)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    print(f"glm4moe verify with reversed attn_k.bias: exit {code}, failed {failed}")
    assert code != 0 and not report["passed"] and any("trunk" in n for n in failed)


def _strip_nextn_block(src, dst):
    """Rewrite a GGUF without its nextn block's tensors but with the same KV (nextn still declared)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    n = int(r.fields[f"{arch}.block_count"].contents()) - int(r.fields[f"{arch}.nextn_predict_layers"].contents())
    w = GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        w.add_key_value(name, f.contents(), vtype, f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if not t.name.startswith(f"blk.{n}."):
            w.add_tensor(t.name, np.array(t.data), raw_shape=tuple(reversed([int(x) for x in t.shape])),
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("variant", ["glm4moe", "deepseek2"])
def test_declared_but_absent_nextn_block_runs_as_trunk(root, variant, tmp_path, llama_peer):
    """glm4moe/deepseek2 files may declare nextn_predict_layers without holding the block
    (llama.cpp's `trunk_only` case, docs/reference/gguf-layout.md §4.3): both runtimes run the trunk, ours refuses
    an MTP context with a clear error."""
    from specconv.archs import SpecconvError

    _, files = _conv(root, variant)
    path = _strip_nextn_block(files["embed"], tmp_path / "declared.gguf")
    model = load_model(path, device="cpu")
    assert model.serves == {GraphType.MAIN} and model.hparams.num_nextn_predict_layers == 1
    ours = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy()
    diff = float(np.abs(llama_peer.llama_logits(path, IDS) - ours).max())
    print(f"{variant} nextn declared, block absent: runtime vs llama.cpp max |Δlogit| = {diff:.3g}")
    assert diff < 1e-4
    with pytest.raises(SpecconvError, match="no MTP head"):
        Context(model, GraphType.MTP)
