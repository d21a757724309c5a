"""Chained MTP heads (several MTP blocks, block i drafting position i) on tiny release-layout
checkpoints of each family, converted by `specconv convert --outtype f32`:

* the files of every --mtp mode: block counts, one `blk.{N+j}.nextn.*` set per block, sidecar layout;
* our runtime vs transformers: trunk logits and greedy tokens; every MTP block's logits on
  llama.cpp's teacher-forced rows (each block judged alone);
* the chained draft block by block against the training recursion: tests/families/chained/test_chained_draft.py;
* greedy speculative decoding equals plain greedy; drafts are capped at k (llama.cpp's n_max);
  acceptance is reported by draft position and by block;
* llama.cpp (llama-cpp-python 0.3.36) loads our files, its trunk logits agree, the MTP context
  builds, and every block's logits agree (llama_set_nextn_layer_offset); its draft-mtp chain agrees
  with ours (in llama.cpp's rows) on the first block and departs from the recursion on later ones;
* `specconv verify --hf` passes, and fails a file in which one block other than the first was
  perturbed.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import MtpDrafter
from specconv.runtime.drafters.mtp import block_view
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures import chained_reference as ref_mod
from tests.fixtures import tiny_chained as tiny

torch.set_num_threads(1)
FAMILIES = ["hy_v3", "step35", "mimo2"]
IDS = [int(x) for x in np.random.default_rng(11).integers(0, tiny.VOCAB - 3, 24)]
TOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("chained")


def _family(family, root):
    src, files = ref_mod.converted(family, root)
    return src, files, ref_mod.reference(src, family), tiny.K_MTP[family]


def _rows(h: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros((1, h.shape[1]), np.float32), h[:-1]])


@pytest.mark.parametrize("family", FAMILIES)
def test_files_in_every_mtp_mode(root, family):
    from specconv.runtime.gguf_reader import open_gguf

    src, files, _, k = _family(family, root)
    n = tiny.N_LAYERS
    emb, none, only = (open_gguf(files[m]) for m in ("embed", "none", "only"))
    sep, side = open_gguf(files["separate"]), open_gguf(files["mtp-separate"])
    assert emb.block_count() == n + k and emb.nextn_layers() == k
    assert none.block_count() == n and none.get(f"{family}.nextn_predict_layers") is None
    mtp = {x for x in emb.tensors if x.startswith("blk.") and int(x.split(".")[1]) >= n}
    for j in range(k):
        for part in ("eh_proj", "enorm", "hnorm"):
            assert f"blk.{n + j}.nextn.{part}.weight" in emb.tensors
    assert set(none.tensors) == set(emb.tensors) - mtp
    shared = {"token_embd.weight", "output_norm.weight", "output.weight"}
    assert set(only.tensors) == mtp | shared and not any(x.startswith("blk.0.") for x in only.tensors)
    assert set(sep.tensors) == set(none.tensors) and set(side.tensors) == set(only.tensors)
    print(f"{family}: {len(emb.tensors)} tensors embedded, {len(mtp)} in {k} MTP blocks")


@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_trunk_and_greedy_equal_transformers(root, family):
    src, files, ref, _ = _family(family, root)
    lg, h = ref.trunk(IDS)
    model = load_model(files["embed"], device="cpu")
    want = tiny.FAMILIES[family].target + "_norm"  # the rows the MTP head reads: post- or pre-norm
    out = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS, hidden=(want,))
    d = float(np.abs(out.logits.numpy() - lg).max())
    dh = float(np.abs(out.hidden[want].numpy() - h).max())
    ours = generate(model, IDS, 8).tokens
    theirs = ref.greedy(IDS, 8)
    print(f"{family} runtime trunk vs transformers: max |Δlogit| {d:.3g}, {want} hidden {dh:.3g}; "
          f"greedy {ours} == {theirs}")
    assert d < TOL and dh < TOL and ours == theirs


@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_every_block_equals_transformers(root, family):
    src, files, ref, k = _family(family, root)
    _, h = ref.trunk(IDS)
    head = load_model(files["embed"], device="cpu")
    diffs = []
    for j in range(k):
        ours = Context(block_view(head, j), GraphType.MTP, n_ctx=64).decode(IDS, list(range(len(IDS))),
                                                                           hidden_in=torch.from_numpy(_rows(h)))
        theirs, _, _ = ref.block(j, IDS, _rows(h), range(len(IDS)))
        diffs.append(float(np.abs(ours.logits.numpy() - theirs).max()))
    # control: block 1 is not block 0 (a drafter reusing block 0 would be caught)
    other, _, _ = ref.block(0, IDS, _rows(h), range(len(IDS)))
    ours1 = Context(block_view(head, 1), GraphType.MTP, n_ctx=64).decode(IDS, list(range(len(IDS))),
                                                                        hidden_in=torch.from_numpy(_rows(h)))
    control = float(np.abs(ours1.logits.numpy() - other).max())
    print(f"{family} runtime MTP blocks vs transformers MtpLayer: max |Δlogit| per block {[f'{x:.3g}' for x in diffs]}; "
          f"block 1 vs block 0's reference {control:.3g}")
    assert max(diffs) < TOL and control > 0.1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_greedy_speculation_equals_plain_and_reports_blocks(root, family, rollback):
    src, files, _, k = _family(family, root)
    model = load_model(files["embed"], device="cpu")
    plain = generate(model, IDS[:10], 12).tokens
    res = speculative_generate(model, MtpDrafter(model, 64, model), IDS[:10], 12,
                               SpecConfig(draft_max=k + 2, rollback=rollback))
    s = res.stats["speculative"]
    blocks = s["per_block"]
    print(f"{family} ({rollback}): spec == plain {res.tokens == plain}; drafted {s['drafted']}, accepted "
          f"{s['accepted']}; per position {s['per_position']}; per block "
          f"{[(b['block'], b['accepted'], b['drafted']) for b in blocks]}")
    assert res.tokens == plain
    assert max(len(r["drafted"]) for r in res.stats["rounds"]) == k  # capped at the block count
    assert [b["block"] for b in blocks] == list(range(k))
    assert [b["drafted"] for b in blocks] == s["per_position_drafted"][:k]
    assert sum(b["accepted"] for b in blocks) == s["accepted"]


@pytest.mark.parametrize("family", FAMILIES)
def test_sidecar_drafts_like_the_embedded_file(root, family):
    src, files, _, k = _family(family, root)
    target = load_model(files["none"], device="cpu")
    head = load_model(files["mtp-separate"], device="cpu", share_from=target)
    emb = load_model(files["embed"], device="cpu")
    a = speculative_generate(target, MtpDrafter(head, 64, target), IDS[:10], 10, SpecConfig(draft_max=k))
    b = speculative_generate(emb, MtpDrafter(emb, 64, emb), IDS[:10], 10, SpecConfig(draft_max=k))
    assert a.tokens == b.tokens and a.stats["rounds"] == b.stats["rounds"]


# ------------------------------------------------------------------ llama.cpp


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_loads_our_files_and_agrees(root, family, llama_peer):
    src, files, ref, k = _family(family, root)
    lg, h = ref.trunk(IDS)
    trunk = float(np.abs(llama_peer.llama_logits(files["embed"], IDS) - lg).max())
    trunk_only = float(np.abs(llama_peer.llama_logits(files["none"], IDS) - lg).max())
    assert llama_peer.llama_mtp_context_ok(files["embed"])
    assert llama_peer.llama_mtp_context_ok(files["none"], files["mtp-separate"])
    blocks = []
    for j in range(k):
        theirs, _, _ = ref.block(j, IDS, _rows(h), range(len(IDS)))
        blocks.append(float(np.abs(ref_mod.llama_block_logits(files["embed"], IDS, h, j) - theirs).max()))
    side = float(np.abs(ref_mod.llama_block_logits(files["none"], IDS, h, 0, files["mtp-separate"])
                        - ref.block(0, IDS, _rows(h), range(len(IDS)))[0]).max())
    print(f"{family} llama.cpp on our f32 files vs transformers: trunk {trunk:.3g} (trunk-only file {trunk_only:.3g}); "
          f"MTP blocks {[f'{x:.3g}' for x in blocks]}; block 0 from the sidecar {side:.3g}")
    assert max(trunk, trunk_only, side, *blocks) < TOL


# ------------------------------------------------------------------ verify


def _verify(args, tmp_path):
    from click.testing import CliRunner

    from specconv import cli as cli_module

    report = tmp_path / "report.json"
    result = CliRunner().invoke(cli_module.cli, ["verify", *map(str, args), "-n", "6", "--draft-max", "3",
                                                 "--device", "cpu", "--report", str(report)])
    return result.exit_code, json.loads(report.read_text()) if report.exists() else None, result.output


def _perturb(path, dst, tensor):
    from gguf import GGUFReader

    shutil.copy(path, dst)
    reader = GGUFReader(dst, "r+")
    t = next(t for t in reader.tensors if t.name == tensor)
    t.data[...] = np.array(t.data) + 0.5 * np.random.default_rng(0).standard_normal(t.data.shape).astype(np.float32)
    reader.data.flush()
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_passes_and_fails_a_perturbed_later_block(root, family, tmp_path):
    src, files, _, k = _family(family, root)
    code, report, out = _verify([files["embed"], "--hf", src], tmp_path)
    assert code == 0, out
    blocks = report["parity"]["mtp_blocks"]
    assert len(blocks) == k and report["speculative"]["per_block"][0]["block"] == 0
    bad = _perturb(files["embed"], tmp_path / "bad.gguf", f"blk.{tiny.N_LAYERS + 1}.nextn.eh_proj.weight")
    code_bad, report_bad, _ = _verify([bad, "--hf", src], tmp_path)
    failed = [c["name"] for c in report_bad["checks"] if not c["passed"]]
    print(f"{family} verify: passed, MTP blocks max |Δlogit| {[f'{x:.3g}' for x in blocks]}; with block 1's "
          f"eh_proj perturbed: exit {code_bad}, failed {failed}")
    assert code_bad != 0 and failed == ["parity: MTP block 1 vs transformers"]


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_extract_and_merge_move_every_block(root, family, tmp_path):
    """`specconv mtp extract` of the embedded file is the converter's sidecar and `merge` of the
    trunk-only file with it is the embedded file, byte for byte: all k blocks move together."""
    from click.testing import CliRunner

    from specconv import cli as cli_module

    src, files, _, k = _family(family, root)
    run = lambda *a: CliRunner().invoke(cli_module.cli, ["mtp", *map(str, a)], catch_exceptions=False)  # noqa: E731
    side, merged = tmp_path / "mtp-x.gguf", tmp_path / "merged.gguf"
    assert run("extract", files["embed"], "-o", side).exit_code == 0
    assert run("merge", files["none"], side, "-o", merged).exit_code == 0
    assert side.read_bytes() == files["only"].read_bytes()
    assert merged.read_bytes() == files["embed"].read_bytes()


@pytest.mark.parametrize("family", ["hy_v3", "step35"])
def test_llama_cpp_chain_agrees_on_the_first_block_only(root, family, llama_peer):
    """llama.cpp's draft-mtp chain (chain_heads) on the same file: its first block is block 0 of the
    recursion in llama.cpp's rows (ours with layout "llama.cpp": same draft, logits within float32
    noise); its later blocks read the target's states at committed positions where the releases'
    recursion reads the previous block's outputs, so their logits depart (printed, docs/mtp.md).
    (mimo2: llama.cpp feeds and chains pre-norm states where the release uses post-norm ones.)"""
    src, files, _, k = _family(family, root)
    ids = IDS[:16]
    id_last, theirs, their_logits = ref_mod.llama_chained_draft(files["embed"], ids, k + 2)
    model = load_model(files["embed"], device="cpu")
    drafter = MtpDrafter(model, 64, model, layout="llama.cpp")
    hid = drafter.target_hidden[0]
    out = Context(model, GraphType.MAIN, n_ctx=64).decode(ids, hidden=(hid,))
    assert int(out.logits[-1].argmax()) == id_last
    drafter.start(ids, out.hidden[hid])
    ours = drafter.draft(id_last, k + 2).tokens
    diff = np.abs(torch.stack(drafter.last_draft_logits).numpy() - their_logits).max(axis=1)
    print(f"{family}: drafts ours {ours}, llama.cpp's {theirs} (capped at {k}); max |Δlogit| per block "
          f"{[f'{x:.2g}' for x in diff]}")
    assert len(theirs) == len(ours) == k and ours[0] == theirs[0] and diff[0] < TOL and diff[1:].max() > 0.01
