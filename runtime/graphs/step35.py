"""Step-3.5 graphs (GGUF arch `step35`), as llama.cpp 0c1e570's src/models/step35.cpp computes them.

MAIN: per block i, attn_norm -> attention with block i's own head counts (`head_count` /
`head_count_kv` arrays), per-head q/k RMSNorms, NEOX rope over half the head with `rope.freq_base` on
full-attention blocks and over `rope.dimension_count_swa` (default the whole head) with
`rope.freq_base_swa` on sliding blocks (`sliding_window_pattern`; a key is visible when
0 ≤ q - k < sliding_window), scale hd^-1/2, a head-wise gate sigmoid(attn_gate · x) on each head's
output -> residual -> ffn_norm -> dense SwiGLU (blocks without a router) or sigmoid-routed MoE
(`exp_probs_b.bias`, renormalised, times `expert_weights_scale`) plus the shared expert; the SwiGLU
of the routed experts is clamped by `swiglu_clamp_exp[i]`, every other SwiGLU by
`swiglu_clamp_shexp[i]` (silu(g) ≤ L, |u| ≤ L; 0 = none) -> residual. All norms hold 1 + w already.
MTP: blocks n_layer..n_layer+k-1 (`HParams.mtp_block`); the target passes its *pre-norm* hidden
state (llama.cpp's `h_nextn`), and each block passes its pre-norm output y to the next (CHAIN_HIDDEN);
logits = shared_head_head(shared_head_norm(y)). Shared with the other chained-MTP graphs: chained.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from specconv.archs.chained_mtp import Sizes
from specconv.archs.errors import SpecconvError
from specconv.archs.step35 import STEP35_TABLE
from specconv.runtime.graphs import chained
from specconv.runtime.graphs.ops import acc, attended_kv, linear, rms_norm, rope_cos_sin, rope_neox_partial
from specconv.archs.hparams import HParamsReader
from specconv.runtime.memory import Batch
from specconv.runtime.validate import check_rope_width



@dataclass(kw_only=True)
class HParams(chained.ChainedHParams):
    head_dim: int
    num_attention_heads: list[int]  # per block
    num_key_value_heads: list[int]
    swa: list[bool]
    n_swa: int
    n_rot_full: int
    n_rot_swa: int
    base_full: float
    base_swa: float
    weights_scale: float
    weights_norm: bool
    clamp_exp: list[float] = field(default_factory=list)
    clamp_shexp: list[float] = field(default_factory=list)

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "HParams":
        # no check_kv here yet: runtime/validate.py types attention.head_count as a scalar, and step35
        # writes it per block (llama.cpp reads it with get_key_or_arr); every key is checked below
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        total, num_nextn_predict_layers = chained.block_counts(r)
        head_dim = key("attention.key_length", type=int)
        if key("attention.value_length", head_dim, int) != head_dim:
            raise SpecconvError(f"{arch}: attention.key_length != value_length")
        num_attention_heads, num_key_value_heads = r.per_layer("attention.head_count", total), r.per_layer("attention.head_count_kv", total)
        for i, (h, k) in enumerate(zip(num_attention_heads, num_key_value_heads)):
            if h % k:
                raise SpecconvError(f"{arch}: block {i} has {h} heads, not a multiple of {k} KV heads")
        rotary_dim = key("rope.dimension_count", head_dim, int)
        base = key("rope.freq_base", 10000.0, float)
        gating = chained.gating(r)
        return cls(arch=arch, num_hidden_layers=total - num_nextn_predict_layers, num_nextn_predict_layers=num_nextn_predict_layers, hidden_size=key("embedding_length", type=int),
                   head_dim=head_dim, num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                   swa=r.per_layer("attention.sliding_window_pattern", total, False, bool),
                   n_swa=key("attention.sliding_window", 0, int),
                   n_rot_full=rotary_dim // 2,  # llama.cpp: full-attention blocks rotate half the rope dims
                   n_rot_swa=key("rope.dimension_count_swa", rotary_dim, int), base_full=base,
                   base_swa=key("rope.freq_base_swa", base, float),
                   eps=key("attention.layer_norm_rms_epsilon", type=float),
                   num_experts_per_tok=key("expert_used_count", 0, int),
                   weights_scale=key("expert_weights_scale", 1.0, float) or 1.0,
                   weights_norm=key("expert_weights_norm", False, bool),
                   clamp_exp=r.per_layer("swiglu_clamp_exp", total, 0.0, float),
                   clamp_shexp=r.per_layer("swiglu_clamp_shexp", total, 0.0, float), gating=gating)


# ---- which tensors the graph needs: the family's table (archs/step35.py) ------------------------

def sizes(hp: HParams) -> Sizes:
    """The table's sizes from GGUF metadata: the vocabulary, FFN widths and expert counts are the file's,
    bound per block."""
    return Sizes(num_hidden_layers=hp.num_hidden_layers, E=hp.hidden_size, V="V", heads=tuple(hp.num_attention_heads), kv_heads=tuple(hp.num_key_value_heads),
                 head_dim=hp.head_dim)


_tensors = chained.tensor_lists(STEP35_TABLE, sizes)
keep_float32 = STEP35_TABLE.keeps_float32


def check_hparams(hp: HParams, kv) -> None:
    check_rope_width(f"half of {hp.arch}.rope.dimension_count (the full-attention blocks' rope)", hp.n_rot_full,
                     hp.head_dim)
    check_rope_width(f"{hp.arch}.rope.dimension_count_swa", hp.n_rot_swa, hp.head_dim)


def check_values(file, hp: HParams, needed: list[str]) -> None:
    chained.check_ffn(file, hp, needed, "exp_probs_b.bias", shared=True)


_layouts = chained.Layouts(lambda hp: hp.head_dim)


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    n, p, hd = a.shape[0], f"blk.{i}.", hp.head_dim
    nh, nkv = hp.num_attention_heads[i], hp.num_key_value_heads[i]
    q = linear(a, w[p + "attn_q.weight"]).view(n, nh, hd)
    k = linear(a, w[p + "attn_k.weight"]).view(n, nkv, hd)
    v = linear(a, w[p + "attn_v.weight"]).view(n, nkv, hd)
    if p + "attn_q_norm.weight" in w:
        q = rms_norm(q, w[p + "attn_q_norm.weight"], hp.eps)
    if p + "attn_k_norm.weight" in w:
        k = rms_norm(k, w[p + "attn_k_norm.weight"], hp.eps)
    cos, sin = rope[1] if hp.swa[i] else rope[0]
    q, k = rope_neox_partial(q, cos, sin), rope_neox_partial(k, cos, sin)
    k_all, v_all, k_pos = attended_kv(batch, i, k, v)
    o = chained.attend(q, k_all, v_all, batch.positions, k_pos, hd ** -0.5, hp.n_swa if hp.swa[i] else 0)
    if p + "attn_gate.weight" in w:  # head-wise gate on each head's output
        o = (acc(o) * torch.sigmoid(acc(linear(a, w[p + "attn_gate.weight"])))[..., None]).to(o.dtype)
    return linear(o.reshape(n, nh * hd), w[p + "attn_output.weight"])


def swiglu_clamped(x: torch.Tensor, gate, up, down, limit: float) -> torch.Tensor:
    g, u = F.silu(linear(x, gate)), linear(x, up)
    if limit > 1e-6:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return linear(g * u, down)


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    return chained.ffn(w, hp, i, x, "exp_probs_b.bias", partial(swiglu_clamped, limit=hp.clamp_shexp[i]),
                       partial(swiglu_clamped, limit=hp.clamp_exp[i]))


def _rope(hp: HParams, batch: Batch):
    return lambda dtype: (rope_cos_sin(batch.positions, hp.n_rot_full, hp.base_full, dtype),
                          rope_cos_sin(batch.positions, hp.n_rot_swa, hp.base_swa, dtype))


_forwards = chained.Forwards(_rope, attention, ffn)


GRAPH = chained.graph(
    "step35", HParams, _tensors, _layouts, _forwards, keep_float32=keep_float32, check_hparams=check_hparams,
    archs=("step35",),  # the GGUF arches this graph runs (graph_for finds it by them)
    PER_LAYER_KEYS=("attention.head_count", "attention.head_count_kv", "swiglu_clamp_exp", "swiglu_clamp_shexp"),
    check_values=check_values,
    CHAIN_HIDDEN="pre_norm",  # a block passes its output before shared_head_norm (vLLM, llama.cpp)
    TARGET_HIDDEN="pre_norm",  # the target's hidden state before output_norm (llama.cpp's step35 h_nextn)
)
