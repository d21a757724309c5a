"""Hy3 graphs (GGUF arch `hy_v3`), as llama.cpp 0c1e570's src/models/hy-v3.cpp computes them.

MAIN: per block, attn_norm -> GQA attention with per-head q/k RMSNorms before a NEOX rope over the
whole head (n_rot = head_dim), scale hd^-1/2 -> residual -> ffn_norm -> a dense SwiGLU (blocks
without `ffn_gate_inp`) or the sigmoid-routed MoE (selection bias `exp_probs_b`, renormalised top-k
weights times `expert_weights_scale`) plus the shared expert -> residual.
MTP: k chained blocks at n_layer..n_layer+k-1. `HParams.mtp_block` picks the block a context runs
(runtime/drafters/mtp.py makes one context per block): u = eh_proj·[enorm(E[x]); hnorm(h)], the
decoder block, z = shared_head_norm(y) (the release's final_layernorm); logits = output(z). The
block chains z, its post-norm output, to the next block (CHAIN_HIDDEN; docs/mtp.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs import moe_sigmoid as ms
from specconv.runtime.graphs.decoder import forward_nextn, forward_trunk
from specconv.runtime.graphs.ops import acc, causal_attention, linear, rms_norm, rope_cos_sin, rope_neox_partial, swiglu
from specconv.runtime.memory import Batch, MemoryLayout
from specconv.runtime.validate import check_kv

OPTIONAL = ("output.weight",)  # absent when tied to token_embd
MULTI_DEVICE = True  # runs through decoder.forward_trunk / forward_nextn
CHAINED_MTP = True  # block i drafts position i (runtime/drafters/mtp.py)
CHAIN_HIDDEN = "nextn"  # the post-norm block output seeds the next block (vLLM, llama.cpp)
_ATTN = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm")
_DENSE = ("ffn_gate", "ffn_up", "ffn_down")
_MOE = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp",
        "ffn_down_shexp")
_BIAS = "exp_probs_b"  # llama.cpp's hy_v3 names it without a suffix


@dataclass
class HParams:
    arch: str
    n_layer: int
    n_nextn: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    rope_base: float
    n_expert: int
    n_expert_used: int
    weights_scale: float
    weights_norm: bool
    gating: int = ms.GATING_SIGMOID
    n_group: int = 1
    mtp_block: int = 0  # which MTP block an MTP context runs (0..n_nextn-1)

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "HParams":
        check_kv(kv)  # types and ranges first (runtime/validate.py)
        arch, get = ms.kv_getter(kv)
        block_count, n_nextn = get("block_count"), get("nextn_predict_layers", 0)
        if n_nextn > block_count:
            raise SpecconvError(f"{arch}.nextn_predict_layers ({n_nextn}) exceeds block_count ({block_count})")
        n_embd, n_head = get("embedding_length"), get("attention.head_count")
        head_dim = get("attention.key_length", n_embd // n_head, required=False)
        if get("attention.value_length", head_dim, required=False) != head_dim:
            raise SpecconvError(f"{arch}: attention.key_length != value_length")
        n_head_kv = get("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise SpecconvError(f"{arch}: {n_head} heads are not a multiple of {n_head_kv} KV heads")
        gating = get("expert_gating_func", ms.GATING_SIGMOID, required=False)
        if gating not in (ms.GATING_SOFTMAX, ms.GATING_SIGMOID):
            raise SpecconvError(f"{arch}.expert_gating_func is {gating}; supported: softmax (1), sigmoid (2)")
        return cls(arch=arch, n_layer=block_count - n_nextn, n_nextn=n_nextn, n_embd=n_embd, n_head=n_head,
                   n_head_kv=n_head_kv, head_dim=head_dim, eps=float(get("attention.layer_norm_rms_epsilon")),
                   rope_base=float(get("rope.freq_base", 10000.0)), n_expert=get("expert_count", 0, required=False),
                   n_expert_used=get("expert_used_count", 0, required=False),
                   weights_scale=float(get("expert_weights_scale", 1.0, required=False) or 1.0),
                   weights_norm=bool(get("expert_weights_norm", False, required=False)), gating=gating)


def _required(i: int) -> list[str]:
    return [f"blk.{i}.{n}.weight" for n in _ATTN]


def _ffn_optional(i: int) -> list[str]:
    return [f"blk.{i}.{n}.weight" for n in _DENSE + _MOE] + [f"blk.{i}.{_BIAS}"]


def main_tensors(hp: HParams) -> list[str]:
    return ["token_embd.weight", "output_norm.weight"] + [n for i in range(hp.n_layer) for n in _required(i)]


def optional_main_tensors(hp: HParams) -> list[str]:
    return [n for i in range(hp.n_layer) for n in _ffn_optional(i)]


def mtp_tensors(hp: HParams) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(hp.n_layer, hp.n_layer + hp.n_nextn):
        names += _required(i) + [f"blk.{i}.nextn.{x}.weight" for x in ms.NEXTN_REQUIRED]
    return names


def optional_mtp_tensors(hp: HParams) -> list[str]:
    return [n for i in range(hp.n_layer, hp.n_layer + hp.n_nextn)
            for n in _ffn_optional(i) + [f"blk.{i}.nextn.{x}.weight" for x in ms.NEXTN_OPTIONAL]]


def keep_float32(name: str) -> bool:
    return ms.keep_float32(name) or name.endswith(_BIAS)


def main_layout(hp: HParams, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
    return MemoryLayout(attn_layers=list(range(hp.n_layer)), n_head_kv=hp.n_head_kv, head_dim=hp.head_dim,
                        rec_layers=[])


def mtp_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=[mtp_block_id(hp)], n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, rec_layers=[])


def mtp_block_id(hp: HParams) -> int:
    if not 0 <= hp.mtp_block < max(hp.n_nextn, 1):
        raise SpecconvError(f"{hp.arch}: MTP block {hp.mtp_block} out of range (the file has {hp.n_nextn})")
    return hp.n_layer + hp.mtp_block


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    n, p = a.shape[0], f"blk.{i}."
    q = linear(a, w[p + "attn_q.weight"]).view(n, hp.n_head, hp.head_dim)
    k = linear(a, w[p + "attn_k.weight"]).view(n, hp.n_head_kv, hp.head_dim)
    v = linear(a, w[p + "attn_v.weight"]).view(n, hp.n_head_kv, hp.head_dim)
    q = rms_norm(q, w[p + "attn_q_norm.weight"], hp.eps)
    k = rms_norm(k, w[p + "attn_k_norm.weight"], hp.eps)
    cos, sin = rope
    q, k = rope_neox_partial(q, cos, sin), rope_neox_partial(k, cos, sin)
    k_all, v_all, k_pos = batch.attend_kv(i, k, v)
    o = causal_attention(q, k_all, v_all, batch.positions, k_pos, hp.head_dim ** -0.5)
    return linear(o.reshape(n, hp.n_head * hp.head_dim), w[p + "attn_output.weight"])


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    p = f"blk.{i}."
    if p + "ffn_gate_inp.weight" not in w:
        if p + "ffn_gate.weight" not in w:
            raise SpecconvError(f"{hp.arch}: block {i} has neither a router (ffn_gate_inp) nor a dense FFN (ffn_gate)")
        return swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    weights, chosen = ms.route(x, w[p + "ffn_gate_inp.weight"], w[p + _BIAS], hp)
    gate_e, up_e, down_e = (w[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
    out = torch.zeros(x.shape[0], down_e.shape[1], dtype=weights.dtype, device=x.device)
    for e in torch.unique(chosen).tolist():
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        y = swiglu(x[rows], gate_e[e], up_e[e], down_e[e])
        out.index_add_(0, rows, acc(y) * weights[rows, slot][:, None])
    shared = swiglu(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
    return (out + acc(shared)).to(x.dtype)


def _block(w, hp: HParams, i: int, h: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    h = h + attention(w, hp, i, rms_norm(h, w[f"blk.{i}.attn_norm.weight"], hp.eps), batch, rope)
    return h + ffn(w, hp, i, rms_norm(h, w[f"blk.{i}.ffn_norm.weight"], hp.eps))


def _rope(hp: HParams, batch: Batch):
    return lambda dtype: rope_cos_sin(batch.positions, hp.head_dim, hp.rope_base, dtype)


def forward_main(w, hp: HParams, tokens: torch.Tensor, batch: Batch, want_layers: set[int], gdn_mode: str,
                 want_logits: torch.Tensor | None):
    """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = n_layer: post_norm})."""
    return forward_trunk(w, hp.n_layer, hp.eps, tokens, want_layers, want_logits, _rope(hp, batch),
                         lambda i, h, rope: _block(w, hp, i, h, batch, rope))


def forward_mtp(w, hp: HParams, tokens: torch.Tensor, hidden_in: torch.Tensor, batch: Batch):
    """MTP block `hp.mtp_block`: (logits, z = post-norm output, chained; y = pre-norm output)."""
    return forward_nextn(w, mtp_block_id(hp), hp.eps, tokens, hidden_in, _rope(hp, batch),
                         lambda i, h, rope: _block(w, hp, i, h, batch, rope))
