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

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from specconv.archs.chained_mtp import Sizes
from specconv.archs.errors import SpecconvError
from specconv.archs.hy_v3 import HY_V3_TABLE
from specconv.runtime.graphs import chained
from specconv.archs.hparams import HParamsReader
from specconv.runtime.graphs.ops import rope_cos_sin
from specconv.runtime.graphs.qwen3 import attention  # Hy3's is Qwen3's: GQA, q/k RMSNorm, NEOX rope
from specconv.runtime.memory import Batch
from specconv.runtime.validate import check_kv, check_rope_width

_BIAS = "exp_probs_b"  # llama.cpp's hy_v3 names it without a suffix


@dataclass(kw_only=True)
class HParams(chained.ChainedHParams):
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_base: float
    num_experts: int
    weights_scale: float
    weights_norm: bool

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "HParams":
        check_kv(kv)  # types and ranges first (runtime/validate.py)
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        block_count, num_nextn_predict_layers = chained.block_counts(r)
        hidden_size, num_attention_heads = key("embedding_length", type=int), key("attention.head_count", type=int)
        head_dim = key("attention.key_length", hidden_size // num_attention_heads, int)
        if key("attention.value_length", head_dim, int) != head_dim:
            raise SpecconvError(f"{arch}: attention.key_length != value_length")
        num_key_value_heads = key("attention.head_count_kv", num_attention_heads, int)
        if num_attention_heads % num_key_value_heads:
            raise SpecconvError(f"{arch}: {num_attention_heads} heads are not a multiple of {num_key_value_heads} KV heads")
        gating = chained.gating(r)
        return cls(arch=arch, num_hidden_layers=block_count - num_nextn_predict_layers, num_nextn_predict_layers=num_nextn_predict_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                   num_key_value_heads=num_key_value_heads, head_dim=head_dim, eps=key("attention.layer_norm_rms_epsilon", type=float),
                   rope_base=key("rope.freq_base", 10000.0, float), num_experts=key("expert_count", 0, int),
                   num_experts_per_tok=key("expert_used_count", 0, int),
                   weights_scale=key("expert_weights_scale", 1.0, float) or 1.0,
                   weights_norm=key("expert_weights_norm", False, bool), gating=gating)


# ---- which tensors the graph needs: the family's table (archs/hy_v3.py) ------------------------

def sizes(hp: HParams) -> Sizes:
    """The table's sizes from GGUF metadata: the vocabulary, FFN widths and (without expert_count) the
    expert count are the file's, bound per block."""
    total = hp.num_hidden_layers + hp.num_nextn_predict_layers
    return Sizes(num_hidden_layers=hp.num_hidden_layers, E=hp.hidden_size, V="V", heads=(hp.num_attention_heads,) * total, kv_heads=(hp.num_key_value_heads,) * total,
                 head_dim=hp.head_dim, num_experts=hp.num_experts or None)


_tensors = chained.tensor_lists(HY_V3_TABLE, sizes)
keep_float32 = HY_V3_TABLE.keeps_float32


def check_hparams(hp: HParams, kv) -> None:
    check_rope_width(f"{hp.arch}.attention.key_length (all of it is roped)", hp.head_dim, hp.head_dim)


def check_values(file, hp: HParams, needed: list[str]) -> None:
    chained.check_ffn(file, hp, needed, _BIAS, shared=True)


_layouts = chained.Layouts(lambda hp: hp.head_dim)


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    return chained.ffn(w, hp, i, x, _BIAS)


def _rope(hp: HParams, batch: Batch):
    return lambda dtype: rope_cos_sin(batch.positions, hp.head_dim, hp.rope_base, dtype)


_forwards = chained.Forwards(_rope, attention, ffn)


GRAPH = chained.graph(
    "hy_v3", HParams, _tensors, _layouts, _forwards, keep_float32=keep_float32, check_hparams=check_hparams,
    archs=("hy_v3",),  # the GGUF arches this graph runs (graph_for finds it by them)
    check_values=check_values,
    CHAIN_HIDDEN="nextn",  # the post-norm block output seeds the next block (vLLM, llama.cpp)
)
