"""specconv's runtime on converted tiny GLM-5 (`glm-dsa`) and DeepSeek-V3.2 (`deepseek32`) files
(runtime/graphs/dsa.py, docs/dsa.md). The 40-token prompt is longer than index_topk (8):

* MAIN logits equal transformers' forward in one batch and as a prefill followed by token-by-token
  decoding (the indexer keys come from the cache), from the embedded and the trunk-only file;
  the same graph with the selection switched off is far from transformers, so the top-k matters;
* the MTP head (with its own indexer) equals transformers' MtpModel on llama.cpp's rows and on
  transformers' rows, embedded and as a sidecar;
* greedy decoding equals transformers' generate; greedy speculative decoding (MTP, n-gram) equals it;
* `specconv verify` passes, and fails a file whose MTP head's indexer was perturbed.
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
from tests.fixtures import tiny_dsa as tiny

torch.set_num_threads(1)
IDS = [int(x) for x in np.random.default_rng(0).integers(0, tiny.VOCAB - 6, 40)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dsa_rt")


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_main_logits_equal_transformers(root, family):
    src, files = tiny.converted(family, root)
    ref, ref_h = tiny.hf_trunk(src, IDS)
    model = load_model(files["embed"], device="cpu")
    _, diff, dh, diff_cached = mtp_checks.main_diffs(model, IDS, ref, ref_h, prefill=5)
    trunk = load_model(files["none"], device="cpu")
    diff_trunk = float(np.abs(Context(trunk, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy() - ref).max())
    model.hparams.index_topk = len(IDS)  # every visible key: plain MLA
    dense = float(np.abs(Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy() - ref).max())
    print(f"{family} runtime MAIN vs transformers: max |Δlogit| = {diff:.3g} (post-norm hidden {dh:.3g}); "
          f"prefill 5 + token by token {diff_cached:.3g}; trunk-only file {diff_trunk:.3g}; "
          f"without the selection {dense:.3g}")
    assert max(diff, dh, diff_cached, diff_trunk) < 1e-4
    assert dense > 0.1
    assert model.serves == {GraphType.MAIN, GraphType.MTP} and trunk.serves == {GraphType.MAIN}


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_mtp_logits_equal_mtpmodel(root, family):
    src, files = tiny.converted(family, root)
    mtp_checks.check_mtp_heads(family, tiny, src, files, IDS, one_by_one=True)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_greedy_plain_and_speculative_equal_transformers(root, family):
    src, files = tiny.converted(family, root)
    n = 12
    target = load_model(files["none"], device="cpu")
    head = load_model(files["only"], device="cpu", share_from=target)
    for prompt in (IDS[:3], IDS[:20]):
        plain = generate(target, prompt, n).tokens
        hf = tiny.hf_greedy(src, prompt, n)
        print(f"{family} greedy prompt[{len(prompt)}]: ours {plain}, transformers {hf}")
        assert plain == hf
        for name, drafter in (("mtp", MtpDrafter(head, 64, target)), ("ngram", NgramDrafter())):
            res = speculative_generate(target, drafter, prompt, n, SpecConfig(draft_max=3))
            s = res.stats["speculative"]
            print(f"{family} {name} prompt[{len(prompt)}]: accepted {s['accepted']}/{s['drafted']}")
            assert res.tokens == plain, (name, prompt)


# ------------------------------------------------------------------ specconv verify

@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_verify_passes_and_fails_a_perturbed_mtp_indexer(root, family, tmp_path):
    src, files = tiny.converted(family, root)
    code, report, out = mtp_checks.run_verify([files["embed"], "--hf", src], tmp_path)
    assert code == 0 and report["passed"], out
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["parity: MTP head vs transformers MtpModel"]["passed"]
    print(f"{family} verify (embedded): passed; max |Δlogit| {report['parity']['max_abs_logit_diff']:.3g}")
    code, report, out = mtp_checks.run_verify([files["none"], "--mtp", files["only"], "--hf", src], tmp_path)
    assert code == 0 and report["passed"], out
    # the nextn block's indexer head weights negated: only the MTP head's key selection changes
    bad = mtp_checks.plant(files["only"], tmp_path / "mtp-bad.gguf", f"blk.{tiny.N_LAYERS}.indexer.proj.weight",
                           lambda a: -a)
    code, report, out = mtp_checks.run_verify([files["none"], "--mtp", bad, "--hf", src], tmp_path)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    print(f"{family} verify with the MTP indexer's weights negated: exit {code}, failed {failed}")
    assert code != 0 and not report["passed"] and failed == ["parity: MTP head vs transformers MtpModel"]


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_mtp_cache_after_partial_acceptance_equals_fresh_start(root, family):
    """After j of 3 drafts are accepted (rows dropped, catch-up rows written), the head's cache,
    indexer keys included, is the teacher-forced one: its next logits equal a head started afresh."""
    _, files = tiny.converted(family, root)
    for j, diff in mtp_checks.partial_acceptance_diffs(files, IDS[:15]):
        print(f"{family} MTP head after accepting {j} of 3 drafts vs a fresh start: max |Δlogit| = {diff:.3g}")
        assert diff < 1e-4


def _run(model, ids=IDS):
    """(trunk logits, post-norm hidden, MTP logits on transformers' rows)."""
    out = Context(model, GraphType.MAIN, n_ctx=64).decode(ids)
    hidden = out.hidden["post_norm"]
    mtp = Context(model, GraphType.MTP, n_ctx=64).decode(ids[1:], hidden_in=hidden[:-1]).logits
    return out.logits, hidden, mtp


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_q8_0_stored_offloaded_and_over_slots(root, family, tmp_path):
    """A --outtype q8_0 file: weights kept packed (dequantized per use) compute exactly what dense
    weights compute, offloaded and over 1-3 CPU slots too (GLM with a shared indexer layer, whose
    selection crosses the slot boundary). Against transformers the rounded weights move near-tie
    choices: the top-8-of-40 key selection often (llama.cpp's own run of the same file is as far:
    docs/dsa.md), expert routing sometimes; with the selection off on both sides the median row is
    within verify's Q8_0 tolerance (0.3)."""
    from tests.fixtures.gguf_files import convert_gguf

    over = {"indexer_types": ["full", "shared", "full"]} if family == "glm-dsa" else {}
    src = tiny.build_tiny(tmp_path / "hf", family, **over)
    path = convert_gguf(src, tmp_path / "q8.gguf", outtype="q8_0", mtp="embed")
    resident = _run(load_model(path, device="cpu"))
    runs = {"dense": load_model(path, device="cpu", weights="dense"),
            "offload": load_model(path, device="cpu", offload=True),
            "cpu,cpu": load_model(path, device="cpu,cpu"), "cpu,cpu,cpu": load_model(path, device="cpu,cpu,cpu")}
    for label, model in runs.items():
        for a, b in zip(_run(model), resident):
            assert torch.equal(a, b), f"{family} q8_0 {label}: max |Δ| {float((a - b).abs().max())}"
    ref, _ = tiny.hf_trunk(src, IDS)
    rows = np.abs(resident[0].numpy() - ref).max(axis=1)
    # the same comparison with the selection switched off on both sides (every visible key)
    main, _ = tiny.load_hf(src)
    indexers = [layer.self_attn.indexer for layer in main.model.layers if layer.self_attn.indexer is not None]
    try:
        for ix in indexers:
            ix.index_topk = len(IDS)
        ref_dense, _ = tiny.hf_trunk(src, IDS)
    finally:
        for ix in indexers:
            ix.index_topk = tiny.TOPK
    model = load_model(path, device="cpu")
    model.hparams.index_topk = len(IDS)
    dense = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy()
    rows_dense = np.abs(dense - ref_dense).max(axis=1)
    close, same = float((rows_dense < 0.3).mean()), float((dense.argmax(1) == ref_dense.argmax(1)).mean())
    print(f"{family} q8_0: stored = dense = offloaded = 2 and 3 slots. vs transformers: sparse max |Δlogit| "
          f"{rows.max():.3g} (median {np.median(rows):.3g}, {float((rows < 0.3).mean()):.0%} of rows within 0.3); "
          f"without the selection max {rows_dense.max():.3g} (median {np.median(rows_dense):.3g}), "
          f"rows within 0.3: {close:.0%}, same argmax {same:.0%}")
    assert np.median(rows_dense) < 0.3 and same >= 0.75
