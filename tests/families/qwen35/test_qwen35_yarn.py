"""Qwen3.5 / Qwen3.5-MoE files with scaled rope run scaled: the graph's rope (trunk and MTP block) is
transformers' YaRN or linear scaling on the partial rotary dims (docs/reference/model-math.md §1.3).

Tiny checkpoints (tests/fixtures/tiny_qwen35.py, every tensor redrawn), converted f32, 128 positions:
* dense YaRN: half of each head rotates (rot 8, four frequencies, mrope_section [2, 1, 1]); factor 4,
  original context 256, so the ramp extrapolates the first frequency, interpolates the last and
  blends the two between (1/3, 2/3), and cos/sin carry the attention factor 1 + 0.1·ln 4;
* MoE YaRN: the releases' quarter (rot 4, two frequencies), the second blended half way;
* dense YaRN with the file's own beta_fast / beta_slow / attention_factor (transformers only:
  llama.cpp takes those from its context parameters, not from the file);
* dense linear scaling (factor 2).

Bounds are the other qwen35 parity tests': tests/runtime/test_parity.py against transformers (95 %
of rows within 1e-4, the worst within max(1e-4, 2 x transformers' own batched vs cached
difference); the MTP head, attention only, within 1e-4) and tests/runtime/test_llamacpp.py against
llama.cpp. test_the_scaling_changes_the_logits shows that a graph running these files unscaled fails
those bounds by far.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType
from specconv.runtime.generate import generate
from specconv.runtime.mtp_rows import mtp_rows
from tests.fixtures import hf_reference as ref
from tests.fixtures.hostile import edited, load, refused, rope_scaling_refusals
from tests.fixtures.runtime_common import hf_logits_token_by_token, max_abs, parity, prompt_ids, tiny_gguf


TOL = 1e-4
N_POSITIONS = 128  # half the original context: the interpolated frequencies turn by a radian or more


def _rope(kind: str, rot_fraction: float, sections: list[int], **fields) -> dict:
    return {"rope_type": kind, "rope_theta": 1000.0, "partial_rotary_factor": rot_fraction,
            "mrope_section": sections, "mrope_interleaved": True, **fields}


YARN = {"factor": 4.0, "original_max_position_embeddings": 256}
VARIANTS = {  # name: (moe, rope_parameters)
    "dense-yarn": (False, _rope("yarn", 0.5, [2, 1, 1], **YARN)),
    "moe-yarn": (True, _rope("yarn", 0.25, [1, 1, 0], **YARN)),
    "dense-yarn-fields": (False, _rope("yarn", 0.5, [2, 1, 1], **YARN, beta_fast=8.0, beta_slow=2.0,
                                       attention_factor=1.25)),
    "dense-linear": (False, _rope("linear", 0.5, [2, 1, 1], factor=2.0)),
}
LLAMA_CPP_RUNS = ["dense-yarn", "moe-yarn", "dense-linear"]  # default YaRN fields: llama.cpp's own


def files(tmp_path_factory, variant: str, mtp: str = "embed"):
    """(checkpoint dir, f32 GGUF path(s)) of a variant, converted once per session."""
    moe, rope = VARIANTS[variant]
    return tiny_gguf(tmp_path_factory, moe=moe, mtp=mtp, text_over={"rope_parameters": rope})


def unscaled_copy(src, out):
    """The checkpoint with the same weights and rope_type "default": what an unscaled graph computes."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    rope = cfg["rope_parameters"]
    for field in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"):
        rope.pop(field, None)
    rope["rope_type"] = "default"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def mtp_logits(head, target, ids):
    """Our MTP logits on llama.cpp's rows over our own target hidden states, and those rows."""
    h = Context(target, GraphType.MAIN, n_ctx=len(ids)).decode(ids).hidden["post_norm"]
    toks, rows, pos = mtp_rows(ids, h, "llama.cpp")
    out = Context(head, GraphType.MTP, n_ctx=len(ids)).decode(toks, pos, hidden_in=rows)
    return out.logits, h


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trunk_logits_match_transformers(tmp_path_factory, variant):
    src, path = files(tmp_path_factory, variant)
    model = load(path)
    scaling = model.hparams.rope_scaling  # the file states the scaling the graph must apply
    assert scaling is not None and scaling.kind == VARIANTS[variant][1]["rope_type"]
    ids = prompt_ids(N_POSITIONS)
    ref_batch, ref_steps = ref.hf_logits(src, ids), hf_logits_token_by_token(src, ids)
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids))
    ours = ctx.decode(ids).logits
    ctx.clear()
    steps = np.stack([ctx.decode([t]).logits[0].numpy() for t in ids])
    noise = max_abs(ref_batch, ref_steps)
    worst, p95 = parity(ours, ref_batch, noise, TOL)
    worst_steps, p95_steps = parity(steps, ref_steps, noise, TOL)
    print(f"\n[{variant} vs transformers] {len(ids)} positions: prompt max|Δlogit| {worst:.2e} (p95 {p95:.2e}), "
          f"token-by-token {worst_steps:.2e} (p95 {p95_steps:.2e}); transformers batched vs cached {noise:.2e}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_logits_match_transformers(tmp_path_factory, variant):
    """The MTP block's attention ropes with the same scaling: transformers' MtpModel (which takes the
    trunk's rotary embedding) on llama.cpp's rows over our target hidden states."""
    src, path = files(tmp_path_factory, variant)
    model = load(path)
    ids = prompt_ids(N_POSITIONS)
    ours, h = mtp_logits(model, model, ids)
    reference = ref.hf_mtp_forward(src, *ref.llamacpp_mtp_rows(ids, h.numpy()))[0]
    d = max_abs(ours, reference)
    print(f"\n[{variant} MTP vs transformers] {len(ids)} rows: max|Δlogit| {d:.2e}")
    assert d <= TOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_scaling_changes_the_logits(tmp_path_factory, variant):
    """The fixtures hold the graph to its scaling: transformers on the same weights with unscaled rope
    gives trunk and MTP logits farther from the scaled ones than 10x the parity bounds above."""
    src, path = files(tmp_path_factory, variant)
    plain = unscaled_copy(src, tmp_path_factory.mktemp("unscaled") / "hf")
    ids = prompt_ids(N_POSITIONS)
    scaled = ref.hf_logits(src, ids)
    bound = max(TOL, 2 * max_abs(scaled, hf_logits_token_by_token(src, ids)))
    trunk = max_abs(ref.hf_logits(plain, ids), scaled)
    rows = ref.llamacpp_mtp_rows(ids, ref.hf_hidden_post_norm(src, ids))
    mtp = max_abs(ref.hf_mtp_forward(plain, *rows)[0], ref.hf_mtp_forward(src, *rows)[0])
    print(f"\n[{variant}] unscaled rope moves transformers' logits by {trunk:.3f} (trunk bound {bound:.1e}), "
          f"MTP logits on the same rows by {mtp:.3f} (bound {TOL:.0e})")
    assert trunk > 10 * bound and mtp > 10 * TOL


@pytest.mark.peer
@pytest.mark.parametrize("variant", LLAMA_CPP_RUNS)
def test_logits_match_llama_cpp(tmp_path_factory, variant, llama_peer):
    """The same file in llama.cpp, which applies rope.scaling.* itself: trunk logits (one batch and one
    token at a time, test_llamacpp's rule), greedy tokens, and the MTP head on llama.cpp's rows."""
    _, path = files(tmp_path_factory, variant)
    model = load(path)
    ids = prompt_ids(N_POSITIONS)
    ref_batch = llama_peer.llama_logits(path, ids)
    ref_steps = llama_peer.llama_logits(path, ids, one_by_one=True)
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids))
    ours = ctx.decode(ids).logits
    ctx.clear()
    steps = np.stack([ctx.decode([t]).logits[0].numpy() for t in ids])
    noise = max(max_abs(ref_batch, ref_steps), max_abs(ours, steps))
    ours_tokens, ref_tokens = generate(model, ids[:16], 32).tokens, llama_peer.llama_greedy(path, ids[:16], 32)
    ref_mtp, ref_h, _ = llama_peer.llama_mtp_logits(path, ids, return_hidden=True)
    toks, rows, pos = mtp_rows(ids, torch.as_tensor(ref_h), "llama.cpp")  # llama.cpp's target rows to both
    ours_mtp = Context(model, GraphType.MTP, n_ctx=len(ids)).decode(toks, pos, hidden_in=rows).logits
    d_mtp = max_abs(ours_mtp, ref_mtp)
    print(f"\n[{variant} vs llama.cpp] {len(ids)} positions: prompt max|Δlogit| {max_abs(ours, ref_batch):.2e}, "
          f"token-by-token {max_abs(steps, ref_steps):.2e} (batched vs one-by-one, worst side {noise:.2e}); "
          f"MTP {d_mtp:.2e}; greedy 32 tokens equal: {ours_tokens == ref_tokens}")
    parity(ours, ref_batch, 1.5 * noise)  # test_llamacpp's rule (3x the noise: kernels differ by CPU)
    parity(steps, ref_steps, 1.5 * noise)
    assert d_mtp <= TOL
    assert ours_tokens == ref_tokens


