"""GLM-4.5 (glm4moe) files with YaRN rope run scaled: the graph's rope (trunk and MTP block) is
transformers' Glm4Moe YaRN on the partial rotary dims (docs/reference/model-math.md §1.3).

Tiny release-layout checkpoints (tests/fixtures/tiny_glm_deepseek.py, every tensor redrawn: q/k/v
biases, q/k norms, head_dim 24 with partial rotary 0.5, so rot 12 and six frequencies), converted
f32, 64 positions. Factor 4 and original context 64 put YaRN's ramp over the first three
frequencies (0, 1/3, 2/3) and interpolate the last three:
* "yarn": the default fields; cos/sin carry the attention factor 1 + 0.1·ln 4 (llama.cpp runs it too);
* "yarn-mscale": mscale 0.8 and mscale_all_dim 1.2 with beta_fast 8 / beta_slow 2: transformers'
  attention factor is yarn_mscale(4, 0.8) / yarn_mscale(4, 1.2), which the converter writes as
  rope.scaling.yarn_attn_factor (the file has no mscale key for glm4moe), and the ramp moves.

Bounds are the other glm4moe parity tests' (test_glm_deepseek_runtime.py: 1e-4 for the trunk,
batched and token by token, and for the MTP head on llama.cpp's and transformers' rows).
test_the_scaling_changes_the_logits shows that an unscaled graph fails them by far.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specconv.archs.rope_scaling import yarn_mscale
from specconv.runtime import Context, GraphType
from specconv.runtime.generate import generate
from specconv.runtime.mtp_rows import mtp_rows
from tests.fixtures import mtp_checks
from tests.fixtures import tiny_glm_deepseek as tiny
from tests.fixtures.hostile import edited, load, refused, rope_scaling_refusals
from tests.fixtures.runtime_common import max_abs
from tests.fixtures.tiny_tools import converted_once, logits_token_by_token


TOL = 1e-4
IDS = [int(x) for x in np.random.default_rng(7).integers(0, tiny.VOCAB - 3, 64)]
YARN = {"rope_type": "yarn", "rope_theta": tiny.ROPE_THETA, "partial_rotary_factor": 0.5, "factor": 4.0,
        "original_max_position_embeddings": 64}
VARIANTS = {
    "yarn": YARN,
    "yarn-mscale": {**YARN, "mscale": 0.8, "mscale_all_dim": 1.2, "beta_fast": 8.0, "beta_slow": 2.0},
}
_converted: dict = {}


def files(root, variant: str):
    """(checkpoint dir, {mtp mode: f32 GGUF path}) of a variant, converted once per session."""
    return converted_once(_converted, variant, lambda n: root / f"glm4moe-{variant}",
                          lambda hf: tiny.build_tiny(hf, "glm4moe", rope_parameters=VARIANTS[variant]))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("glmyarn")


def unscaled_copy(src, out):
    """The checkpoint with the same weights and rope_type "default": what an unscaled graph computes."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": tiny.ROPE_THETA, "partial_rotary_factor": 0.5}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def test_the_file_states_transformers_attention_factor(root):
    """mscale / mscale_all_dim reach the file as the attention factor transformers derives from them."""
    _, paths = files(root, "yarn-mscale")
    scaling = load(paths["embed"]).hparams.rope_scaling
    want = yarn_mscale(4.0, 0.8) / yarn_mscale(4.0, 1.2)
    main = tiny.load_hf(files(root, "yarn-mscale")[0])[0]
    hf_factor = main.model.rotary_emb.attention_scaling
    print(f"\n[yarn-mscale] file's yarn_attn_factor {scaling.attn_factor:.6f}, transformers' {hf_factor:.6f}")
    assert scaling.kind == "yarn" and (scaling.beta_fast, scaling.beta_slow) == (8.0, 2.0)
    assert abs(scaling.attn_factor - want) < 1e-6 and abs(hf_factor - want) < 1e-6


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trunk_logits_match_transformers(root, variant):
    src, paths = files(root, variant)
    ref, ref_h = tiny.hf_trunk(src, IDS)
    ref_steps = logits_token_by_token(tiny.load_hf(src)[0], IDS)
    for mode in ("embed", "none"):
        model = load(paths[mode])
        assert model.hparams.rope_scaling is not None and model.hparams.rope_scaling.kind == "yarn"
        ctx = Context(model, GraphType.MAIN, n_ctx=len(IDS))
        out = ctx.decode(IDS)
        ctx.clear()
        steps = torch.cat([ctx.decode([t]).logits for t in IDS])
        d, dh, d_steps = max_abs(out.logits, ref), max_abs(out.hidden["post_norm"], ref_h), max_abs(steps, ref_steps)
        print(f"\n[{variant}, {mode} file vs transformers] {len(IDS)} positions: prompt max|Δlogit| {d:.2e} "
              f"(post-norm hidden {dh:.2e}), token by token {d_steps:.2e}; transformers batched vs cached "
              f"{max_abs(ref, ref_steps):.2e}")
        assert max(d, dh, d_steps) < TOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_logits_match_transformers(root, variant):
    """The nextn block ropes with the same scaling: transformers' MtpModel (the trunk's rotary
    embedding) on llama.cpp's and transformers' rows, embedded head and mtp- sidecar."""
    src, paths = files(root, variant)
    mtp_checks.check_mtp_heads(f"{variant} glm4moe", tiny, src, paths, IDS, tol=TOL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_scaling_changes_the_logits(root, variant):
    """The fixtures hold the graph to its scaling: transformers on the same weights with unscaled rope
    gives trunk and MTP logits farther from the scaled ones than 10x the bounds above."""
    src, _ = files(root, variant)
    plain = unscaled_copy(src, root / f"unscaled-{variant}")
    scaled, h = tiny.hf_trunk(src, IDS)
    trunk = max_abs(tiny.hf_trunk(plain, IDS)[0], scaled)
    mtp = max_abs(tiny.hf_mtp_llamacpp_rows(plain, IDS, h), tiny.hf_mtp_llamacpp_rows(src, IDS, h))
    print(f"\n[{variant}] unscaled rope moves transformers' trunk logits by {trunk:.3f}, MTP logits on the "
          f"same rows by {mtp:.3f} (bound {TOL:.0e})")
    assert trunk > 10 * TOL and mtp > 10 * TOL


@pytest.mark.peer
def test_logits_match_llama_cpp(root, llama_peer):
    """llama.cpp applies the default-field YaRN itself: trunk logits (one batch and one token at a
    time), greedy tokens, and the MTP head on llama.cpp's rows."""
    src, paths = files(root, "yarn")
    path = paths["embed"]
    model = load(path)
    ref_batch = llama_peer.llama_logits(path, IDS)
    ref_steps = llama_peer.llama_logits(path, IDS, one_by_one=True)
    ctx = Context(model, GraphType.MAIN, n_ctx=len(IDS))
    ours = ctx.decode(IDS).logits
    ctx.clear()
    steps = torch.cat([ctx.decode([t]).logits for t in IDS])
    ref_mtp, ref_h, _ = llama_peer.llama_mtp_logits(path, IDS, return_hidden=True)
    toks, rows, pos = mtp_rows(IDS, torch.as_tensor(ref_h), "llama.cpp")  # llama.cpp's target rows to both
    ours_mtp = Context(model, GraphType.MTP, n_ctx=len(IDS)).decode(toks, pos, hidden_in=rows).logits
    ours_tokens, ref_tokens = generate(model, IDS[:16], 24).tokens, llama_peer.llama_greedy(path, IDS[:16], 24)
    d, d_steps, d_mtp = max_abs(ours, ref_batch), max_abs(steps, ref_steps), max_abs(ours_mtp, ref_mtp)
    d_hf = max_abs(ref_batch, tiny.hf_trunk(src, IDS)[0])
    print(f"\n[yarn vs llama.cpp] {len(IDS)} positions: prompt max|Δlogit| {d:.2e}, token by token {d_steps:.2e}, "
          f"MTP {d_mtp:.2e}; llama.cpp vs transformers {d_hf:.2e}; greedy 24 tokens equal: {ours_tokens == ref_tokens}")
    assert max(d, d_steps, d_mtp, d_hf) < TOL
    assert ours_tokens == ref_tokens


@pytest.mark.peer
def test_llama_cpp_reads_no_yarn_fields_for_glm4moe(root, llama_peer):
    """Measured, for docs/glm_deepseek.md: llama.cpp's glm4moe (llama-cpp-python 0.3.36) reads only the
    scaling type, factor and original context; it takes beta_fast / beta_slow from its defaults (32 / 1)
    and recomputes the attention factor (1 + 0.1·ln factor), so on "yarn-mscale" it departs from
    transformers, and from our graph, which equals transformers there (tests above)."""
    src, paths = files(root, "yarn-mscale")
    ref = tiny.hf_trunk(src, IDS)[0]
    ours = Context(load(paths["embed"]), GraphType.MAIN, n_ctx=len(IDS)).decode(IDS).logits
    theirs = llama_peer.llama_logits(paths["embed"], IDS)
    d_llama, d_ours = max_abs(theirs, ref), max_abs(ours, ref)
    print(f"\n[yarn-mscale] llama.cpp vs transformers max|Δlogit| {d_llama:.3f}; ours vs transformers {d_ours:.2e}")
    assert d_ours < TOL < d_llama


@pytest.mark.parametrize("what, edit, words", rope_scaling_refusals("glm4moe"))
def test_scaling_the_graph_cannot_run_is_refused(root, tmp_path, what, edit, words):
    _, paths = files(root, "yarn")
    msg = refused(edited(paths["embed"], tmp_path / "edited.gguf", edit), *words)
    print(f"\n[{what}] {msg}")
