"""Qwen3 / Qwen3-MoE graphs (GGUF arch `qwen3`, `qwen3moe`): the MAIN graph of a plain target or
draft model (docs/reference/model-math.md §1, §3.1).

Each block: RMSNorm -> GQA attention whose q and k heads are RMS-normed per head (`attn_q_norm`,
`attn_k_norm`, head_dim wide) before NEOX rope (rotate-half, the HF order the converter keeps) ->
residual -> RMSNorm -> SwiGLU FFN, or for qwen3moe a softmax router over all experts, top-k, the k
weights renormalised unless the file says `expert_weights_norm = false` (llama.cpp's qwen3moe
always renormalises; archs/qwen3.py writes the key only for checkpoints with norm_topk_prob=false).
No shared expert, no MTP head. The trunk runs through decoder.forward_trunk (multi-device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import math

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.hparams import FamilyHParams
from specconv.archs.qwen3 import QWEN3_TABLE, Sizes
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs.contract import Graph
from specconv.runtime.graphs.decoder import forward_trunk
from specconv.archs.hparams import HParamsReader
from specconv.runtime.backend import Experts
from specconv.runtime.graphs.ops import (
    acc, cached_attention, linear, moe as routed_moe, rms_norm, rope_cos_sin, rope_neox_partial, swiglu,
)
from specconv.runtime.memory import Batch, MemoryLayout
from specconv.runtime.validate import check_kv

ARCHES = ("qwen3", "qwen3moe")


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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    n_ff_exp: int = 0
    norm_topk: bool = True
    rope_linear_factor: float = 1.0  # rope.scaling.type linear: positions divided by it
    yarn: dict | None = None  # rope.scaling.type yarn: factor, orig_ctx, beta_fast, beta_slow, attn_factor
    vocab_size: int = 0
    context_length: int = 0
    num_nextn_predict_layers: int = 0  # no MTP head in this family

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "HParams":
        check_kv(kv)  # types and ranges first: nothing below divides by 0 or compares a str
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        hidden_size, num_attention_heads = key("embedding_length", type=int), key("attention.head_count", type=int)
        head_dim = key("attention.key_length", hidden_size // num_attention_heads, int)
        if key("attention.value_length", head_dim, int) != head_dim:
            raise SpecconvError(f"{arch}: attention.value_length differs from key_length")
        scaling = key("rope.scaling.type", None, str)
        factor, yarn = 1.0, None
        if scaling == "linear":
            factor = key("rope.scaling.factor", type=float)
        elif scaling == "yarn":
            yarn = {"factor": key("rope.scaling.factor", type=float),
                    "orig_ctx": key("rope.scaling.original_context_length", type=int),
                    "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0, float),
                    "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0, float),
                    "attn_factor": key("rope.scaling.yarn_attn_factor", None)}
        elif scaling not in (None, "none"):
            raise SpecconvError(f"{arch}: rope scaling {scaling!r} is not supported by the runtime's qwen3 graph "
                                f"(default, linear and yarn are)")
        tokens = kv.get("tokenizer.ggml.tokens")
        hp = cls(arch=arch, num_hidden_layers=key("block_count", type=int), hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                 num_key_value_heads=key("attention.head_count_kv", num_attention_heads, int), head_dim=head_dim,
                 rotary_dim=key("rope.dimension_count", head_dim, int), rope_base=key("rope.freq_base", 10000.0, float),
                 eps=key("attention.layer_norm_rms_epsilon", type=float), n_ff=key("feed_forward_length", 0, int),
                 num_experts=key("expert_count", 0, int), num_experts_per_tok=key("expert_used_count", 0, int),
                 n_ff_exp=key("expert_feed_forward_length", 0, int),
                 norm_topk=key("expert_weights_norm", True, bool), rope_linear_factor=factor, yarn=yarn,
                 vocab_size=key("vocab_size", 0, int) or (len(tokens) if tokens is not None else 0),
                 context_length=key("context_length", 0, int))
        if arch == "qwen3moe" and not (hp.num_experts and 0 < hp.num_experts_per_tok <= hp.num_experts):
            raise SpecconvError(f"qwen3moe file with expert_count {hp.num_experts}, expert_used_count {hp.num_experts_per_tok}")
        if hp.num_attention_heads % hp.num_key_value_heads:
            raise SpecconvError(f"{arch}: head_count {hp.num_attention_heads} is not a multiple of head_count_kv {hp.num_key_value_heads}")
        if not (hp.n_ff_exp if hp.is_moe else hp.n_ff):
            raise SpecconvError(f"{arch}: the feed-forward width is missing or 0")
        return hp


# ---- which tensors the graph needs: the family's table (archs/qwen3.py) ------------------------

TABLE = QWEN3_TABLE


def sizes(hp: HParams) -> Sizes:
    """The table's sizes from GGUF metadata; the vocabulary is the file's ("V", bound by its tensors)."""
    return Sizes(num_hidden_layers=hp.num_hidden_layers, moe=hp.is_moe, E=hp.hidden_size, V="V", num_attention_heads=hp.num_attention_heads, num_key_value_heads=hp.num_key_value_heads,
                 head_dim=hp.head_dim, ffn=hp.n_ff, num_experts=hp.num_experts, expert_ffn=hp.n_ff_exp)


_tensors = GraphTensors(TABLE, sizes)  # no MTP head: the MTP lists are empty


def main_layout(hp: HParams, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
    return MemoryLayout(attn_layers=list(range(hp.num_hidden_layers)), num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim,
                        rec_layers=[])


def mtp_layout(hp: HParams) -> MemoryLayout:
    return MemoryLayout(attn_layers=[], num_key_value_heads=hp.num_key_value_heads, head_dim=hp.head_dim, rec_layers=[])


# ---- blocks -----------------------------------------------------------------------------------

def yarn_inv_freq(hp: HParams, device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2], cos/sin factor) of YaRN as transformers computes them: a linear
    ramp between extrapolated (θ_i) and interpolated (θ_i / factor) frequencies over the correction
    range of dimensions (floored / ceiled), and attention factor 0.1·ln(factor) + 1 unless given."""
    y, d, base = hp.yarn, hp.rotary_dim, hp.rope_base

    def corr(rotations: float) -> float:
        return d * math.log(y["orig_ctx"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(y["beta_fast"])), 0), min(math.ceil(corr(y["beta_slow"])), d - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = base ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d)
    extrapolate = 1 - ((torch.arange(d // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv = (1.0 / (y["factor"] * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    attn = y["attn_factor"]
    attn = float(attn) if attn is not None else (0.1 * math.log(y["factor"]) + 1.0 if y["factor"] > 1 else 1.0)
    return inv, attn


def rope_for(hp: HParams, positions: torch.Tensor, dtype: torch.dtype):
    if hp.yarn is not None:
        inv, attn = yarn_inv_freq(hp, positions.device)
        angles = positions.to(dtype)[:, None] * inv.to(dtype)[None, :]
        return angles.cos() * attn, angles.sin() * attn
    pos = positions if hp.rope_linear_factor == 1.0 else positions.to(dtype) / hp.rope_linear_factor
    return rope_cos_sin(pos, hp.rotary_dim, hp.rope_base, dtype)


def attention(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    """GQA with per-head RMS-normed q and k, NEOX rope on the first rotary_dim dims."""
    n, p = a.shape[0], f"blk.{i}."
    q = linear(a, w[p + "attn_q.weight"]).view(n, hp.num_attention_heads, hp.head_dim)
    k = linear(a, w[p + "attn_k.weight"]).view(n, hp.num_key_value_heads, hp.head_dim)
    v = linear(a, w[p + "attn_v.weight"]).view(n, hp.num_key_value_heads, hp.head_dim)
    q = rms_norm(q, w[p + "attn_q_norm.weight"], hp.eps)
    k = rms_norm(k, w[p + "attn_k_norm.weight"], hp.eps)
    cos, sin = rope
    q, k = rope_neox_partial(q, cos, sin), rope_neox_partial(k, cos, sin)
    o = cached_attention(batch, i, q, k, v, hp.head_dim ** -0.5)
    return linear(o.reshape(n, hp.num_attention_heads * hp.head_dim), w[p + "attn_output.weight"])


def moe(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    """softmax(router·x) over all experts, top-k, weights renormalised over the k when norm_topk;
    only the experts some row chose are evaluated (`W[e]` keeps stored experts packed)."""
    p = f"blk.{i}."
    probs = torch.softmax(acc(linear(acc(x), w[p + "ffn_gate_inp.weight"])), dim=-1)
    weights, chosen = torch.topk(probs, hp.num_experts_per_tok, dim=-1)
    if hp.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    experts = Experts(w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"],
                      swiglu)
    return routed_moe(x, weights, chosen, experts).to(x.dtype)


def ffn(w, hp: HParams, i: int, x: torch.Tensor) -> torch.Tensor:
    if hp.is_moe:
        return moe(w, hp, i, x)
    p = f"blk.{i}."
    return swiglu(x, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])


def block(w, hp: HParams, i: int, h: torch.Tensor, batch: Batch, rope) -> torch.Tensor:
    h = h + attention(w, hp, i, rms_norm(h, w[f"blk.{i}.attn_norm.weight"], hp.eps), batch, rope)
    return h + ffn(w, hp, i, rms_norm(h, w[f"blk.{i}.ffn_norm.weight"], hp.eps))


# ---- graph ------------------------------------------------------------------------------------

def forward_main(w, hp: HParams, tokens: torch.Tensor, batch: Batch, want_layers: set[int], gdn_mode: str,
                 want_logits: torch.Tensor | None):
    """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = num_hidden_layers: post_norm})."""
    return forward_trunk(w, hp.num_hidden_layers, hp.eps, tokens, want_layers, want_logits,
                         lambda dtype: rope_for(hp, batch.positions, dtype),
                         lambda i, h, rope: block(w, hp, i, h, batch, rope))


def forward_mtp(*args, **kwargs):
    raise SpecconvError("qwen3 / qwen3moe files have no MTP head")


GRAPH = Graph(
    name="qwen3",
    archs=ARCHES,  # the GGUF arches this graph runs (graph_for finds it by them)
    tensors=_tensors,
    CAPTURABLE=True,
    HParams=HParams,
    main_layout=main_layout,
    mtp_layout=mtp_layout,
    forward_main=forward_main,
    forward_mtp=forward_mtp,
    MULTI_DEVICE=True,  # runs through decoder.forward_trunk, which follows a placement over devices
)
