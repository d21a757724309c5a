"""Qwen3.5 / Qwen3.5-MoE graphs (GGUF arch `qwen35`, `qwen35moe`), docs/reference/model-math.md §2, §3.1, §7.

MAIN: the trunk (blocks 0..n_layer-1): gated full attention with partial NEOX rope, Gated DeltaNet,
dense SwiGLU or MoE with a gated shared expert. MTP: the one nextn block (block n_layer) with its
own KV cache; input rows are (token, target post-norm hidden), embedding first in the concat.
Rope (trunk and MTP block) follows the file's rope.scaling.* (linear or YaRN) on the rotary dims as
transformers' Qwen3.5 does; its M-RoPE sections coincide for text, whose positions are one per token.
Only GGUF names are used here.
"""

from __future__ import annotations

import torch

from specconv.archs.qwen35 import QWEN35_TABLE
from specconv.archs.qwen35_hparams import LINEAR, Qwen35HParams
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs import gdn, trunk
from specconv.runtime.graphs.decoder import Residual
from specconv.runtime.graphs.ops import (
    Deferred, cached_attention, check_rope_scaling, deferred_swiglu, linear_group, linear_wide_group,
    moe_softmax_topk_gated_shared, rope_cos_sin_scaled, swiglu,
)
from specconv.runtime.memory import Batch, MemoryLayout

ARCHES = ("qwen35", "qwen35moe")  # hyperparameters: Qwen35HParams, from GGUF metadata by its from_kv

# which tensors the graphs need: the family's table (archs/qwen35.py), whose shapes read the hparams
TABLE = QWEN35_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)


