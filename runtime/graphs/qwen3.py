"""Qwen3 / Qwen3-MoE graphs (GGUF arch `qwen3`, `qwen3moe`): the MAIN graph of a plain target or
draft model (docs/reference/model-math.md §1, §3.1).

Each block: RMSNorm -> GQA attention whose q and k heads are RMS-normed per head (`attn_q_norm`,
`attn_k_norm`, head_dim wide) before NEOX rope (rotate-half, the HF order the converter keeps) ->
residual -> RMSNorm -> SwiGLU FFN, or for qwen3moe a softmax router over all experts, top-k, the k
weights renormalised unless the file says `expert_weights_norm = false` (llama.cpp's qwen3moe
always renormalises; archs/qwen3.py writes the key only for checkpoints with norm_topk_prob=false).
No shared expert, no MTP head. The trunk runs through decoder.forward_trunk (multi-device).
"""

from __future__ import annotations

import torch

from specconv.archs import names
from specconv.archs.qwen3 import QWEN3_TABLE, Qwen3HParams
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.backend import Experts, for_device
from specconv.runtime.graphs import trunk
from specconv.runtime.graphs.ops import (
    Deferred, cached_attention, deferred_swiglu, head_projections, linear_wide, moe_out, rope_cos_sin_scaled, swiglu,
)
from specconv.runtime.memory import Batch

ARCHES = ("qwen3", "qwen3moe")
HParams = Qwen3HParams  # read from GGUF metadata by Qwen3HParams.from_kv (archs/qwen3.py)

# ---- which tensors the graph needs: the family's table (archs/qwen3.py), shapes from the hparams --

TABLE = QWEN3_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)  # no MTP head: the MTP lists are empty


_layouts = trunk.Layouts(lambda hp: hp.head_dim)  # every block attends; no MTP block


# ---- blocks -----------------------------------------------------------------------------------

def rope_for(hp: HParams, positions: torch.Tensor, dtype: torch.dtype):
    return rope_cos_sin_scaled(positions, hp.rotary_dim, hp.rope_freq_base, hp.rope_scaling, dtype)


def attention(w, hp, i: int, a: torch.Tensor, batch: Batch, rope) -> Deferred:
    """GQA with per-head RMS-normed q and k, NEOX rope on the first rotary_dim dims (Qwen3's block,
    and Hy3's: runtime/graphs/hy_v3.py); the output product left to the add and norm after it."""
    n, p, eps = a.shape[0], f"blk.{i}.", hp.rms_norm_eps
    q, k, v = head_projections(a, [w[p + f"attn_{x}.weight"] for x in "qkv"],
                               (hp.num_attention_heads, hp.num_key_value_heads, hp.num_key_value_heads), hp.head_dim)
    # q and k normed and roped, K/V stored: one kernel on CUDA
    o = cached_attention(batch, i, q, k, v, w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"], eps, rope,
                         hp.head_dim ** -0.5)
    return Deferred(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[p + "attn_output.weight"])


def moe(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    """softmax(router·x) over all experts, top-k, weights renormalised over the k when norm_topk_prob
    (the backend's route_softmax_topk, else its route_grouped: one launch on CUDA); only the experts
    some row chose are evaluated (`W[e]` keeps stored experts packed)."""
    p = f"blk.{i}."
    logits, backend = linear_wide(x, w[p + "ffn_gate_inp.weight"]), for_device(x.device)
    if hp.norm_topk_prob:
        weights, chosen = backend.route_softmax_topk(logits, hp.num_experts_per_tok)
    else:
        weights, chosen = backend.route_grouped(logits, hp.num_experts_per_tok, names.EXPERT_GATING_SOFTMAX,
                                                renormalise=False)
    experts = Experts(w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"],
                      swiglu)
    return moe_out(x, weights, chosen, experts)


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor | Deferred:
    if hp.is_moe:
        return moe(w, hp, i, x)
    p = f"blk.{i}."
    return deferred_swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])


GRAPH = trunk.graph(
    "qwen3", HParams, _tensors, _layouts.main_layout, _layouts.mtp_layout,
    trunk.Trunk(lambda w, hp, batch: lambda dtype: rope_for(hp, batch.positions, dtype),
                trunk.prenorm(attention, ffn)),  # no MTP head
    archs=ARCHES,  # the GGUF arches this graph runs (graph_for finds it by them)
)
