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

from functools import partial

import torch
import torch.nn.functional as F

from specconv.archs.step35 import STEP35_TABLE
from specconv.archs.step35_hparams import Step35HParams
from specconv.runtime.graphs import chained
from specconv.runtime.graphs.ops import (
    Deferred, attend_cells, head_projections, linear, rope_cos_sin, roped_attended_kv, swiglu,
)
from specconv.runtime.memory import Batch
from specconv.runtime.validate import check_rope_width

HParams = Step35HParams  # read from GGUF metadata by Step35HParams.from_kv (archs/step35_hparams.py)

_tensors = chained.tensor_lists(STEP35_TABLE)


def check_hparams(hp: HParams, kv) -> None:
    check_rope_width(f"half of {hp.arch}.rope.dimension_count (the full-attention blocks' rope)", hp.full_rotary_dim,
                     hp.head_dim)
    check_rope_width(f"{hp.arch}.rope.dimension_count_swa", hp.swa_rotary_dim, hp.head_dim)


def check_values(file, hp: HParams, needed: list[str]) -> None:
    chained.check_ffn(file, hp, needed, "exp_probs_b.bias", shared=True)


_layouts = chained.layouts(lambda hp: hp.head_dim)


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> Deferred:
    n, p, hd = a.shape[0], f"blk.{i}.", hp.head_dim
    nh, nkv = hp.num_attention_heads[i], hp.num_key_value_heads[i]
    q, k, v = head_projections(a, [w[p + f"attn_{x}.weight"] for x in "qkv"], (nh, nkv, nkv), hd)
    rope_i = rope[1] if hp.is_sliding(i) else rope[0]
    q, k_all, v_all, k_pos = roped_attended_kv(batch, i, q, k, v, w.get(p + "attn_q_norm.weight"),  # norms optional
                                               w.get(p + "attn_k_norm.weight"), hp.rms_norm_eps, *rope_i)
    gate = linear(a, w[p + "attn_gate.weight"]) if p + "attn_gate.weight" in w else None  # one per head
    o = attend_cells(q, k_all, v_all, batch.positions, k_pos, hd ** -0.5,
                     window=hp.sliding_window if hp.is_sliding(i) else 0, gate=gate)
    return Deferred(o.reshape(n, nh * hd), w[p + "attn_output.weight"])  # made with the add and norm after it


def swiglu_clamped(x: torch.Tensor, gate, up, down, limit: float) -> torch.Tensor:
    """SwiGLU with silu(g) ≤ limit and |u| ≤ limit; without a limit (≤ 1e-6) ops.swiglu, whose product
    is one launch on CUDA."""
    if limit <= 1e-6:
        return swiglu(x, gate, up, down)
    g, u = F.silu(linear(x, gate)), linear(x, up)
    return linear(g.clamp(max=limit) * u.clamp(-limit, limit), down)


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    return chained.ffn(w, hp, i, x, "exp_probs_b.bias", partial(swiglu_clamped, limit=hp.shared_limit(i)),
                       partial(swiglu_clamped, limit=hp.expert_limit(i)))


def _rope(w, hp: HParams, batch: Batch):
    return lambda dtype: (rope_cos_sin(batch.positions, hp.full_rotary_dim, hp.rope_theta, dtype),
                          rope_cos_sin(batch.positions, hp.swa_rotary_dim, hp.swa_rope_theta, dtype))


_forwards = chained.forwards(_rope, attention, ffn)


GRAPH = chained.graph(
    "step35", HParams, _tensors, _layouts, _forwards, check_hparams=check_hparams,
    archs=("step35",),  # the GGUF arches this graph runs (graph_for finds it by them)
    PER_LAYER_KEYS=("attention.head_count", "attention.head_count_kv", "swiglu_clamp_exp", "swiglu_clamp_shexp"),
    check_values=check_values,
    CHAIN_HIDDEN="pre_norm",  # a block passes its output before shared_head_norm (vLLM, llama.cpp)
    TARGET_HIDDEN="pre_norm",  # the target's hidden state before output_norm (llama.cpp's step35 h_nextn)
)
