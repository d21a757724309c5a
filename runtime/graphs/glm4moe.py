"""GLM-4.5 graphs (GGUF arch `glm4moe`), docs/reference/model-math.md §4, §3.2, §7.

MAIN: GQA attention with optional q/k/v biases and per-head q/k RMSNorms (before rope), NEOX rope
on the first `rope.dimension_count` dims of each head, scale hd^-1/2; then a dense SwiGLU for the
leading dense blocks and the sigmoid, group-limited MoE with shared experts for the rest.
MTP: the nextn block (block n_layer, always MoE) on eh_proj·[enorm(E[x]); hnorm(h)], its own KV.
Rope (trunk and MTP block) follows the file's YaRN rope.scaling.* as transformers' Glm4Moe does
(docs/reference/model-math.md §1.3); a scaling it cannot run is refused at load.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.glm4moe import GLM4MOE_TABLE, Glm4MoeHParams
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs import moe_sigmoid as ms
from specconv.runtime.graphs.contract import Graph
from specconv.runtime.graphs.decoder import forward_nextn, forward_trunk
from specconv.runtime.graphs.ops import (
    acc, cached_attention, check_rope_scaling, linear, rms_norm, rope_cos_sin_scaled, rope_neox_partial,
)
from specconv.runtime.memory import Batch, MemoryLayout

HParams = Glm4MoeHParams  # from GGUF metadata by from_kv (archs/glm4moe.py)

# Which tensors the graphs need: the family's table (archs/glm4moe.py), read with the file's hparams (a
# block may hold q/k/v biases and q/k norms: optional, loaded when present).
TABLE = GLM4MOE_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)


def main_layout(hp: HParams, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
    return MemoryLayout(attn_layers=list(range(hp.num_hidden_layers)), num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim,
                        rec_layers=[])


def mtp_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=[hp.num_hidden_layers], num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim, rec_layers=[])


def _proj(w, p: str, a: torch.Tensor, part: str) -> torch.Tensor:
    y = linear(a, w[p + part + ".weight"])
    bias = w.get(p + part + ".bias")
    return y if bias is None else (acc(y) + bias.to(acc(y).dtype)).to(y.dtype)


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    n, p = a.shape[0], f"blk.{i}."
    q = _proj(w, p, a, "attn_q").view(n, hp.num_attention_heads, hp.head_dim)
    k = _proj(w, p, a, "attn_k").view(n, hp.num_key_value_heads, hp.head_dim)
    v = _proj(w, p, a, "attn_v").view(n, hp.num_key_value_heads, hp.head_dim)
    if p + "attn_q_norm.weight" in w:
        q = rms_norm(q, w[p + "attn_q_norm.weight"], hp.rms_norm_eps)
    if p + "attn_k_norm.weight" in w:
        k = rms_norm(k, w[p + "attn_k_norm.weight"], hp.rms_norm_eps)
    cos, sin = rope
    q, k = rope_neox_partial(q, cos, sin), rope_neox_partial(k, cos, sin)
    o = cached_attention(batch, i, q, k, v, hp.head_dim ** -0.5)
    return linear(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[p + "attn_output.weight"])


def _block(w, hp: HParams, i: int, h: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    h = h + attention(w, hp, i, rms_norm(h, w[f"blk.{i}.attn_norm.weight"], hp.rms_norm_eps), batch, rope)
    return h + ms.ffn(w, hp, i, rms_norm(h, w[f"blk.{i}.post_attention_norm.weight"], hp.rms_norm_eps))


def rope_for(hp: HParams, positions: torch.Tensor, dtype: torch.dtype):
    return rope_cos_sin_scaled(positions, hp.rotary_dim, hp.rope_theta, hp.rope_scaling, dtype)


def check_hparams(hp: HParams, kv) -> None:
    kind = kv.get(f"{hp.arch}.rope.scaling.type", "none")
    if kind != "none" and hp.rope_scaling is None:  # a type the hparams do not read (archs/nextn_moe_hparams.py)
        raise SpecconvError(f"{hp.arch}.rope.scaling.type {kind!r} is not supported by the runtime (none and yarn are)")
    check_rope_scaling(hp.arch, hp.rope_scaling, hp.rope_theta)


def forward_main(w, hp: HParams, tokens: torch.Tensor, batch: Batch, want_layers: set[int], gdn_mode: str,
                 want_logits: torch.Tensor | None):
    """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = num_hidden_layers: post_norm})."""
    return forward_trunk(w, hp.num_hidden_layers, hp.rms_norm_eps, tokens, want_layers, want_logits,
                         lambda dtype: rope_for(hp, batch.positions, dtype),
                         lambda i, h, rope: _block(w, hp, i, h, batch, rope))


def forward_mtp(w, hp: HParams, tokens: torch.Tensor, hidden_in: torch.Tensor, batch: Batch):
    """Returns (logits, z = normed output fed back when chaining, y = pre-norm output)."""
    return forward_nextn(w, hp.num_hidden_layers, hp.rms_norm_eps, tokens, hidden_in,
                         lambda dtype: rope_for(hp, batch.positions, dtype),
                         lambda i, h, rope: _block(w, hp, i, h, batch, rope))


GRAPH = Graph(
    name="glm4moe",
    archs=("glm4moe",),  # the GGUF arches this graph runs (graph_for finds it by them)
    tensors=_tensors,
    CAPTURABLE=True,
    HParams=HParams,
    main_layout=main_layout,
    mtp_layout=mtp_layout,
    forward_main=forward_main,
    forward_mtp=forward_mtp,
    MULTI_DEVICE=True,  # runs through decoder.forward_trunk, which follows a placement over devices
    check_hparams=check_hparams,  # rope scaling it cannot run is refused at load
)
