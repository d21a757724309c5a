"""Qwen3.5 / Qwen3.5-MoE graphs (GGUF arch `qwen35`, `qwen35moe`), docs/reference/model-math.md §2, §3.1, §7.

MAIN: the trunk (blocks 0..n_layer-1): gated full attention with partial NEOX rope, Gated DeltaNet,
dense SwiGLU or MoE with a gated shared expert. MTP: the one nextn block (block n_layer) with its
own KV cache; input rows are (token, target post-norm hidden), embedding first in the concat.
Only GGUF names are used here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from specconv.archs.errors import SpecconvError
from specconv.archs.hparams import FamilyHParams
from specconv.archs.qwen35 import QWEN35_TABLE, Sizes
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs import gdn
from specconv.runtime.graphs.contract import Graph
from specconv.runtime.graphs.decoder import forward_nextn, forward_trunk
from specconv.archs.hparams import HParamsReader
from specconv.runtime.graphs.ops import (
    acc, cached_attention, l2_norm, linear, moe_softmax_topk, rms_norm, rope_cos_sin, rope_neox_partial,
    swiglu,
)
from specconv.runtime.memory import Batch, MemoryLayout
from specconv.runtime.validate import check_kv

ARCHES = ("qwen35", "qwen35moe")


@dataclass(kw_only=True)
class HParams(FamilyHParams):
    arch: str
    num_hidden_layers: int  # trunk blocks
    num_nextn_predict_layers: int  # MTP blocks after the trunk
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_base: float
    eps: float
    recurrent: list[bool]  # per trunk block
    conv_kernel: int
    ssm_dk: int  # ssm.state_size
    ssm_groups: int  # nk
    ssm_heads: int  # nv (ssm.time_step_rank)
    ssm_inner: int  # nv * dv
    n_ff: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    context_length: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def ssm_dv(self) -> int:
        return self.ssm_inner // self.ssm_heads

    @property
    def conv_channels(self) -> int:
        return 2 * self.ssm_groups * self.ssm_dk + self.ssm_inner

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "HParams":
        check_kv(kv)  # types and ranges first: nothing below divides by 0 or compares a str
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        block_count = key("block_count", type=int)
        num_nextn_predict_layers = key("nextn_predict_layers", 0, int)
        if num_nextn_predict_layers > block_count:
            raise SpecconvError(f"{arch}.nextn_predict_layers ({num_nextn_predict_layers}) exceeds block_count ({block_count})")
        num_hidden_layers = block_count - num_nextn_predict_layers
        key_len, val_len = key("attention.key_length", type=int), key("attention.value_length", type=int)
        if key_len != val_len:
            raise SpecconvError(f"attention.key_length {key_len} != value_length {val_len}")
        rec = key("attention.recurrent_layers", None, list)
        if rec is not None:
            recurrent = [bool(x) for x in rec[:num_hidden_layers]]
        else:
            interval = key("full_attention_interval", 4, int)
            recurrent = [(i + 1) % interval != 0 for i in range(num_hidden_layers)]
        hp = cls(
            arch=arch, num_hidden_layers=num_hidden_layers, num_nextn_predict_layers=num_nextn_predict_layers, hidden_size=key("embedding_length", type=int),
            num_attention_heads=key("attention.head_count", type=int), num_key_value_heads=_scalar(key("attention.head_count_kv")),
            head_dim=key_len, rotary_dim=key("rope.dimension_count", key_len, int),
            rope_base=key("rope.freq_base", 10000.0, float),
            eps=key("attention.layer_norm_rms_epsilon", type=float), recurrent=recurrent,
            conv_kernel=key("ssm.conv_kernel", type=int), ssm_dk=key("ssm.state_size", type=int),
            ssm_groups=key("ssm.group_count", type=int), ssm_heads=key("ssm.time_step_rank", type=int),
            ssm_inner=key("ssm.inner_size", type=int), n_ff=_scalar(key("feed_forward_length", 0)),
            num_experts=key("expert_count", 0, int), num_experts_per_tok=key("expert_used_count", 0, int),
            n_ff_exp=key("expert_feed_forward_length", 0, int),
            n_ff_shexp=key("expert_shared_feed_forward_length", 0, int),
            context_length=key("context_length", 0, int),
        )
        if hp.ssm_inner % hp.ssm_heads or hp.ssm_heads % hp.ssm_groups:
            raise SpecconvError(f"inconsistent SSM sizes: inner {hp.ssm_inner}, heads {hp.ssm_heads}, groups {hp.ssm_groups}")
        if arch == "qwen35moe" and not hp.num_experts:
            raise SpecconvError("qwen35moe file without expert_count")
        if hp.is_moe and not (hp.n_ff_exp and hp.n_ff_shexp):
            raise SpecconvError(f"{arch}: expert_feed_forward_length and expert_shared_feed_forward_length are needed")
        if not hp.is_moe and not hp.n_ff:
            raise SpecconvError(f"{arch}.feed_forward_length is missing or 0")
        return hp


def _scalar(v):
    """head_count_kv / feed_forward_length may be per-layer lists; this graph needs one value."""
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise SpecconvError(f"per-layer values {v} are not supported by the qwen35 graph")
        return v[0]
    return v


# ---- which tensors the graphs need: the family's table (archs/qwen35.py) -----------------------

TABLE = QWEN35_TABLE


def sizes(hp: HParams) -> Sizes:
    """The table's sizes from GGUF metadata; the vocabulary is the file's ("V", bound by its tensors)."""
    return Sizes(num_hidden_layers=hp.num_hidden_layers, recurrent=tuple(hp.recurrent), moe=hp.is_moe, E=hp.hidden_size, V="V",
                 num_attention_heads=hp.num_attention_heads, num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim, nk=hp.ssm_groups,
                 nv=hp.ssm_heads, dk=hp.ssm_dk, dv=hp.ssm_dv, conv_kernel=hp.conv_kernel, ffn=hp.n_ff,
                 num_experts=hp.num_experts, expert_ffn=hp.n_ff_exp, shared_ffn=hp.n_ff_shexp)


_tensors = GraphTensors(TABLE, sizes)


def main_layout(hp: HParams, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
    return MemoryLayout(
        attn_layers=[i for i in range(hp.num_hidden_layers) if not hp.recurrent[i]], num_key_value_heads=hp.num_key_value_heads,
        head_dim=hp.head_dim, rec_layers=[i for i in range(hp.num_hidden_layers) if hp.recurrent[i]],
        conv_channels=hp.conv_channels, conv_kernel=hp.conv_kernel, ssm_heads=hp.ssm_heads,
        ssm_dk=hp.ssm_dk, ssm_dv=hp.ssm_dv, state_dtype=state_dtype)


def mtp_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=[hp.num_hidden_layers], num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim, rec_layers=[])


# ---- blocks -----------------------------------------------------------------------------------

def gated_attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    n = a.shape[0]
    qg = linear(a, w[f"blk.{i}.attn_q.weight"]).view(n, hp.num_attention_heads, 2 * hp.head_dim)
    q, gate = qg[..., :hp.head_dim], qg[..., hp.head_dim:]  # q and gate interleaved per head
    k = linear(a, w[f"blk.{i}.attn_k.weight"]).view(n, hp.num_key_value_heads, hp.head_dim)
    v = linear(a, w[f"blk.{i}.attn_v.weight"]).view(n, hp.num_key_value_heads, hp.head_dim)
    q = rms_norm(q, w[f"blk.{i}.attn_q_norm.weight"], hp.eps)
    k = rms_norm(k, w[f"blk.{i}.attn_k_norm.weight"], hp.eps)
    cos, sin = rope
    q, k = rope_neox_partial(q, cos, sin), rope_neox_partial(k, cos, sin)
    o = cached_attention(batch, i, q, k, v, hp.head_dim ** -0.5)
    o = o * torch.sigmoid(acc(gate)).to(o.dtype)
    return linear(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[f"blk.{i}.attn_output.weight"])


def gated_deltanet(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, mode: str) -> torch.Tensor:
    n = a.shape[0]
    nk, nv, dk, dv = hp.ssm_groups, hp.ssm_heads, hp.ssm_dk, hp.ssm_dv
    m = linear(a, w[f"blk.{i}.attn_qkv.weight"])  # [n, C] = [q | k | v]
    z = linear(a, w[f"blk.{i}.attn_gate.weight"]).view(n, nv, dv)
    b = acc(linear(a, w[f"blk.{i}.ssm_beta.weight"]))
    alpha = acc(linear(a, w[f"blk.{i}.ssm_alpha.weight"]))
    rec = gdn.Recurrence(batch, i, mode)  # states in and out of the memory's ring
    c = rec.conv(m, w[f"blk.{i}.ssm_conv1d.weight"])
    q = c[:, :nk * dk].view(n, nk, dk)
    k = c[:, nk * dk:2 * nk * dk].view(n, nk, dk)
    v = acc(c[:, 2 * nk * dk:].reshape(n, nv, dv))
    q = l2_norm(q, hp.eps) * dk ** -0.5
    k = l2_norm(k, hp.eps)
    # GGUF value heads are tiled: value head h reads key head h mod nk
    q, k = q.repeat(1, nv // nk, 1), k.repeat(1, nv // nk, 1)
    g, beta = gdn.gates(b, alpha, w[f"blk.{i}.ssm_a"].to(alpha.dtype), w[f"blk.{i}.ssm_dt.bias"].to(alpha.dtype))
    sd = rec.state_dtype  # float32, or float64 for a reference-grade recurrence
    o = rec.delta_rule(q.to(sd), k.to(sd), v.to(sd), g.to(sd), beta.to(sd))
    y = rms_norm(o, w[f"blk.{i}.ssm_norm.weight"], hp.eps) * F.silu(acc(z))
    return linear(y.reshape(n, nv * dv).to(a.dtype), w[f"blk.{i}.ssm_out.weight"])


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    p = f"blk.{i}."
    if not hp.is_moe:
        return swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    routed = moe_softmax_topk(x, w[p + "ffn_gate_inp.weight"], hp.num_experts_per_tok, w[p + "ffn_gate_exps.weight"],
                              w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"])
    shared = swiglu(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
    gate_w = w[p + "ffn_gate_inp_shexp.weight"]  # [1, H]; [H] as llama.cpp's converter writes it
    gate = torch.sigmoid(linear(acc(x), gate_w if gate_w.ndim == 2 else gate_w.reshape(1, -1)))
    return routed + (acc(shared) * gate).to(x.dtype)


# ---- graphs -----------------------------------------------------------------------------------

def _block(w, hp: HParams, i: int, h: torch.Tensor, batch: Batch, rope, gdn_mode: str = "",
           deltanet=gated_deltanet) -> torch.Tensor:
    """`deltanet`: the Gated DeltaNet mixer (this module's by default; Qwen3-Next passes its own)."""
    a = rms_norm(h, w[f"blk.{i}.attn_norm.weight"], hp.eps)
    recurrent = i < hp.num_hidden_layers and hp.recurrent[i]  # the MTP block (i = n_layer) is full attention
    h = h + (deltanet(w, hp, i, a, batch, gdn_mode) if recurrent
             else gated_attention(w, hp, i, a, batch, rope))
    return h + ffn(w, hp, i, rms_norm(h, w[f"blk.{i}.post_attention_norm.weight"], hp.eps))


def forward_main(w, hp: HParams, tokens: torch.Tensor, batch: Batch, want_layers: set[int], gdn_mode: str,
                 want_logits: torch.Tensor | None, deltanet=gated_deltanet):
    """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = num_hidden_layers: post_norm})."""
    return forward_trunk(w, hp.num_hidden_layers, hp.eps, tokens, want_layers, want_logits,
                         lambda dtype: rope_cos_sin(batch.positions, hp.rotary_dim, hp.rope_base, dtype),
                         lambda i, h, rope: _block(w, hp, i, h, batch, rope, gdn_mode, deltanet))


def forward_mtp(w, hp: HParams, tokens: torch.Tensor, hidden_in: torch.Tensor, batch: Batch):
    """One MTP row per token: u = eh_proj·[enorm(E[x]) ; hnorm(h)], one full-attention block,
    z = shared_head_norm(y); returns (logits, z = "nextn", y = pre-norm)."""
    return forward_nextn(w, hp.num_hidden_layers, hp.eps, tokens, hidden_in,
                         lambda dtype: rope_cos_sin(batch.positions, hp.rotary_dim, hp.rope_base, dtype),
                         lambda i, h, rope: _block(w, hp, i, h, batch, rope))


GRAPH = Graph(
    name="qwen35",
    archs=ARCHES,  # the GGUF arches this graph runs (graph_for finds it by them)
    PER_LAYER_KEYS=("attention.head_count_kv", "feed_forward_length"),  # per-layer lists (llama.cpp get_key_or_arr)
    tensors=_tensors,
    CAPTURABLE=True,
    HParams=HParams,
    main_layout=main_layout,
    mtp_layout=mtp_layout,
    forward_main=forward_main,
    forward_mtp=forward_mtp,
    MULTI_DEVICE=True,  # runs through decoder.forward_trunk, which follows a placement over devices
)
