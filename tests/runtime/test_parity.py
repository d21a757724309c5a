"""The runtime, reading nothing but the GGUF file, reproduces transformers (docs/reference/model-math.md §2, §3.1, §7).

f32 files, 64 positions, in each device's default compute dtype (float32 on the CPU, bfloat16 on
CUDA) and in bfloat16 on the CPU. A bfloat16 forward is held to bfloat16's own rounding, measured
(tests/fixtures/runtime_common.py `dtype_parity`): transformers in bfloat16 against transformers in
float32 on the same input and weights; ours against transformers' float32 within a stated multiple
of that, at the 95th percentile and the maximum; a wrong model fails that rule
(test_the_bfloat16_rule_fails_a_wrong_model). In float32: Tiny random Gated DeltaNet models are ill-conditioned (the
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
from specconv.runtime.stored import StoredWeight
from tests.fixtures import hf_reference as ref
from tests.fixtures.runtime_common import (
    DEVICE_DTYPES, dtype_parity, hf_logits_token_by_token, max_abs, parity, prompt_ids, skip_unless_device, tiny_gguf,
)
from tests.fixtures import hf_reference as ref

TOL = 1e-4
CASES = [
    pytest.param(moe, layout, mtp, id=f"{'moe' if moe else 'dense'}-{layout}-{mtp}")
    for moe in (False, True) for layout in ("save_pretrained", "release") for mtp in ("embed", "separate")
]


def _load(paths, mtp, device, dtype=None):
    if mtp == "separate":
        trunk, side = paths
        return load_model(trunk, device=device, dtype=dtype), load_model(side, device=device, dtype=dtype)
    model = load_model(paths, device=device, dtype=dtype)
    return model, model


def _trunk_parity(model, src, ids, label: str) -> None:
    """Prompt logits, token-by-token logits and post-norm hidden states against transformers, under
    the rule of the model's compute dtype."""
    ref_batch = ref.hf_logits(src, ids)
    ref_steps = hf_logits_token_by_token(src, ids)
    ref_hidden = ref.hf_hidden_post_norm(src, ids)
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids))
    out = ctx.decode(ids, hidden=("post_norm",))
    ctx.clear()
    steps = np.stack([ctx.decode([t]).logits[0].float().cpu().numpy() for t in ids])
    noise = max_abs(ref_batch, ref_steps)
    print(f"\n[{label}] {len(ids)} positions: prompt max|Δlogit| {max_abs(out.logits, ref_batch):.2e}, "
          f"token-by-token {max_abs(steps, ref_steps):.2e}, post-norm hidden "
          f"{max_abs(out.hidden['post_norm'], ref_hidden):.2e}; transformers float32 batched vs cached {noise:.2e}")
    dt = model.dtype
    dtype_parity(f"{label} prompt", dt, out.logits, ref_batch, floor=noise,
                 low=lambda: ref.hf_logits(src, ids, dtype=dt))
    dtype_parity(f"{label} token-by-token", dt, steps, ref_steps, floor=noise,
                 low=lambda: hf_logits_token_by_token(src, ids, dt))
    dtype_parity(f"{label} post-norm hidden", dt, out.hidden["post_norm"], ref_hidden, floor=noise,
                 low=lambda: ref.hf_hidden_post_norm(src, ids, dtype=dt))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("moe,layout,mtp", CASES)
def test_trunk_logits_match_transformers(tmp_path_factory, device, dtype, moe, layout, mtp):
    skip_unless_device(device)
    src, paths = tiny_gguf(tmp_path_factory, moe=moe, layout=layout, mtp=mtp)
    model, _ = _load(paths, mtp, device, dtype)
    label = f"{model.kind} {'moe' if moe else 'dense'} {layout} {device}-{dtype or 'default'}"
    _trunk_parity(model, src, prompt_ids(), label)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("moe,layout,mtp", CASES)