@pytest.mark.peer
def test_sidecar_mtp_head_runs_scaled(tmp_path_factory, llama_peer):
    """A separate MTP file carries the scaling too: its head against llama.cpp's on the same rows."""
    _, (trunk, side) = files(tmp_path_factory, "dense-yarn", mtp="separate")
    head = load(side)
    assert head.hparams.rope_scaling is not None
    assert head.hparams.rope_scaling == load(trunk).hparams.rope_scaling
    ids = prompt_ids(N_POSITIONS)
    ref_mtp, ref_h, _ = llama_peer.llama_mtp_logits(trunk, ids, side, return_hidden=True)
    toks, rows, pos = mtp_rows(ids, torch.as_tensor(ref_h), "llama.cpp")
    d = max_abs(Context(head, GraphType.MTP, n_ctx=len(ids)).decode(toks, pos, hidden_in=rows).logits, ref_mtp)
    print(f"\n[dense-yarn sidecar MTP vs llama.cpp] {len(ids)} rows: max|Δlogit| {d:.2e}")
    assert d <= TOL


@pytest.mark.parametrize("what, edit, words", rope_scaling_refusals("qwen35"))
def test_scaling_the_graph_cannot_run_is_refused(tmp_path_factory, tmp_path, what, edit, words):
    _, path = files(tmp_path_factory, "dense-yarn")
    msg = refused(edited(path, tmp_path / "edited.gguf", edit), *words)
    print(f"\n[{what}] {msg}")
