"""LLaMA-style dense graph (GGUF arch `llama`): the MAIN graph of a plain target (docs/reference/model-math.md §1).

Attention with GQA and NORM rope on adjacent pairs (the converter pair-permuted the q/k rows, so
this equals HF's rotate-half on the original weights), SwiGLU FFN, optional `rope_freqs.weight`
(llama3 scaling: θ_i divided by the stored factor). The attention block is shared with the EAGLE-3
decoder graph, which is the same layer on a 2H input.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.llama import LLAMA_TABLE, ROPE_FREQS, LlamaHParams
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs import trunk
from specconv.runtime.graphs.ops import Deferred, cached_attention, deferred_swiglu, head_projections
from specconv.runtime.memory import Batch

HParams = LlamaHParams  # read from GGUF metadata by LlamaHParams.from_kv (archs/llama.py)

# ---- which tensors the graph needs: the family's table (archs/llama.py), shapes from the hparams --

TABLE = LLAMA_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)  # no MTP head: the MTP lists are empty


def check_hparams(hp: HParams, kv: Mapping[str, Any]) -> None:
    if not hp.intermediate_size:
        raise SpecconvError(f"{hp.arch}.feed_forward_length is missing or 0")


_layouts = trunk.Layouts(lambda hp: hp.head_dim)  # every block attends; no MTP block


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


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> Deferred:
    """Plain GQA attention of block i on input rows `a` (any width the q/k/v matrices take), its output
    product left to the add and norm after it (ops.add_rms_norm)."""
    n = a.shape[0]
    q, k, v = head_projections(a, [w[f"blk.{i}.attn_{x}.weight"] for x in "qkv"],
                               (hp.num_attention_heads, hp.num_key_value_heads, hp.num_key_value_heads), hp.head_dim)
    # NORM rope of q and k (no norms), K/V stored: one kernel on CUDA
    o = cached_attention(batch, i, q, k, v, None, None, 0.0, rope, hp.head_dim ** -0.5, style="norm")
    return Deferred(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[f"blk.{i}.attn_output.weight"])


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> Deferred:
    p = f"blk.{i}."
    return deferred_swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])


def rope_for(w, hp: HParams, positions: torch.Tensor, dtype: torch.dtype):
    return rope_norm(positions, hp.rotary_dim, hp.rope_theta, dtype, w.get(ROPE_FREQS))


GRAPH = trunk.graph(
    "llama", HParams, _tensors, _layouts.main_layout, _layouts.mtp_layout,
    trunk.Trunk(lambda w, hp, batch: lambda dtype: rope_for(w, hp, batch.positions, dtype),
                trunk.prenorm(attention, ffn)),  # no MTP head
    archs=("llama",),  # the GGUF arches this graph runs (graph_for finds it by them)
    check_hparams=check_hparams,
)
