"""Hy3 graphs (GGUF arch `hy_v3`), as llama.cpp 0c1e570's src/models/hy-v3.cpp computes them.

MAIN: per block, attn_norm -> GQA attention with per-head q/k RMSNorms before a NEOX rope over the
whole head (rotary_dim = head_dim), scale hd^-1/2 -> residual -> ffn_norm -> a dense SwiGLU (blocks
without `ffn_gate_inp`) or the sigmoid-routed MoE (selection bias `exp_probs_b`, renormalised top-k
weights times `expert_weights_scale`) plus the shared expert -> residual.
MTP: k chained blocks at n_layer..n_layer+k-1. `HParams.mtp_block` picks the block a context runs
(runtime/drafters/mtp.py makes one context per block): u = eh_proj·[enorm(E[x]); hnorm(h)], the
decoder block, z = shared_head_norm(y) (the release's final_layernorm); logits = output(z). The
block chains z, its post-norm output, to the next block (CHAIN_HIDDEN; docs/mtp.md).
What the chained-MTP graphs share (tensor lists, layouts, FFN, block, forwards) is in chained.py.
"""

from __future__ import annotations

import torch

from specconv.archs.hy_v3 import HY_V3_TABLE, HyV3HParams
from specconv.runtime.graphs import chained
from specconv.runtime.graphs.ops import rope_cos_sin
from specconv.runtime.graphs.qwen3 import attention  # Hy3's is Qwen3's: GQA, q/k RMSNorm, NEOX rope
from specconv.runtime.memory import Batch
from specconv.runtime.validate import check_rope_width

_BIAS = "exp_probs_b"  # llama.cpp's hy_v3 names it without a suffix
HParams = HyV3HParams  # read from GGUF metadata by HyV3HParams.from_kv (archs/hy_v3.py)

_tensors = chained.tensor_lists(HY_V3_TABLE)


def check_hparams(hp: HParams, kv) -> None:
    check_rope_width(f"{hp.arch}.attention.key_length (all of it is roped)", hp.head_dim, hp.head_dim)


def check_values(file, hp: HParams, needed: list[str]) -> None:
    chained.check_ffn(file, hp, needed, _BIAS, shared=True)


_layouts = chained.layouts(lambda hp: hp.head_dim)


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    return chained.ffn(w, hp, i, x, _BIAS)


def _rope(w, hp: HParams, batch: Batch):
    return lambda dtype: rope_cos_sin(batch.positions, hp.head_dim, hp.rope_theta, dtype)


_forwards = chained.forwards(_rope, attention, ffn)


GRAPH = chained.graph(
    "hy_v3", HParams, _tensors, _layouts, _forwards, check_hparams=check_hparams,
    archs=("hy_v3",),  # the GGUF arches this graph runs (graph_for finds it by them)
    check_values=check_values,
    CHAIN_HIDDEN="nextn",  # the post-norm block output seeds the next block (vLLM, llama.cpp)
)
