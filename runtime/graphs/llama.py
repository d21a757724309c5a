"""LLaMA-style dense graph (GGUF arch `llama`): the MAIN graph of a plain target (docs/reference/model-math.md §1).

Attention with GQA and NORM rope on adjacent pairs (the converter pair-permuted the q/k rows, so
this equals HF's rotate-half on the original weights), SwiGLU FFN, optional `rope_freqs.weight`
(llama3 scaling: θ_i divided by the stored factor). The attention block is shared with the EAGLE-3
decoder graph, which is the same layer on a 2H input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.hparams import FamilyHParams
from specconv.archs.llama import LLAMA_TABLE, ROPE_FREQS, Sizes
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs.contract import Graph
from specconv.runtime.graphs.decoder import forward_trunk
from specconv.archs.hparams import HParamsReader
from specconv.runtime.graphs.ops import acc, cached_attention, linear, rms_norm, swiglu
from specconv.runtime.memory import Batch, MemoryLayout
from specconv.runtime.validate import check_kv

@dataclass(kw_only=True)
class HParams(FamilyHParams):
    arch: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_base: float
    eps: float
    n_ff: int = 0
    vocab_size: int = 0
    context_length: int = 0
    num_nextn_predict_layers: int = 0  # no MTP layers in this family

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "HParams":
        check_kv(kv)  # types and ranges first: nothing below divides by 0 or compares a str
        r = HParamsReader(kv)
        key = r.key
        hidden_size, num_attention_heads = key("embedding_length", type=int), key("attention.head_count", type=int)
        head_dim = key("attention.key_length", hidden_size // num_attention_heads, int)
        tokens = kv.get("tokenizer.ggml.tokens")
        return cls(arch=r.arch, num_hidden_layers=key("block_count", type=int), hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                   num_key_value_heads=key("attention.head_count_kv", num_attention_heads, int), head_dim=head_dim,
                   rotary_dim=key("rope.dimension_count", head_dim, int), rope_base=key("rope.freq_base", 10000.0, float),
                   eps=key("attention.layer_norm_rms_epsilon", type=float), n_ff=key("feed_forward_length", 0, int),
                   vocab_size=key("vocab_size", 0, int) or (len(tokens) if tokens is not None else 0),
                   context_length=key("context_length", 0, int))


# ---- which tensors the graph needs: the family's table (archs/llama.py) ------------------------

TABLE = LLAMA_TABLE


def sizes(hp: HParams) -> Sizes:
    """The table's sizes from GGUF metadata; the vocabulary is the file's ("V", bound by its tensors)."""
    return Sizes(num_hidden_layers=hp.num_hidden_layers, E=hp.hidden_size, V="V", num_attention_heads=hp.num_attention_heads, num_key_value_heads=hp.num_key_value_heads,
                 head_dim=hp.head_dim, ffn=hp.n_ff, rotary_dim=hp.rotary_dim)


_tensors = GraphTensors(TABLE, sizes)  # no MTP head: the MTP lists are empty


def check_hparams(hp: HParams, kv: Mapping[str, Any]) -> None:
    if not hp.n_ff:
        raise SpecconvError(f"{hp.arch}.feed_forward_length is missing or 0")


def main_layout(hp: HParams, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
    return MemoryLayout(attn_layers=list(range(hp.num_hidden_layers)), num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim,
                        rec_layers=[])


def mtp_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=[], num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim, rec_layers=[])


# ---- blocks -----------------------------------------------------------------------------------

def rope_norm(positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype,
              factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, rotary_dim/2] with θ_i = base^(-2i/rotary_dim) / factor_i (llama.cpp's rope_freqs divide θ)."""
    exponent = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponent)
    if factors is not None:
        inv_freq = inv_freq / factors.float().to(inv_freq.device)
    angles = positions.to(dtype)[:, None] * inv_freq.to(dtype)[None, :]
    return angles.cos(), angles.sin()


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NORM rope: rotate adjacent pairs (2i, 2i+1) of the first 2·cos.shape[-1] dims; x: [n, heads, hd]."""
    d = 2 * cos.shape[-1]
    xr = acc(x[..., :d]).unflatten(-1, (d // 2, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([rotated, x[..., d:]], dim=-1)


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    """Plain GQA attention of block i on input rows `a` (any width the q/k/v matrices take)."""
    n = a.shape[0]
    q = linear(a, w[f"blk.{i}.attn_q.weight"]).view(n, hp.num_attention_heads, hp.head_dim)
    k = linear(a, w[f"blk.{i}.attn_k.weight"]).view(n, hp.num_key_value_heads, hp.head_dim)
    v = linear(a, w[f"blk.{i}.attn_v.weight"]).view(n, hp.num_key_value_heads, hp.head_dim)
    cos, sin = rope
    q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
    o = cached_attention(batch, i, q, k, v, hp.head_dim ** -0.5)
    return linear(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[f"blk.{i}.attn_output.weight"])


def ffn(w, i: int, x: torch.Tensor) -> torch.Tensor:
    p = f"blk.{i}."
    return swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])


def rope_for(w, hp: HParams, positions: torch.Tensor, dtype: torch.dtype):
    return rope_norm(positions, hp.rotary_dim, hp.rope_base, dtype, w.get(ROPE_FREQS))


# ---- graph ------------------------------------------------------------------------------------

def _block(w, hp: HParams, i: int, h: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    h = h + attention(w, hp, i, rms_norm(h, w[f"blk.{i}.attn_norm.weight"], hp.eps), batch, rope)
    return h + ffn(w, i, rms_norm(h, w[f"blk.{i}.ffn_norm.weight"], hp.eps))


def forward_main(w, hp: HParams, tokens: torch.Tensor, batch: Batch, want_layers: set[int], gdn_mode: str,
                 want_logits: torch.Tensor | None):
    """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = num_hidden_layers: post_norm})."""
    return forward_trunk(w, hp.num_hidden_layers, hp.eps, tokens, want_layers, want_logits,
                         lambda dtype: rope_for(w, hp, batch.positions, dtype),
                         lambda i, h, rope: _block(w, hp, i, h, batch, rope))


def forward_mtp(*args, **kwargs):
    raise SpecconvError("llama files have no MTP head")


GRAPH = Graph(
    name="llama",
    archs=("llama",),  # the GGUF arches this graph runs (graph_for finds it by them)
    tensors=_tensors,
    CAPTURABLE=True,
    HParams=HParams,
    main_layout=main_layout,
    mtp_layout=mtp_layout,
    forward_main=forward_main,
    forward_mtp=forward_mtp,
    check_hparams=check_hparams,
    MULTI_DEVICE=True,  # runs through decoder.forward_trunk, which follows a placement over devices
)
