"""The runtime, reading nothing but the GGUF file, reproduces transformers (docs/reference/model-math.md §2, §3.1, §7).

f32 files, f32 compute, 64 positions. Tiny random Gated DeltaNet models are ill-conditioned (the
gated RMSNorm rescales core outputs of rms down to ~1e-5, bounded only by its ε), so float32
rounding alone moves single logits by up to ~4e-4: transformers' own batched and cached
token-by-token forwards differ by that much, and so does its float64 copy. Each of our paths is
compared with the same path of transformers (prompt evaluation with its batched forward, token-by-
token decoding with its cached one-token forwards); 95 % of the positions must agree within 1e-4
and the worst one within max(1e-4, 2 x transformers' own batched-vs-cached difference). Every
measured number is printed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.mtp_rows import mtp_rows
from tests.fixtures.runtime_common import (
    DEVICES, hf_logits_token_by_token, max_abs, parity, prompt_ids, skip_unless_device, tiny_gguf,
)
from tests.fixtures import hf_reference as ref

TOL = 1e-4
CASES = [
    pytest.param(moe, layout, mtp, id=f"{'moe' if moe else 'dense'}-{layout}-{mtp}")
    for moe in (False, True) for layout in ("save_pretrained", "release") for mtp in ("embed", "separate")
]


def _load(paths, mtp, device):
    if mtp == "separate":
        trunk, side = paths
        return load_model(trunk, device=device), load_model(side, device=device)
    model = load_model(paths, device=device)
    return model, model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("moe,layout,mtp", CASES)
def test_trunk_logits_match_transformers(tmp_path_factory, device, moe, layout, mtp):
    skip_unless_device(device)
    src, paths = tiny_gguf(tmp_path_factory, moe=moe, layout=layout, mtp=mtp)
    model, _ = _load(paths, mtp, device)
    ids = prompt_ids()
    ref_batch = ref.hf_logits(src, ids)
    ref_steps = hf_logits_token_by_token(src, ids)

    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids))
    out = ctx.decode(ids, hidden=("post_norm",))
    ctx.clear()
    steps = np.stack([ctx.decode([t]).logits[0].cpu().numpy() for t in ids])
    noise = max_abs(ref_batch, ref_steps)
    print(f"\n[{model.kind} {'moe' if moe else 'dense'} {layout} {device}] {len(ids)} positions: "
          f"prompt max|Δlogit| {max_abs(out.logits, ref_batch):.2e}, token-by-token {max_abs(steps, ref_steps):.2e}, "
          f"post-norm hidden {max_abs(out.hidden['post_norm'], ref.hf_hidden_post_norm(src, ids)):.2e}; "
          f"transformers batched vs cached {noise:.2e}")
    parity(out.logits, ref_batch, noise)
    parity(steps, ref_steps, noise)
    parity(out.hidden["post_norm"], ref.hf_hidden_post_norm(src, ids), noise)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("moe,layout,mtp", CASES)
def test_mtp_logits_match_transformers_mtpmodel(tmp_path_factory, device, moe, layout, mtp):
    skip_unless_device(device)
    src, paths = tiny_gguf(tmp_path_factory, moe=moe, layout=layout, mtp=mtp)
    target, head = _load(paths, mtp, device)
    assert GraphType.MTP in head.serves
    ids = prompt_ids()
    main = Context(target, GraphType.MAIN, n_ctx=len(ids)).decode(ids)
    h = main.hidden["post_norm"]
    next_token = int(main.logits[-1].argmax())

    # transformers' rows: (x_{t+1}, h_t) at position t+1, with transformers' own trunk hidden states and
    # next token (as its reference uses), so that the MTP head is compared in isolation
    mtp_ctx = Context(head, GraphType.MTP, n_ctx=len(ids) + 1)
    hf_h = torch.as_tensor(ref.hf_hidden_post_norm(src, ids), device=h.device)
    hf_next = int(ref.hf_logits(src, ids)[-1].argmax())
    assert hf_next == next_token
    toks, rows, pos = mtp_rows(ids, hf_h, "transformers", next_token=hf_next)
    hf_rows = max_abs(mtp_ctx.decode(toks, pos, hidden_in=rows).logits, ref.hf_mtp_logits_transformers_rows(src, ids))

    # llama.cpp's rows: (x_p, h_{p-1}) at position p, h_{-1} = 0; the same target hidden states fed to both
    mtp_ctx.clear()
    toks, rows, pos = mtp_rows(ids, h, "llama.cpp")
    out = mtp_ctx.decode(toks, pos, hidden_in=rows)
    reference, ref_nextn = ref.hf_mtp_forward(src, *ref.llamacpp_mtp_rows(ids, h.cpu().numpy()))
    llama_rows = max_abs(out.logits, reference)
    nextn = max_abs(out.hidden["nextn"], ref_nextn)
    print(f"\n[MTP {head.kind} {'moe' if moe else 'dense'} {layout} {device}] {len(ids)} rows: "
          f"transformers rows max|Δlogit| {hf_rows:.2e}, llama.cpp rows {llama_rows:.2e}, nextn hidden {nextn:.2e}")
    assert hf_rows <= TOL and llama_rows <= TOL and nextn <= TOL  # the MTP block is attention only: well conditioned


VARIANTS = [
    pytest.param(dict(tie=True), id="tied-embeddings"),
    pytest.param(dict(nk=4, nv=4), id="nk-equals-nv"),
    pytest.param(dict(nk=2, nv=6, n_layers=6), id="r3-six-layers"),
]


@pytest.mark.parametrize("build", VARIANTS)
def test_config_variants_match_transformers(tmp_path_factory, build):
    """Tied head (no output.weight), no V-head re-tiling (nk = nv), ratio 3 and two attention layers."""
    src, path = tiny_gguf(tmp_path_factory, **build)
    model = load_model(path, device="cpu")
    ids = prompt_ids()
    ref_batch, ref_steps = ref.hf_logits(src, ids), hf_logits_token_by_token(src, ids)
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids))
    batch = ctx.decode(ids).logits
    ctx.clear()
    steps = np.stack([ctx.decode([t]).logits[0].numpy() for t in ids])
    noise = max_abs(ref_batch, ref_steps)
    print(f"\n[variant {build}] has output.weight: {'output.weight' in model.weights}; prompt max|Δlogit| "
          f"{max_abs(batch, ref_batch):.2e}, token-by-token {max_abs(steps, ref_steps):.2e} "
          f"(transformers batched vs cached {noise:.2e})")
    parity(batch, ref_batch, noise)
    parity(steps, ref_steps, noise)


def test_layer_hidden_states_match_transformers(tmp_path_factory):
    """hidden["layer:J"] is the input of block J (HF hidden_states[J]); J = n_layer is the post-norm state."""
    from tests.fixtures.hf_reference import load_hf

    src, path = tiny_gguf(tmp_path_factory)
    model = load_model(path, device="cpu")
    ids = prompt_ids()
    n = model.hparams.n_layer
    out = Context(model, GraphType.MAIN, n_ctx=len(ids)).decode(ids, hidden=("pre_norm",), layers=range(n + 1))
    main, _ = load_hf(src)
    with torch.no_grad():
        hf = main(torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states
        hf64 = ref.load_hf_float64(src)(torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states
    diffs = [max_abs(out.hidden[f"layer:{j}"], hf[j][0]) for j in range(n + 1)]
    floors = [max_abs(hf[j][0], hf64[j][0]) for j in range(n + 1)]
    print(f"\n[layer hidden states] max|Δ| per layer input 0..{n}: " + ", ".join(f"{d:.1e}" for d in diffs)
          + "; transformers f32 vs its f64 copy: " + ", ".join(f"{d:.1e}" for d in floors))
    assert diffs[0] == 0.0  # the embedding row itself
    for j in range(1, n + 1):
        parity(out.hidden[f"layer:{j}"], hf[j][0].numpy(), floors[j])
    assert "pre_norm" in out.hidden and "post_norm" not in out.hidden
