"""DFlash drafters (z-lab `DFlashDraftModel` layout) for qwen3, qwen3moe, qwen35 and llama targets.

* conversion: the same tensors (names, order, types, bytes) and KV pairs as llama.cpp's converter
  (`--target-model-dir`), target ids written + 1;
* llama.cpp (llama-cpp-python) loads our file, builds its draft context next to the target and, fed
  the target's layer outputs, gives the independent float64 reference's block logits
  (tests/fixtures/tiny_dflash.py, written from the architecture description);
* the runtime's drafter, reading the target's layer inputs from our runtime, gives the reference's
  logits and drafts; speculative greedy output equals plain greedy (snapshot and checkpoint
  rollback) and its memory after partial acceptances equals a fresh start;
* bad pairs fail with one-line errors.
DFlash2 drafters: tests/families/dflash/test_dflash2.py; `specconv verify` with a DFlash draft: tests/families/dflash/test_dflash_verify.py.
Every measured difference is printed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specconv import cli
from specconv.archs import Checkpoint, SourceTensor, SpecconvError, plugin_class_for
from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters.dflash import DFlashDrafter
from specconv.runtime.generate import generate
from specconv.runtime.gguf_reader import open_gguf
from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate
from tests.fixtures import tiny_dflash as tiny
from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream
from tests.fixtures.tiny_qwen3 import gguf_contents as _read

torch.set_num_threads(1)
TOL = 1e-4
IDS, MASK, TARGETS, built, max_abs = tiny.IDS, tiny.MASK, tiny.TARGETS, tiny.built, tiny.max_abs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash")


# ------------------------------------------------------------------ conversion


@pytest.mark.parametrize("kind", list(TARGETS))
def test_conversion_matches_llama_cpp_converter(root, kind, tmp_path):
    t_dir, _, d_dir, ours = built(root, kind)
    if kind == "qwen3moe":  # llama.cpp's converter fails on a Qwen3-MoE target (docs/dflash.md); ours does not
        with pytest.raises(AssertionError, match="super\\(type, obj\\): obj must be an instance or subtype"):
            convert_gguf_upstream(d_dir, tmp_path / "theirs.gguf", pre="qwen2",
                                  extra_args=["--target-model-dir", str(t_dir)])
        assert open_gguf(ours).arch == "dflash"
        return
    theirs = convert_gguf_upstream(d_dir, tmp_path / "theirs.gguf", pre=TARGETS[kind][0],
                                   extra_args=["--target-model-dir", str(t_dir)])
    kv_a, t_a = _read(ours)
    kv_b, t_b = _read(theirs)
    assert [t[:3] for t in t_a] == [t[:3] for t in t_b]
    assert all(a[3] == b[3] for a, b in zip(t_a, t_b))
    assert kv_a == kv_b
    # placements that differ (docs/dflash.md): upstream appends the mask token after the tokenizer keys;
    # for M-RoPE targets the engine puts general.file_type after the draft's rope.dimension_sections
    mask, moved = "tokenizer.ggml.mask_token_id", {"tokenizer.ggml.mask_token_id", "general.file_type"}
    skip = moved if kind == "qwen35" else {mask}
    assert [k for k in kv_a if k not in skip] == [k for k in kv_b if k not in skip]
    if kind == "qwen35":
        assert list(kv_a["dflash.rope.dimension_sections"]) == [8, 0, 0, 0]  # head_dim 16 / 2: temporal only
    assert list(kv_a["dflash.target_layers"]) == [i + 1 for i in TARGETS[kind][1]]
    assert kv_a[mask] == MASK and kv_a["dflash.block_size"] == 8
    print(f"\n[dflash for {kind}] {len(t_a)} tensors, {len(kv_a)} KV pairs identical to llama.cpp's converter")


def test_plugin_reads_both_block_size_spellings_and_target_layers_override(root, tmp_path):
    t_dir, _, _, _ = built(root, "qwen3")
    d = tiny.build_dflash(tmp_path / "d", t_dir, layer_ids=[0, 2, 4], block_size=4, block_size_in="dflash_config")
    f = open_gguf(convert_gguf(d, tmp_path / "a.gguf", extra_args=["--target", str(t_dir)]))
    assert f.get("dflash.block_size") == 4 and list(f.get("dflash.target_layers")) == [1, 3, 5]
    f = open_gguf(convert_gguf(d, tmp_path / "b.gguf", extra_args=["--target", str(t_dir), "--target-layers", "2,3,6"]))
    assert list(f.get("dflash.target_layers")) == [2, 3, 6]


def _plugin(d_dir, t_dir, cfg_edit=None, target_edit=None):
    from safetensors.torch import load_file

    cfg = {**json.loads((d_dir / "config.json").read_text()), **(cfg_edit or {})}
    tcfg = {**json.loads((t_dir / "config.json").read_text()), **(target_edit or {})}
    cls = plugin_class_for(cfg)
    tensors = {k: SourceTensor(k, tuple(v.shape), "F32") for k, v in load_file(str(d_dir / "model.safetensors")).items()}
    return cls(Checkpoint(cfg, tensors, target_config=tcfg, target_dir=str(t_dir)))


@pytest.mark.parametrize("edit,target_edit,message", [
    ({"architectures": ["DFlash2DraftModel"]}, None, "lacks dflash_config.conv_kernel_size"),
    (None, {"hidden_size": 96}, "hidden size 64 differs"),
    (None, {"vocab_size": 600}, "vocabulary of 512"),
    (None, {"num_hidden_layers": 4}, "outside 0..4"),
    ({"dflash_config": {"mask_token_id": MASK}}, None, "target_layer_ids"),
    ({"dflash_config": {"target_layer_ids": [0, 2, 4]}}, None, "mask_token_id"),
    ({"block_size": 1}, None, "block_size 1"),
])
def test_bad_drafters_fail_with_one_line(root, edit, target_edit, message):
    t_dir, _, d_dir, _ = built(root, "qwen3")
    with pytest.raises(SpecconvError, match=message) as exc:
        _plugin(d_dir, t_dir, edit, target_edit).tensor_plan()
    assert "\n" not in str(exc.value)


def test_conversion_needs_target(root):
    _, _, d_dir, _ = built(root, "qwen3")
    cfg = json.loads((d_dir / "config.json").read_text())
    with pytest.raises(SpecconvError, match="--target"):
        plugin_class_for(cfg)(Checkpoint(cfg, {}))


# ------------------------------------------------------------------ llama.cpp


def _llama_block_logits(peers, t_gguf, d_gguf, features, block, pos0):
    """llama.cpp's draft context next to the target: feature rows at 0..m-1, the block decoded
    non-causally at pos0.. (tests/fixtures/peers.py `llama_dflash_block`); its logits rows."""
    return peers.llama_dflash_block(t_gguf, d_gguf, tiny.as_numpy(features), block, pos0)


@pytest.mark.peer
@pytest.mark.parametrize("kind", list(TARGETS))
def test_llama_cpp_and_runtime_match_the_reference(root, kind, llama_peer):
    t_dir, t_gguf, d_dir, d_gguf = built(root, kind)
    layer_ids = TARGETS[kind][1]
    prefix, id_last, n_draft = IDS[:-1], IDS[-1], 7
    T = tiny.load_target(t_dir)
    ref_drafts, ref = tiny.reference_drafts(d_dir, T, prefix, id_last, n_draft, layer_ids, MASK)
    hf_feats = tiny.target_features(T, prefix, layer_ids)
    block = [id_last] + [MASK] * n_draft
    ll = _llama_block_logits(llama_peer, t_gguf, d_gguf, hf_feats, block, len(prefix))

    target = load_model(t_gguf, device="cpu")
    drafter = DFlashDrafter(load_model(d_gguf, device="cpu", share_from=target), target, 64, n_draft)
    out = Context(target, GraphType.MAIN, n_ctx=64).decode(prefix, hidden=drafter.target_hidden)
    feats = torch.cat([out.hidden[n] for n in drafter.target_hidden], -1)
    d_feats = max_abs(feats, hf_feats)
    drafter.start(prefix, feats)
    ours = drafter.block_logits(id_last)
    ours_drafts = drafter.draft(id_last, n_draft).tokens
    print(f"\n[dflash over {kind}] block of {len(block)}: max|Δlogit| llama.cpp vs reference {max_abs(ll, ref):.2e}, "
          f"runtime vs reference {max_abs(ours, ref):.2e}, runtime vs llama.cpp {max_abs(ours, ll):.2e}; target "
          f"features runtime vs transformers {d_feats:.2e}; drafts equal: {ours_drafts == ref_drafts}")
    assert max_abs(ll, ref) <= TOL and max_abs(ours, ref) <= TOL
    assert ours_drafts == ref_drafts == [int(x) for x in ll[1:].argmax(-1)]


# ------------------------------------------------------------------ speculative decoding


@pytest.mark.parametrize("kind", list(TARGETS))
@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_speculative_greedy_equals_plain(root, kind, rollback):
    _, t_gguf, _, d_gguf = built(root, kind)
    target = load_model(t_gguf, device="cpu")
    prompt, n = IDS[:8], 24
    plain = generate(target, prompt, n).tokens
    drafter = build_drafter("dflash", target, n_ctx=64, draft_max=5, draft_path=d_gguf)
    res = speculative_generate(target, drafter, prompt, n, SpecConfig(draft_max=5, rollback=rollback))
    s = res.stats["speculative"]
    print(f"\n[--spec dflash over {kind}, {rollback}] {s['accepted']}/{s['drafted']} accepted; equal to plain greedy: "
          f"{res.tokens == plain}")
    assert res.tokens == plain and s["drafted"] > 0 and drafter.n_committed == len(prompt) + n - 1


def test_memory_after_partial_acceptances_equals_fresh_start(root):
    """Rounds that keep 0..n of the drafts leave the drafter's cache equal to one built from scratch
    on the committed tokens (same block logits), whatever the acceptance pattern."""
    _, t_gguf, _, d_gguf = built(root, "qwen3")
    target = load_model(t_gguf, device="cpu")
    head = load_model(d_gguf, device="cpu", share_from=target)
    drafter = DFlashDrafter(head, target, 64, 4)
    want = drafter.target_hidden
    ctx = Context(target, GraphType.MAIN, n_ctx=64, n_rs_seq=4)
    prompt = IDS[:6]

    def rows(out):
        return torch.cat([out.hidden[n] for n in want], -1)

    drafter.start(prompt[:-1], rows(ctx.decode(prompt[:-1], hidden=want)))
    id_last, committed = prompt[-1], list(prompt[:-1])
    for keep in (0, 3, 1, 4, 2):
        drafts = drafter.draft(id_last, 4).tokens
        batch = [id_last] + drafts
        pos0 = ctx.n_past()
        out = ctx.decode(batch, hidden=want)
        assert ctx.seq_rm(0, pos0 + keep + 1)
        drafter.accept(keep, batch, rows(out))
        committed += batch[:keep + 1]
        id_last = int(np.random.default_rng(keep).integers(0, 509))
    fresh = DFlashDrafter(head, target, 64, 4)
    fresh.start(committed, rows(Context(target, GraphType.MAIN, n_ctx=64).decode(committed, hidden=want)))
    d = max_abs(drafter.block_logits(id_last), fresh.block_logits(id_last))
    print(f"\n[dflash memory] after acceptances 0,3,1,4,2: block logits vs a fresh start max|Δ| {d:.2e}")
    assert drafter.n_committed == fresh.n_committed == len(committed) and d <= 1e-5


def test_sampling_and_p_min(root):
    _, t_gguf, _, d_gguf = built(root, "qwen3")
    target = load_model(t_gguf, device="cpu")
    plain = generate(target, IDS[:8], 16, temperature=0.8, seed=3)
    drafter = build_drafter("dflash", target, n_ctx=64, draft_max=4, draft_path=d_gguf)
    res = speculative_generate(target, drafter, IDS[:8], 16, SpecConfig(draft_max=4, temperature=0.8, seed=3))
    assert len(res.tokens) == 16 and res.stats["speculative"]["drafted"] > 0
    assert plain.tokens  # the sampled run completes; its distribution is the loop's business (spec_rules)
    d = drafter.draft(IDS[3], 4, p_min=1.0)  # no candidate reaches probability 1
    assert d.tokens == []


def test_cli_generate_spec_dflash(root):
    _, t_gguf, _, d_gguf = built(root, "qwen3")

    def run(*args):
        res = CliRunner().invoke(cli.cli, ["generate", str(t_gguf), "--tokens", ",".join(map(str, IDS[:8])), "-n", "12",
                                           "--json", "--device", "cpu", *args], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout.strip().splitlines()[-1])

    plain = run()
    spec = run("--spec", "dflash", "--draft", str(d_gguf), "--draft-max", "20")  # capped at block_size - 1
    assert spec["tokens"] == plain["tokens"] and spec["speculative"]["drafter"] == "dflash"


def test_drafter_refuses_another_target(root):
    _, t_gguf, _, d_gguf = built(root, "qwen3")
    _, other, _, _ = built(root, "qwen35")  # 4 layers: layer input 5 does not exist
    target = load_model(other, device="cpu")
    with pytest.raises(SpecconvError, match="target layer input 5"):
        build_drafter("dflash", target, n_ctx=64, draft_max=4, draft_path=d_gguf)
    with pytest.raises(SpecconvError, match="not a DFlash drafter"):
        build_drafter("dflash", target, n_ctx=64, draft_max=4, draft_path=t_gguf)


def test_mask_embedding_drafts_are_refused(root, tmp_path):
    import shutil

    t_dir, _, d_dir, _ = built(root, "qwen3")
    d = tmp_path / "d"
    shutil.copytree(d_dir, d)
    (d / "mask_embedding.pt").write_bytes(b"")
    with pytest.raises(SpecconvError, match="mask_embedding.pt"):
        convert_gguf(d, tmp_path / "x.gguf", extra_args=["--target", str(t_dir)])


def test_trained_drafter_is_accepted_and_drafts_like_the_reference(root, tmp_path):
    """A drafter trained briefly (tests/fixtures/tiny_dflash.train_dflash) in the reference's
    conventions — transformers' hidden_states[id + 1], the block at the positions after the context —
    is accepted about half the time when run from its GGUF in the runtime (the converted target layers
    and the block positions line up; a random drafter: never), with partial rounds; every round's drafts equal the reference's
    drafts on the same committed tokens, and the output equals plain greedy."""
    from specconv.runtime.speculative import Round

    t_dir, t_gguf, _, _ = built(root, "qwen3")
    d_dir = tiny.build_dflash(tmp_path / "trained", t_dir, layer_ids=TARGETS["qwen3"][1], mask_token_id=MASK)
    info = tiny.train_dflash(d_dir, t_dir, steps=200, n_seq=4)
    d_gguf = convert_gguf(d_dir, tmp_path / "trained.gguf", extra_args=["--target", str(t_dir)])
    target, T = load_model(t_gguf, device="cpu"), tiny.load_target(t_dir)
    accepted = drafted = compared = 0
    partial = False
    for seq in info["sequences"][:2]:
        prompt, n = seq[:6], 28
        rounds: list[Round] = []
        drafter = build_drafter("dflash", target, n_ctx=64, draft_max=7, draft_path=d_gguf)
        res = speculative_generate(target, drafter, prompt, n, SpecConfig(draft_max=7),
                                   on_round=lambda ctx, r: rounds.append(r))
        assert res.tokens == generate(target, prompt, n).tokens
        full = prompt + res.tokens
        for r in rounds:
            if r.drafts:
                ref, _ = tiny.reference_drafts(d_dir, T, full[:r.pos0], full[r.pos0], 7, TARGETS["qwen3"][1], MASK)
                assert r.drafts == ref[:len(r.drafts)], f"round at {r.pos0}"
                compared += 1
            partial |= 0 < r.accepted < len(r.drafts)
        s = res.stats["speculative"]
        accepted, drafted = accepted + s["accepted"], drafted + s["drafted"]
    print(f"\n[trained dflash over qwen3] training loss {info['loss'][0]:.2f} -> {info['loss'][1]:.2f}; "
          f"{accepted}/{drafted} drafts accepted; {compared} rounds' drafts equal the reference's")
    assert accepted / drafted > 0.25 and partial


def test_q8_0_target_and_drafter(root, tmp_path):
    """Quantized files (weights kept in Q8_0, the target's embedding and head borrowed packed)."""
    t_dir, _, d_dir, _ = built(root, "qwen3")
    t_q8 = convert_gguf(t_dir, tmp_path / "t.gguf", outtype="q8_0")
    d_q8 = convert_gguf(d_dir, tmp_path / "d.gguf", outtype="q8_0", extra_args=["--target", str(t_dir)])
    target = load_model(t_q8, device="cpu")
    plain = generate(target, IDS[:8], 16).tokens
    drafter = build_drafter("dflash", target, n_ctx=64, draft_max=5, draft_path=d_q8)
    res = speculative_generate(target, drafter, IDS[:8], 16, SpecConfig(draft_max=5))
    assert res.tokens == plain and res.stats["speculative"]["drafted"] > 0


def test_one_token_prompt_drafts_without_context(root):
    """A one-token prompt leaves no committed position before id_last: the block attends to itself only."""
    _, t_gguf, _, d_gguf = built(root, "qwen3")
    target = load_model(t_gguf, device="cpu")
    drafter = build_drafter("dflash", target, n_ctx=64, draft_max=4, draft_path=d_gguf)
    res = speculative_generate(target, drafter, IDS[:1], 10, SpecConfig(draft_max=4))
    assert res.tokens == generate(target, IDS[:1], 10).tokens and res.stats["speculative"]["drafted"] > 0


def test_runtime_refuses_variants_it_does_not_implement(root):
    """Tensors llama.cpp's dflash graph would use (post norms, output scales, sinks, d2t, DSpark heads,
    shared K/V) make the runtime refuse the file with one line instead of ignoring them."""
    from pathlib import Path

    from specconv.runtime.graphs import dflash as graph

    _, _, _, d_gguf = built(root, "qwen3")
    hp = load_model(d_gguf, device="cpu", share_from=load_model(built(root, "qwen3")[1], device="cpu")).hparams

    class File:
        paths = [Path("x.gguf")]

        def __init__(self, extra=(), drop=()):
            self.extra, self.drop = set(extra), set(drop)

        def has(self, name):
            return name in self.extra or (name.startswith("blk.0.attn_v") and not self.drop)

    assert graph.serves(hp, File()) == {GraphType.MTP}
    for name in ("blk.0.post_attention_norm.weight", "d2t", "markov_w1.weight", "blk.0.attn_sinks.weight"):
        with pytest.raises(SpecconvError, match=name.replace(".", r"\.")):
            graph.serves(hp, File(extra=[name]))
    with pytest.raises(SpecconvError, match="shared K/V"):
        graph.serves(hp, File(drop=["attn_v"]))


def test_the_converted_pair_is_built_again_once_its_first_root_is_gone(tmp_path):
    """tiny_dflash.built caches a process's pair under the first caller's root; pytest removes a passed
    test's tmp_path, so a later caller gets the pair built again under its own root, not paths to
    removed files (a test of tests/verify reaching `built` first on an xdist worker did that)."""
    import shutil
    from pathlib import Path

    saved = tiny._built.pop("qwen3", None)
    try:
        first = built(tmp_path / "first", "qwen3")
        shutil.rmtree(tmp_path / "first")
        again = built(tmp_path / "second", "qwen3")
        assert all(Path(p).exists() for p in again) and all(tmp_path / "second" in Path(p).parents for p in again)
        assert [Path(p).name for p in again] == [Path(p).name for p in first]
    finally:
        if saved is not None and all(Path(p).exists() for p in saved):
            tiny._built["qwen3"] = saved