def test_mtp_logits_match_transformers_mtpmodel(tmp_path_factory, device, dtype, moe, layout, mtp):
    """The MTP head in isolation: both sides given the same rows; in a 16-bit dtype the rule's noise is
    transformers' MTP block in that dtype on those rows (the MTP block is attention only: well
    conditioned, so float32 holds it to TOL)."""
    skip_unless_device(device)
    src, paths = tiny_gguf(tmp_path_factory, moe=moe, layout=layout, mtp=mtp)
    target, head = _load(paths, mtp, device, dtype)
    assert GraphType.MTP in head.serves
    dt = head.dtype
    ids = prompt_ids()
    main = Context(target, GraphType.MAIN, n_ctx=len(ids)).decode(ids)
    h = main.hidden["post_norm"]
    next_token = int(main.logits[-1].argmax())

    # transformers' rows: (x_{t+1}, h_t) at position t+1, with transformers' own trunk hidden states and
    # next token (as its reference uses), so that the MTP head is compared in isolation
    mtp_ctx = Context(head, GraphType.MTP, n_ctx=len(ids) + 1)
    hf_h = torch.as_tensor(ref.hf_hidden_post_norm(src, ids), device=h.device)
    hf_next = int(ref.hf_logits(src, ids)[-1].argmax())
    if dt == torch.float32:  # a 16-bit trunk may round its last argmax elsewhere
        assert hf_next == next_token
    toks, rows, pos = mtp_rows(ids, hf_h, "transformers", next_token=hf_next)
    label = f"MTP {head.kind} {'moe' if moe else 'dense'} {layout} {device}-{dtype or 'default'}"
    hf_rows = dtype_parity(f"{label} transformers rows", dt, mtp_ctx.decode(toks, pos, hidden_in=rows).logits,
                           ref.hf_mtp_logits_transformers_rows(src, ids), tol=TOL,
                           low=lambda: ref.hf_mtp_logits_transformers_rows(src, ids, dtype=dt))[0]

    # llama.cpp's rows: (x_p, h_{p-1}) at position p, h_{-1} = 0; the same target hidden states fed to both
    mtp_ctx.clear()
    toks, rows, pos = mtp_rows(ids, h, "llama.cpp")
    out = mtp_ctx.decode(toks, pos, hidden_in=rows)
    llama = ref.llamacpp_mtp_rows(ids, h.float().cpu().numpy())
    reference, ref_nextn = ref.hf_mtp_forward(src, *llama)
    llama_rows = dtype_parity(f"{label} llama.cpp rows", dt, out.logits, reference, tol=TOL,
                              low=lambda: ref.hf_mtp_forward(src, *llama, dtype=dt)[0])[0]
    nextn = dtype_parity(f"{label} nextn hidden", dt, out.hidden["nextn"], ref_nextn, tol=TOL,
                         low=lambda: ref.hf_mtp_forward(src, *llama, dtype=dt)[1])[0]
    print(f"\n[{label}] {len(ids)} rows: transformers rows max|Δlogit| {hf_rows:.2e}, llama.cpp rows "
          f"{llama_rows:.2e}, nextn hidden {nextn:.2e}")


# Wrong models, as a converter or runtime bug would make them: (tensor, change of its values)
WRONG = {
    "block 0's input norm without Qwen3.5's (1 + w) shift": ("blk.0.attn_norm.weight", lambda w: w - 1),
    "block 0's Gated DeltaNet output projection 10 % off": ("blk.0.ssm_out.weight", lambda w: w * 1.1),
}


def test_the_bfloat16_rule_fails_a_wrong_model(tmp_path_factory):
    """dtype_parity's bfloat16 rule on the CPU, prompt logits of the dense model: the model as converted
    passes it, each wrong model of WRONG fails it (measured: the wrong ones 4-15x transformers' own
    bfloat16 p95 from its float32 result, the correct one 1.4x)."""
    src, path = tiny_gguf(tmp_path_factory)
    ids = prompt_ids()
    reference = ref.hf_logits(src, ids)

    def low():
        return ref.hf_logits(src, ids, dtype=torch.bfloat16)

    def logits(name=None, change=None):
        model = load_model(path, device="cpu", dtype="bf16")
        if name is not None:
            w = model.weights[name]
            model.weights[name] = change(w.dense(torch.float32) if isinstance(w, StoredWeight) else w.float())
        return Context(model, GraphType.MAIN, n_ctx=len(ids)).decode(ids).logits

    print()
    dtype_parity("as converted", torch.bfloat16, logits(), reference, low=low)
    for label, (name, change) in WRONG.items():
        with pytest.raises(AssertionError, match="transformers' own"):
            dtype_parity(label, torch.bfloat16, logits(name, change), reference, low=low)


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
    n = model.hparams.num_hidden_layers
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
