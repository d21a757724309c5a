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

import json
import shutil

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import MtpDrafter, NgramDrafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures import tiny_dsa as tiny
from tests.fixtures.hf_reference import llamacpp_mtp_rows

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
    ctx = Context(model, GraphType.MAIN, n_ctx=64)
    out = ctx.decode(IDS)
    diff = float(np.abs(out.logits.numpy() - ref).max())
    dh = float(np.abs(out.hidden["post_norm"].numpy() - ref_h).max())
    ctx.clear()
    steps = [ctx.decode(IDS[:5]).logits] + [ctx.decode([t]).logits for t in IDS[5:]]
    diff_cached = float(np.abs(torch.cat(steps).numpy() - ref).max())
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
    _, h = tiny.hf_trunk(src, IDS)
    ref_llama_rows = tiny.hf_mtp_llamacpp_rows(src, IDS, h)
    tok_t, pos_t = IDS[1:], list(range(1, len(IDS)))  # transformers' rows (x_{t+1}, h_t) at t+1
    ref_hf_rows = tiny.hf_mtp_forward(src, tok_t, h[:-1], pos_t)[0]
    trunk = load_model(files["none"], device="cpu")
    heads = {"embedded": load_model(files["embed"], device="cpu"),
             "sidecar": load_model(files["only"], device="cpu", share_from=trunk)}
    assert heads["sidecar"].serves == {GraphType.MTP}
    t, rows, pos = llamacpp_mtp_rows(IDS, h)
    for kind, head in heads.items():
        got = Context(head, GraphType.MTP, n_ctx=64).decode(t, pos, hidden_in=torch.tensor(rows)).logits.numpy()
        got_hf = Context(head, GraphType.MTP, n_ctx=64).decode(tok_t, pos_t, hidden_in=torch.tensor(h[:-1]))
        ctx = Context(head, GraphType.MTP, n_ctx=64)  # the head's cache, one row at a time
        one = torch.cat([ctx.decode(t[k:k + 1], pos[k:k + 1], hidden_in=torch.tensor(rows[k:k + 1])).logits
                         for k in range(len(t))]).numpy()
        d1, d3 = float(np.abs(got - ref_llama_rows).max()), float(np.abs(one - ref_llama_rows).max())
        d2 = float(np.abs(got_hf.logits.numpy() - ref_hf_rows).max())
        print(f"{family} runtime MTP ({kind}) vs MtpModel: max |Δlogit| = {d1:.3g} (llama.cpp rows), "
              f"{d3:.3g} (llama.cpp rows one by one), {d2:.3g} (transformers rows)")
        assert max(d1, d2, d3) < 1e-4


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

def _verify(args, tmp_path):
    from click.testing import CliRunner

    from specconv import cli as cli_module

    report = tmp_path / "report.json"
    result = CliRunner().invoke(cli_module.cli, ["verify", *map(str, args), "-n", "6", "--draft-max", "2",
                                                 "--device", "cpu", "--json", str(report)])
    return result.exit_code, json.loads(report.read_text()) if report.exists() else None, result.output


def _plant(path, dst, tensor, fn):
    """Copy a GGUF and rewrite one F32 tensor's bytes in place (same size, so the file stays valid)."""
    from gguf import GGUFReader

    shutil.copy(path, dst)
    reader = GGUFReader(dst, "r+")
    t = next(t for t in reader.tensors if t.name == tensor)
    t.data[...] = fn(np.array(t.data))
    reader.data.flush()
    return dst


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_verify_passes_and_fails_a_perturbed_mtp_indexer(root, family, tmp_path):
    src, files = tiny.converted(family, root)
    code, report, out = _verify([files["embed"], "--hf", src], tmp_path)
    assert code == 0 and report["passed"], out
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["parity: MTP head vs transformers MtpModel"]["passed"]
    print(f"{family} verify (embedded): passed; max |Δlogit| {report['parity']['max_abs_logit_diff']:.3g}")
    code, report, out = _verify([files["none"], "--mtp", files["only"], "--hf", src], tmp_path)
    assert code == 0 and report["passed"], out
    # the nextn block's indexer head weights negated: only the MTP head's key selection changes
    bad = _plant(files["only"], tmp_path / "mtp-bad.gguf", f"blk.{tiny.N_LAYERS}.indexer.proj.weight",
                 lambda a: -a)
    code, report, out = _verify([files["none"], "--mtp", bad, "--hf", src], tmp_path)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    print(f"{family} verify with the MTP indexer's weights negated: exit {code}, failed {failed}")
    assert code != 0 and not report["passed"] and failed == ["parity: MTP head vs transformers MtpModel"]


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_mtp_cache_after_partial_acceptance_equals_fresh_start(root, family):
    """After j of 3 drafts are accepted (rows dropped, catch-up rows written), the head's cache,
    indexer keys included, is the teacher-forced one: its next logits equal a head started afresh."""
    _, files = tiny.converted(family, root)
    target = load_model(files["none"], device="cpu")
    head = load_model(files["only"], device="cpu", share_from=target)
    prompt = IDS[:15]
    for j in (0, 1, 3):
        tctx = Context(target, GraphType.MAIN, n_ctx=64)
        out = tctx.decode(prompt[:-1])
        drafter = MtpDrafter(head, 64, target)
        drafter.start(prompt[:-1], out.hidden["post_norm"])
        batch = [prompt[-1]] + drafter.draft(prompt[-1], 3).tokens
        verified = tctx.decode(batch)
        drafter.accept(j, batch, verified.hidden["post_norm"])
        committed = prompt[:-1] + batch[:j + 1]
        nxt = int(verified.logits[j].argmax())
        fresh_out = Context(target, GraphType.MAIN, n_ctx=64).decode(committed)
        fresh = MtpDrafter(head, 64, target)
        fresh.start(committed, fresh_out.hidden["post_norm"])
        assert drafter.committed_rows() == fresh.committed_rows() == len(committed)
        a = drafter.ctx.decode([nxt], [len(committed)], hidden_in=drafter.pending_h[None]).logits
        b = fresh.ctx.decode([nxt], [len(committed)], hidden_in=fresh.pending_h[None]).logits
        diff = float((a - b).abs().max())
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
