"""MiMo-V2-Flash graphs (GGUF arch `mimo2`), as llama.cpp 0c1e570's src/models/mimo2.cpp computes them.

MAIN: per block i, attn_norm -> attention (Q/K heads of `key_length`, V heads of `value_length`,
split attn_q/k/v or a fused attn_qkv = [Q; K; V] rows), KV heads per block (`head_count_kv` array),
NEOX rope over the first `rope.dimension_count` dims with `rope.freq_base` (full blocks) or
`rope.freq_base_swa` (sliding blocks: a key is visible when 0 ≤ q - k < sliding_window), scale
key_length^-1/2, per-head attention sinks (`attn_sinks`: one extra logit per head in the softmax,
whose probability is dropped), attn_output, times `attention.value_scale` -> residual -> ffn_norm ->
dense SwiGLU, or sigmoid-routed group-limited MoE (`exp_probs_b.bias`; weights renormalised; no
routed scale, no shared expert) -> residual.
MTP: blocks n_layer.. (`HParams.mtp_block`): eh_proj·[enorm(E[x]); hnorm(h)], the sliding-window
block, z = (nextn.shared_head_norm | layer_output_norm | output_norm)(y), logits = output(z).
Which rows are fed (TARGET_HIDDEN) and chained (CHAIN_HIDDEN): the post-norm ones, as the release
does in vLLM (its MTP layer returns final_layernorm(h)); llama.cpp's mimo2 graphs use the pre-norm
states for both (docs/mtp.md §Chained MTP heads). Shared with the other chained-MTP graphs: chained.py.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.mimo2 import MIMO2_TABLE
from specconv.archs.mimo2_hparams import Mimo2HParams
from specconv.runtime.graphs import chained, trunk
from specconv.runtime.graphs.decoder import nextn_input, normed, output_head
from specconv.runtime.graphs.ops import (
    Deferred, acc, acc_dtype, attend_cells, attended_kv, linear, normed_rope_qk, rope_cos_sin,
)
from specconv.runtime.memory import Batch
from specconv.runtime.placement import on_layer_device
from specconv.runtime.validate import check_rope_width

HParams = Mimo2HParams  # read from GGUF metadata by Mimo2HParams.from_kv (archs/mimo2_hparams.py)

_tensors = chained.tensor_lists(MIMO2_TABLE)


def check_hparams(hp: HParams, kv) -> None:
    check_rope_width(f"{hp.arch}.rope.dimension_count", hp.rotary_dim, hp.head_dim)


def check_values(file, hp: HParams, needed: list[str]) -> None:
    """Each block holds its q, k and v, split or fused, and a whole dense or routed FFN."""
    have = set(needed)
    for i in range(hp.num_hidden_layers + hp.num_nextn_predict_layers):
        p = f"blk.{i}."
        split = [p + f"attn_{x}.weight" for x in "qkv"]
        if p + "attn_norm.weight" in have and p + "attn_qkv.weight" not in have and not all(n in have for n in split):
            raise SpecconvError(f"missing tensor {p}attn_qkv.weight (or {p}attn_q/k/v.weight)")
    chained.check_ffn(file, hp, needed, "exp_probs_b.bias", shared=False)


_layouts = chained.layouts(lambda hp: hp.cell_width)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> torch.Tensor | Deferred:
    n, p = a.shape[0], f"blk.{i}."
    nh, nkv = hp.num_attention_heads, hp.num_key_value_heads[i]
    if p + "attn_qkv.weight" in w:
        qkv = linear(a, w[p + "attn_qkv.weight"])
        q, k, v = qkv.split([nh * hp.head_dim, nkv * hp.head_dim, nkv * hp.v_head_dim], dim=-1)
    else:
        q, k, v = (linear(a, w[p + f"attn_{x}.weight"]) for x in "qkv")
    q, k, v = q.reshape(n, nh, hp.head_dim), k.reshape(n, nkv, hp.head_dim), v.reshape(n, nkv, hp.v_head_dim)
    cos, sin = rope[1] if hp.is_sliding(i) else rope[0]
    q, k = normed_rope_qk(q, k, None, None, 0.0, cos, sin)  # NEOX rope of q and k (no norms): one launch on CUDA
    W = hp.cell_width
    k_all, v_all, k_pos = attended_kv(batch, i, _pad(k, W), _pad(v, W))
    sinks = w.get(p + "attn_sinks.weight")
    window = hp.sliding_window if hp.is_sliding(i) else 0
    o = attend_cells(q, k_all[..., :hp.head_dim], v_all[..., :hp.v_head_dim], batch.positions, k_pos,
                     hp.head_dim ** -0.5, window=window, sinks=None if sinks is None else acc(sinks))
    out = Deferred(o.reshape(n, nh * hp.v_head_dim), w[p + "attn_output.weight"])
    scale = hp.attention_value_scale
    if scale is None or scale == 1.0:
        return out  # made with the residual add and the norm after it
    # (acc(out) * scale).to(out.dtype)'s bits in one launch: torch scales a 16-bit tensor in float32
    return out.made() * scale


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    return chained.ffn(w, hp, i, x, "exp_probs_b.bias", shared=False)


def _rope(w, hp: HParams, batch: Batch):
    return lambda dtype: (rope_cos_sin(batch.positions, hp.rotary_dim, hp.rope_theta, dtype),
                          rope_cos_sin(batch.positions, hp.rotary_dim, hp.swa_rope_theta, dtype))


_forwards = chained.forwards(_rope, attention, ffn)  # its MTP head ends differently: forward_mtp


def _mtp(w, hp: HParams, i: int, tokens, hidden_in, batch: Batch):
    x = nextn_input(w, i, hp.rms_norm_eps, tokens, hidden_in)
    y = trunk.pending_block(w, hp, i, x, batch, _rope(w, hp, batch)(acc_dtype(x.dtype)), attention, ffn)
    p = f"blk.{i}."
    norm = w.get(p + "nextn.shared_head_norm.weight", w.get(p + "layer_output_norm.weight", w["output_norm.weight"]))
    y, z = normed(y, norm, hp.rms_norm_eps)  # the block's last residual add and this norm: one launch on CUDA
    return acc(linear(z, w.get(p + "nextn.shared_head_head.weight", output_head(w)))), z, y


def forward_mtp(w, hp: HParams, tokens: torch.Tensor, hidden_in: torch.Tensor, batch: Batch):
    """MTP block `hp.mtp_block`: (logits, z = normed output, chained; y = pre-norm output)."""
    i = chained.mtp_block_id(hp)
    # the MTP blocks and the head sit on the last device of a placement
    return on_layer_device(w, i, lambda t, h: _mtp(w, hp, i, t, h, batch), tokens, hidden_in)


GRAPH = chained.graph(
    "mimo2", HParams, _tensors, _layouts, _forwards, check_hparams=check_hparams,
    archs=("mimo2",),  # the GGUF arches this graph runs (graph_for finds it by them)
    PER_LAYER_KEYS=("attention.head_count_kv",),  # per-layer lists (llama.cpp get_key_or_arr)
    check_values=check_values, forward_mtp=forward_mtp,
    CHAIN_HIDDEN="nextn",  # post-norm (vLLM's MiMoV2MTPLayer returns final_layernorm(h))
    TARGET_HIDDEN="post_norm",
)
