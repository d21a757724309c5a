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
from specconv.runtime.graphs import trunk
from specconv.runtime.graphs.ops import (
    Deferred, add_bias, cached_attention, check_rope_scaling, linear_group, rope_cos_sin_scaled,
)
from specconv.runtime.memory import Batch

HParams = Glm4MoeHParams  # from GGUF metadata by from_kv (archs/glm4moe.py)

# Which tensors the graphs need: the family's table (archs/glm4moe.py), read with the file's hparams (a
# block may hold q/k/v biases and q/k norms: optional, loaded when present).
TABLE = GLM4MOE_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)


_layouts = trunk.Layouts(lambda hp: hp.head_dim, trunk.nextn_block)  # the nextn block has its own KV


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> Deferred:
    n, p = a.shape[0], f"blk.{i}."
    parts = ("attn_q", "attn_k", "attn_v")  # one normed input: one grouped product, then the optional biases
    q, k, v = (add_bias(y, w.get(p + part + ".bias"))
               for y, part in zip(linear_group(a, [w[p + part + ".weight"] for part in parts]), parts))
    q = q.view(n, hp.num_attention_heads, hp.head_dim)
    k = k.view(n, hp.num_key_value_heads, hp.head_dim)
    v = v.view(n, hp.num_key_value_heads, hp.head_dim)
    o = cached_attention(batch, i, q, k, v, w.get(p + "attn_q_norm.weight"), w.get(p + "attn_k_norm.weight"),
                         hp.rms_norm_eps, rope, hp.head_dim ** -0.5)  # q / k norms optional
    # the output product made with the residual add and the norm after it (ops.add_rms_norm)
    return Deferred(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[p + "attn_output.weight"])


def rope(w, hp: HParams, batch: Batch):
    return lambda dtype: rope_cos_sin_scaled(batch.positions, hp.rotary_dim, hp.rope_theta, hp.rope_scaling, dtype)


def check_hparams(hp: HParams, kv) -> None:
    kind = kv.get(f"{hp.arch}.rope.scaling.type", "none")
    if kind != "none" and hp.rope_scaling is None:  # a type the hparams do not read (archs/nextn_moe_hparams.py)
        raise SpecconvError(f"{hp.arch}.rope.scaling.type {kind!r} is not supported by the runtime (none and yarn are)")
    check_rope_scaling(hp.arch, hp.rope_scaling, hp.rope_theta)


GRAPH = trunk.graph(
    "glm4moe", HParams, _tensors, _layouts.main_layout, _layouts.mtp_layout,
    trunk.Trunk(rope, trunk.prenorm(attention, ms.ffn, ffn_norm="post_attention_norm"), mtp_block=trunk.nextn_block),
    archs=("glm4moe",),  # the GGUF arches this graph runs (graph_for finds it by them)
    check_hparams=check_hparams,  # rope scaling it cannot run is refused at load
)
