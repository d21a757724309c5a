"""Gemma 4 MAIN graph (GGUF arch `gemma4`), docs/reference/model-math.md §1, §6.

Per layer: its own type (sliding / full), head dim and KV-head count. q/k RMSNorm per head, v a
weightless RMSNorm (v = the raw K projection on full layers of `attention_k_eq_v` files), rope
NEOX: sliding layers over `rope.dimension_count_swa` dims with base `freq_base_swa`, full layers over
the whole head with θ divided by `rope_freqs` (1e30 stops a frequency: proportional rope). Scale
1.0; sliding layers see keys with 0 ≤ t − s < W. The last `shared_kv_layers` layers own no K/V and
attend to the K/V of the last K/V-owning layer of their type. Sandwich norms around attention and
the GeGLU FFN (plus the MoE branch with its router), per-layer inputs (PLE), the layer output
scale, then the tied head with soft-capping.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.archs.gemma4 import GEMMA4_TABLE, ROPE_FREQS
from specconv.archs.gemma4_hparams import FULL, SLIDING, Gemma4HParams
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.backend import Experts, for_device
from specconv.runtime.graphs.contract import Graph, no_tensors
from specconv.runtime.graphs.ops import (
    Deferred, acc, acc_dtype, add_normed, add_normed_rms_norm, attend_cells, deferred_glu, glu_linear, linear,
    made, moe_out, normed_rope_neox, rms_norm, rope_cos_sin, rope_inv_freq, roped_attended_kv,
)
from specconv.runtime.memory import Batch, MemoryLayout


def _blk(i: int, name: str) -> str:
    return f"blk.{i}.{name}.weight"


# ---- which tensors the graph needs: the family's table (archs/gemma4.py) ------------------------

TABLE = GEMMA4_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)  # the table's shapes read the hparams themselves
# attn_v (absent on attention_k_eq_v full layers) and the fused or split expert matrices
mtp_tensors = optional_mtp_tensors = no_tensors  # the drafter is a separate gemma4-assistant file


def check_hparams(hp: Gemma4HParams, kv: Mapping[str, Any]) -> None:
    """Rope widths and K/V sharing the blocks can index (the assistant's too)."""
    a = hp.arch
    rot = hp.sliding_rotary_dim
    if rot % 2 or any(rot > d for i, d in enumerate(hp.head_dim) if hp.is_sliding(i)):
        raise SpecconvError(f"{a}.rope.dimension_count_swa {rot} must be even and at most the sliding head size")
    if any(d % 2 for d in hp.head_dim):
        raise SpecconvError(f"{a}: head sizes {sorted(set(hp.head_dim))} must be even (rope)")
    if hp.num_hidden_layers and hp.num_kv_shared_layers > hp.num_hidden_layers:
        raise SpecconvError(f"{a}.attention.shared_kv_layers {hp.num_kv_shared_layers} exceeds the "
                            f"{hp.num_hidden_layers} layers")
    if hp.num_experts and not hp.moe_intermediate_size:
        raise SpecconvError(f"{a}.expert_feed_forward_length is missing")


def check_values(file, hp: Gemma4HParams, needed: list[str]) -> None:
    """Per-layer embeddings cover every token id (llama.cpp keeps their own, longer vocabulary), and an
    MoE layer has its gate and up experts, fused or split (both optional by name)."""
    ple, embd = file.tensors.get("per_layer_token_embd.weight"), file.tensors.get("token_embd.weight")
    if "per_layer_token_embd.weight" in needed and ple is not None and embd is not None \
            and ple.shape[-1] < embd.shape[-1]:
        raise SpecconvError(f"tensor per_layer_token_embd.weight has {ple.shape[-1]} rows, fewer than the "
                            f"{embd.shape[-1]} tokens of token_embd.weight")
    for i in range(hp.num_hidden_layers if hp.num_experts else 0):
        p = f"blk.{i}."
        if p + "ffn_gate_up_exps.weight" not in needed and not (
                p + "ffn_gate_exps.weight" in needed and p + "ffn_up_exps.weight" in needed):
            raise SpecconvError(f"missing tensor {p}ffn_gate_up_exps.weight (or {p}ffn_gate_exps.weight and "
                                f"{p}ffn_up_exps.weight)")


def main_layout(hp: Gemma4HParams, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
    owners = [i for i in range(hp.num_hidden_layers) if hp.owns_kv(i)]
    return MemoryLayout(attn_layers=owners, num_key_value_heads=hp.num_key_value_heads[0], head_dim=hp.head_dim[0], rec_layers=[],
                        layer_shapes={i: (hp.num_key_value_heads[i], hp.head_dim[i]) for i in owners})


def mtp_layout(hp: Gemma4HParams) -> MemoryLayout:
    raise SpecconvError("gemma4 files have no MTP head; the Gemma 4 drafter is a separate gemma4-assistant file")


# ---- blocks -----------------------------------------------------------------------------------

def rope_tables(w, hp: Gemma4HParams, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple]:
    """cos/sin per layer type: sliding NEOX over sliding_rotary_dim dims; full NEOX over the head with
    θ / rope_freqs. The frequencies before rope_freqs are ops.rope_inv_freq's, made once per device."""
    out = {}
    hd_swa = hp.head_dim[hp.layer_types.index(SLIDING)] if SLIDING in hp.layer_types else 0
    if hd_swa:
        out[True] = rope_cos_sin(positions, hp.sliding_rotary_dim, hp.sliding_rope_theta, dtype)
    if FULL in hp.layer_types:
        hd = hp.head_dim[hp.layer_types.index(FULL)]
        inv = rope_inv_freq(hd, float(hp.rope_theta), positions.device, torch.float32)
        factors = w.get(ROPE_FREQS)
        if factors is not None:
            inv = inv / factors.float().to(inv.device)
        ang = positions.to(dtype)[:, None] * inv.to(dtype)[None, :]
        out[False] = (ang.cos(), ang.sin())
    return out


def geglu(x, gate, up, down):
    """down · (gelu_tanh(gate · x) ⊙ up · x): gate and up in one group, down by ops.glu_linear (one
    launch each on CUDA)."""
    return deferred_glu(x, gate, up, down, "gelu_tanh").made()


def geglu_fused(x, gate_up, _up, down):
    """GeGLU of one expert whose gate and up rows are one matrix [2F, H], gate rows first."""
    both = linear(x, gate_up)
    half = both.shape[-1] // 2
    return glu_linear(both[..., :half], both[..., half:], down, "gelu_tanh")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           window: int) -> torch.Tensor:
    """softmax(q·kᵀ) v (scale 1.0), key visible iff 0 ≤ t − s (< window on sliding layers, 0 on full
    ones); GQA heads: the backend's attention (ops.attend_cells; k, v: the cells of ops.attended_kv)."""
    return attend_cells(q, k, v, q_pos, k_pos, 1.0, window=window)


def _projected_q(w, hp: Gemma4HParams, i: int, a: torch.Tensor) -> torch.Tensor:
    return linear(a, w[_blk(i, "attn_q")]).view(a.shape[0], hp.num_attention_heads, hp.head_dim[i])


def query(w, hp: Gemma4HParams, i: int, a: torch.Tensor, rope) -> torch.Tensor:
    """q normed and roped, for a layer that reads another layer's K/V."""
    return normed_rope_neox(_projected_q(w, hp, i, a), w[_blk(i, "attn_q_norm")], hp.rms_norm_eps,
                            *rope[hp.is_sliding(i)])


def query_own_kv(w, hp: Gemma4HParams, i: int, a: torch.Tensor, batch: Batch, rope):
    """(q, K, V, positions) of a layer with K/V of its own: q, k and v projected, v RMS-normed without
    a weight, q and k normed and roped and k, v stored (ops.roped_attended_kv: one launch on CUDA)."""
    n, hd, nkv = a.shape[0], hp.head_dim[i], hp.num_key_value_heads[i]
    q = _projected_q(w, hp, i, a)
    k_raw = linear(a, w[_blk(i, "attn_k")]).view(n, nkv, hd)
    v_w = w.get(_blk(i, "attn_v"))
    v = k_raw if v_w is None else linear(a, v_w).view(n, nkv, hd)  # attention_k_eq_v: V is the raw K
    return roped_attended_kv(batch, i, q, k_raw, v, w[_blk(i, "attn_q_norm")], w[_blk(i, "attn_k_norm")],
                             hp.rms_norm_eps, *rope[hp.is_sliding(i)], v_norm=True)


def attention_out(w, hp: Gemma4HParams, i: int, o: torch.Tensor) -> Deferred:
    """attn_output · o, not made yet: what attention adds to the residual stream through
    post_attention_norm (ffn_block: made with that norm, the add and the FFN norm)."""
    return Deferred(o.reshape(o.shape[0], -1), w[_blk(i, "attn_output")])


def ffn_block(w, hp: Gemma4HParams, i: int, h: torch.Tensor, attn: Deferred, scale=None,
              then=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h'', rms_norm(h'', then) or None): h'' = h' + post_ffw_norm(dense GeGLU [+ MoE branch]) of
    h' = h + post_attention_norm(attn) (attention_out), times the layer output `scale` when given
    (the block's last step), and the norm that reads h'' next where `then` is its weight. Each side
    joins the stream in the launch of the product that ends it on CUDA: attn's with
    post_attention_norm, the add and ffn_norm, the GeGLU's down product with post_ffw_norm, the add,
    the scale and the next norm (ops.add_normed_rms_norm, ops.add_normed)."""
    h, x = add_normed_rms_norm(h, attn, w[_blk(i, "post_attention_norm")], hp.rms_norm_eps, w[_blk(i, "ffn_norm")])
    f = deferred_glu(x, w[_blk(i, "ffn_gate")], w[_blk(i, "ffn_up")], w[_blk(i, "ffn_down")], "gelu_tanh")
    if hp.num_experts and i < hp.num_hidden_layers:
        f1 = rms_norm(made(f), w[_blk(i, "post_ffw_norm_1")], hp.rms_norm_eps)
        f = f1 + rms_norm(moe(w, hp, i, h), w[_blk(i, "post_ffw_norm_2")], hp.rms_norm_eps)
    return sandwich_out(h, f, w[_blk(i, "post_ffw_norm")], hp.rms_norm_eps, scale, then)


def sandwich_out(h: torch.Tensor, x, weight, eps: float, scale, then) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h + rms_norm(x, weight) (· scale), its norm by `then` or None): ops.add_normed_rms_norm where a
    norm reads the stream next, ops.add_normed where none does."""
    if then is None:
        return add_normed(h, x, weight, eps, scale), None
    return add_normed_rms_norm(h, x, weight, eps, then, scale)


def next_norm(w, i: int, layers: int, output_norm: str = names.OUTPUT_NORM):
    """The weight of the norm that reads the stream after block i: block i + 1's input norm, or the
    output norm after the last of `layers` blocks."""
    return w[_blk(i + 1, "attn_norm")] if i + 1 < layers else w[output_norm]


def moe(w, hp: Gemma4HParams, i: int, h: torch.Tensor) -> torch.Tensor:
    """docs/reference/model-math.md §6.3: router on the residual stream, experts on pre_ffw_norm_2(h)."""
    p = f"blk.{i}."
    normed = acc(rms_norm(h, None, hp.rms_norm_eps))  # its dtype is acc(h)'s: no second cast to read it
    t = normed * w[p + "ffn_gate_inp.scale"].to(normed.dtype) * hp.hidden_size ** -0.5
    # softmax, top-k, renormalised, times the chosen experts' scales: one launch on CUDA (the +1e-20 of
    # route_grouped's renormalisation changes no bit here: the k largest of a softmax sum to ≥ 1/E)
    weights, chosen = for_device(h.device).route_grouped(linear(t, w[p + "ffn_gate_inp.weight"]),
                                                         hp.num_experts_per_tok, names.EXPERT_GATING_SOFTMAX,
                                                         expert_scale=w[p + "ffn_down_exps.scale"])
    u = rms_norm(h, w[p + "pre_ffw_norm_2.weight"], hp.rms_norm_eps)
    fused = w.get(p + "ffn_gate_up_exps.weight")
    if fused is not None:  # [E, 2Fe, H], gate rows first: one product gives both halves
        experts = Experts(fused, None, w[p + "ffn_down_exps.weight"], geglu_fused)
    else:
        experts = Experts(w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"],
                          geglu)
    return moe_out(u, weights, chosen, experts)  # in u's dtype, h's


def per_layer_inputs(w, hp: Gemma4HParams, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """PLE rows [n, N, P] from the scaled embedding h (docs/reference/model-math.md §6.1)."""
    n, N, P = h.shape[0], hp.num_hidden_layers, hp.hidden_size_per_layer_input
    proj = linear(h, w["per_layer_model_proj.weight"]) * hp.hidden_size ** -0.5
    proj = rms_norm(proj.view(n, N, P), w["per_layer_proj_norm.weight"], hp.rms_norm_eps)
    tok = w["per_layer_token_embd.weight"][tokens].to(h.dtype).view(n, N, P) * math.sqrt(P)
    return (proj + tok) * 2 ** -0.5


def output_logits(w, hp: Gemma4HParams, rows: torch.Tensor) -> torch.Tensor:
    head = w["output.weight"] if "output.weight" in w else w["token_embd.weight"]
    logits = acc(linear(rows, head))
    if hp.final_logit_softcapping:
        logits = hp.final_logit_softcapping * torch.tanh(logits / hp.final_logit_softcapping)
    return logits


def _block(w, hp: Gemma4HParams, i: int, h: torch.Tensor, a: torch.Tensor | None, batch: Batch, rope,
           kv_of: dict[int, tuple], ple: torch.Tensor | None, then) -> tuple[torch.Tensor, torch.Tensor]:
    """Block i on the residual stream h (a: its input norm, made by the block before, or None: made
    here): attention to its own K/V or to those of the layer it shares (`kv_of`: the K/V of the
    blocks run so far), the FFN with its sandwich norms, the per-layer input (PLE rows [n, N, P], or
    None), times the layer output scale. Returns the stream and its norm by `then` (next_norm),
    made with the block's last sandwich."""
    if a is None:
        a = rms_norm(h, w[_blk(i, "attn_norm")], hp.rms_norm_eps)
    if hp.owns_kv(i):
        q, k_all, v_all, k_pos = query_own_kv(w, hp, i, a, batch, rope)
        kv_of[i] = k_all, v_all, k_pos
    else:
        q = query(w, hp, i, a, rope)
    k_all, v_all, k_pos = kv_of[hp.kv_layer(i)]
    o = attend(q, k_all, v_all, batch.positions, k_pos, hp.sliding_window if hp.is_sliding(i) else 0)
    scale = w[_blk(i, "layer_output_scale")]
    if ple is None:
        return ffn_block(w, hp, i, h, attention_out(w, hp, i, o), scale, then)
    h, _ = ffn_block(w, hp, i, h, attention_out(w, hp, i, o))
    g = Deferred(linear(h, w[_blk(i, "inp_gate")]), w[_blk(i, "proj")], ple[:, i].to(h.dtype), "gelu_tanh")
    return sandwich_out(h, g, w[_blk(i, "post_norm")], hp.rms_norm_eps, scale, then)  # one launch on CUDA


# ---- graph ------------------------------------------------------------------------------------

def forward_main(w, hp: Gemma4HParams, tokens: torch.Tensor, batch: Batch, want_layers: set[int], gdn_mode: str,
                 want_logits: torch.Tensor | None):
    """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = num_hidden_layers: post_norm})."""
    emb = w["token_embd.weight"][tokens]
    # one launch: torch multiplies a 16-bit tensor by a scalar in float32 and rounds once, the bits of
    # (acc(emb) * s).to(emb.dtype)
    h = emb * math.sqrt(hp.hidden_size)
    ple = per_layer_inputs(w, hp, tokens, h) if hp.hidden_size_per_layer_input else None
    rope = rope_tables(w, hp, batch.positions, acc_dtype(h.dtype))
    kv_of: dict[int, tuple] = {}
    layer_inputs = {}
    a = None  # each block's input norm, made by the block before it (the first block's by itself)
    for i in range(hp.num_hidden_layers):
        if i in want_layers:
            layer_inputs[i] = h
        h, a = _block(w, hp, i, h, a, batch, rope, kv_of, ple, next_norm(w, i, hp.num_hidden_layers))
    post = a  # the output norm of h, made with the last block's last sandwich
    if hp.num_hidden_layers in want_layers:
        layer_inputs[hp.num_hidden_layers] = post
    rows = post if want_logits is None else post[want_logits]
    return output_logits(w, hp, rows), post, h, layer_inputs


def forward_mtp(*args, **kwargs):
    raise SpecconvError("gemma4 files have no MTP head; use a gemma4-assistant file as --draft")


GRAPH = Graph(
    name="gemma4",
    archs=("gemma4",),  # the GGUF arches this graph runs (graph_for finds it by them)
    PER_LAYER_KEYS=("attention.head_count_kv", "feed_forward_length"),  # per-layer lists (llama.cpp get_key_or_arr)
    tensors=_tensors,
    CAPTURABLE=True,
    HParams=Gemma4HParams,
    mtp_tensors=mtp_tensors,
    optional_mtp_tensors=optional_mtp_tensors,
    main_layout=main_layout,
    mtp_layout=mtp_layout,
    forward_main=forward_main,
    forward_mtp=forward_mtp,
    check_hparams=check_hparams,
    check_values=check_values,
)