def main_layout(hp: Qwen35HParams, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
    recurrent = hp.recurrent
    return MemoryLayout(
        attn_layers=[i for i, r in enumerate(recurrent) if not r], num_key_value_heads=hp.num_key_value_heads,
        head_dim=hp.head_dim, rec_layers=[i for i, r in enumerate(recurrent) if r],
        conv_channels=hp.conv_channels, conv_kernel=hp.linear_conv_kernel_dim, ssm_heads=hp.linear_num_value_heads,
        ssm_dk=hp.linear_key_head_dim, ssm_dv=hp.linear_value_head_dim, state_dtype=state_dtype)


def mtp_layout(hp: Qwen35HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=[hp.num_hidden_layers], num_key_value_heads=hp.num_key_value_heads,
                        head_dim=hp.head_dim, rec_layers=[])


# ---- blocks -----------------------------------------------------------------------------------

def gated_attention(w, hp: Qwen35HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> Deferred:
    n = a.shape[0]
    qg, k, v = linear_group(a, [w[f"blk.{i}.attn_{t}.weight"] for t in "qkv"])
    qg = qg.view(n, hp.num_attention_heads, 2 * hp.head_dim)
    q, gate = qg[..., :hp.head_dim], qg[..., hp.head_dim:]  # q and gate interleaved per head
    k = k.view(n, hp.num_key_value_heads, hp.head_dim)
    v = v.view(n, hp.num_key_value_heads, hp.head_dim)
    # q and k normed and roped, K/V stored: one kernel on CUDA; attention and o · sigmoid(gate): another
    o = cached_attention(batch, i, q, k, v, w[f"blk.{i}.attn_q_norm.weight"], w[f"blk.{i}.attn_k_norm.weight"],
                         hp.rms_norm_eps, rope, hp.head_dim ** -0.5, gate)
    # the output product made with the residual add and the norm after it (ops.add_rms_norm)
    return Deferred(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[f"blk.{i}.attn_output.weight"])


def gated_deltanet(w, hp: Qwen35HParams, i: int, a: torch.Tensor, batch: Batch, mode: str) -> Deferred:
    n = a.shape[0]
    nk, nv = hp.linear_num_key_heads, hp.linear_num_value_heads
    dk, dv = hp.linear_key_head_dim, hp.linear_value_head_dim
    m, z, b, alpha = linear_group(a, [w[f"blk.{i}.{t}.weight"] for t in ("attn_qkv", "attn_gate", "ssm_beta",
                                                                          "ssm_alpha")])  # m [n, C] = [q | k | v]
    z = z.view(n, nv, dv)
    rec = gdn.Recurrence(batch, i, mode)  # states in and out of the memory's ring
    # GGUF value heads are tiled: value head h reads key head h mod nk. The conv, q and k L2-normed
    # (q · dk^-1/2) and the gates (accumulation dtype) before the rule, which takes the key heads and v
    # in the compute dtype as they are; then the gated output norm, rounded into the compute dtype
    # (the CUDA backend: conv, norms, gates, rule and output norm in one kernel)
    y = rec.conv_delta_rule(m, w[f"blk.{i}.ssm_conv1d.weight"], (nk, dk, nv, dv), b, alpha, w[f"blk.{i}.ssm_a"],
                            w[f"blk.{i}.ssm_dt.bias"], hp.rms_norm_eps, dk ** -0.5, key_heads=gdn.TILED,
                            gated_norm=(w[f"blk.{i}.ssm_norm.weight"], z, hp.rms_norm_eps, a.dtype))
    return Deferred(y.reshape(n, nv * dv), w[f"blk.{i}.ssm_out.weight"])  # made with the add and norm after it


def ffn(w, hp: Qwen35HParams, i: int, x: torch.Tensor) -> torch.Tensor | Deferred:
    p = f"blk.{i}."
    if not hp.is_moe:  # the down product made with the next norm (ops.Deferred)
        return deferred_swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    gate_w = w[p + "ffn_gate_inp_shexp.weight"]  # [1, H]; [H] as llama.cpp's converter writes it
    # the router's logits and the shared expert's gate logit (σ applied with the shared add): one launch
    logits, gate = linear_wide_group(x, (w[p + "ffn_gate_inp.weight"], gate_w if gate_w.ndim == 2
                                         else gate_w.reshape(1, -1)))
    shared = swiglu(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
    return moe_softmax_topk_gated_shared(x, logits, hp.num_experts_per_tok, w[p + "ffn_gate_exps.weight"],
                                         w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"], shared, gate)


# ---- graphs -----------------------------------------------------------------------------------

def _block(w, hp: Qwen35HParams, i: int, h, batch: Batch, rope, gdn_mode: str, deltanet) -> Residual:
    """A pre-norm block (trunk.pending_block: each residual add done with the norm after it, the FFN's
    left pending for the next norm) whose mixer is Gated DeltaNet or gated attention by layer type."""
    recurrent = i < hp.num_hidden_layers and hp.layer_types[i] == LINEAR  # the MTP block (i = n_layer): attention
    mixer = (lambda w, hp, i, a, batch, rope: deltanet(w, hp, i, a, batch, gdn_mode)) if recurrent else gated_attention
    return trunk.pending_block(w, hp, i, h, batch, rope, mixer, ffn, ffn_norm="post_attention_norm")


def block_with(deltanet) -> trunk.BlockOf:
    """The blocks with `deltanet` as Gated DeltaNet mixer (this module's; Qwen3-Next gives its own)."""
    return lambda w, hp, batch, gdn_mode: lambda i, h, rope: _block(w, hp, i, h, batch, rope, gdn_mode, deltanet)


def rope(w, hp: Qwen35HParams, batch: Batch):
    return lambda dtype: rope_cos_sin_scaled(batch.positions, hp.rotary_dim, hp.rope_theta, hp.rope_scaling, dtype)


def check_hparams(hp: Qwen35HParams, kv) -> None:
    check_rope_scaling(hp.arch, hp.rope_scaling, hp.rope_theta)


GRAPH = trunk.graph(
    "qwen35", Qwen35HParams, _tensors, main_layout, mtp_layout,
    trunk.Trunk(rope, block_with(gated_deltanet), mtp_block=trunk.nextn_block),
    archs=ARCHES,  # the GGUF arches this graph runs (graph_for finds it by them)
    PER_LAYER_KEYS=("attention.head_count_kv", "feed_forward_length"),  # per-layer lists (llama.cpp get_key_or_arr)
    check_hparams=check_hparams,  # rope scaling it cannot run is refused at load
)
