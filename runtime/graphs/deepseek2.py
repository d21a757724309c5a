"""DeepSeek-V3 graphs (GGUF arch `deepseek2`), docs/reference/model-math.md §5, §3.2, §7.

Attention is Multi-head Latent Attention in the **absorbed** form, as llama.cpp runs it: the cache
holds one latent row per token, `[c (kv_lora) | rope(k_pe) (dr)]`; each head's no-rope query is
mapped into the latent space with `attn_k_b` (q_lat = W_kbᵀ·q_nope), scores are
`q_lat·c + q_pe·k_pe`, the softmax-weighted latent is mapped back per head with `attn_v_b`. It
equals HF's expanded form up to rounding and keeps the cache at kv_lora + dr numbers per token
instead of nh·(dn+dr+dv). The latent row is stored once: V is a view of each K cell's first kv_lora
entries (the layout's value_width), and the attention reads each cell once (ops.cached_latent_attention).
The per-head products by attn_k_b and attn_v_b run by index (ops.linear_per_head: one launch each on
CUDA, the weights read packed).

Rope is llama.cpp's NORM kind (adjacent pairs) on the dr rope dims, with YaRN frequencies, cos/sin
factor and the mscale² softmax factor computed as transformers does (docs/reference/model-math.md §1.3, §5).
The FFN is dense SwiGLU for the leading dense blocks and the sigmoid group-limited MoE otherwise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from specconv.archs.deepseek2 import DEEPSEEK2_TABLE, Deepseek2HParams
from specconv.archs.rope_scaling import RopeScaling
from specconv.archs.tensor_table import GraphTensors
from specconv.runtime.graphs import moe_sigmoid as ms
from specconv.runtime.graphs import trunk
from specconv.runtime.graphs.ops import (
    Deferred, cached_latent_attention, linear, linear_group, linear_per_head, rms_norm, rope_pairs, rope_table,
)
from specconv.runtime.memory import Batch

HParams = Deepseek2HParams  # from GGUF metadata by from_kv (archs/deepseek2.py)

# Which tensors the graphs need: the family's table (archs/deepseek2.py), read with the file's hparams.
TABLE = DEEPSEEK2_TABLE
_tensors = GraphTensors(TABLE, lambda hp: hp)


_layouts = trunk.Layouts(lambda hp: hp.latent_width, trunk.nextn_block, heads=lambda hp: 1)


def latent_layouts(layouts: trunk.Layouts) -> tuple:
    """(main, MTP) layout functions of `layouts` whose V cells are each K cell's first kv_lora entries:
    one latent row per token and block (the nextn block's too), kept once."""
    def main(hp, *args):
        return replace(layouts.main_layout(hp, *args), value_width=hp.kv_lora_rank)

    def mtp(hp):
        return replace(layouts.mtp_layout(hp), value_width=hp.kv_lora_rank)
    return main, mtp


main_layout, mtp_layout = latent_layouts(_layouts)


# ---- rope ---------------------------------------------------------------------------------------

def _yarn_get_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn(hp: HParams) -> RopeScaling | None:
    """The file's YaRN scaling, None without one (or with factor 1)."""
    s = hp.rope_scaling
    return s if s is not None and s.factor != 1.0 else None


def inv_freq(hp: HParams, device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dr/2] in float32, cos/sin factor), as transformers' default / YaRN rope."""
    return _inv_freq(hp.qk_rope_head_dim, float(hp.rope_theta), yarn(hp), torch.device(device))


@functools.lru_cache(maxsize=64)
def _inv_freq(d: int, base: float, scaling: RopeScaling | None, device: torch.device) -> tuple[torch.Tensor, float]:
    """inv_freq's values, made once per device and kept (constants of the file: a forward launches
    nothing for them, and a captured step reads them at fixed addresses)."""
    with torch.inference_mode(False):
        return _frequencies(d, base, scaling, device)


def _frequencies(d: int, base: float, scaling: RopeScaling | None, device: torch.device) -> tuple[torch.Tensor, float]:
    pos_freqs = base ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    f = scaling.factor

    def corr(rotary_dim: float) -> float:
        return d * math.log(scaling.original_context / (rotary_dim * 2 * math.pi)) / (2 * math.log(base))

    beta_fast = 32.0 if scaling.beta_fast is None else scaling.beta_fast  # transformers' defaults
    beta_slow = 1.0 if scaling.beta_slow is None else scaling.beta_slow
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    freq = (1.0 / (f * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if scaling.attn_factor is not None:
        attn = scaling.attn_factor
    elif scaling.mscale_all_dim:
        attn = 1.0  # mscale / mscale_all_dim with mscale = mscale_all_dim, DeepSeek-V3's configuration
    else:
        attn = _yarn_get_mscale(f, 1.0)
    return freq, attn


def softmax_scale(hp: HParams) -> float:
    scaling = yarn(hp)
    m = _yarn_get_mscale(scaling.factor, scaling.mscale_all_dim) if scaling and scaling.mscale_all_dim else 1.0
    return hp.qk_head_dim ** -0.5 * m * m


def rope_cos_sin(hp: HParams, positions: torch.Tensor, dtype: torch.dtype):
    freq, attn = inv_freq(hp, positions.device)
    return rope_table(positions, freq.to(dtype), scale=attn)


# ---- blocks -------------------------------------------------------------------------------------

def mla(w, hp: HParams, i: int, a: torch.Tensor, batch: Batch, rope) -> Deferred:
    n, p = a.shape[0], f"blk.{i}."
    nh, dn, dr, kvl = hp.num_attention_heads, hp.qk_nope_head_dim, hp.qk_rope_head_dim, hp.kv_lora_rank
    # the query's first product and the latent's read the same rows: one launch on CUDA
    q, kv = linear_group(a, (w[p + ("attn_q_a.weight" if hp.q_lora_rank else "attn_q.weight")],
                             w[p + "attn_kv_a_mqa.weight"]))
    if hp.q_lora_rank:
        q = linear(rms_norm(q, w[p + "attn_q_a_norm.weight"], hp.rms_norm_eps), w[p + "attn_q_b.weight"])
    q = q.view(n, nh, dn + dr)
    c = rms_norm(kv[:, :kvl], w[p + "attn_kv_a_norm.weight"], hp.rms_norm_eps)
    cos, sin = rope
    q_pe = rope_pairs(q[..., dn:], cos, sin)  # llama.cpp's NORM rope (adjacent pairs): one kernel each on CUDA
    k_pe = rope_pairs(kv[:, None, kvl:], cos, sin)
    # absorb W_kb into the query: q_lat[h] = W_kb[h]ᵀ q_nope[h]; attn_k_b[h] is [kv_lora, dn]
    q_lat = linear_per_head(q[..., :dn], w[p + "attn_k_b.weight"])
    o = cached_latent_attention(batch, i, q_lat, q_pe, c[:, None, :], k_pe, softmax_scale(hp))  # [n, nh, kv_lora]
    o = linear_per_head(o, w[p + "attn_v_b.weight"])  # attn_v_b[h] is [dv, kv_lora]
    return Deferred(o.reshape(n, nh * hp.v_head_dim), w[p + "attn_output.weight"])  # made with the add and norm


def _rope(w, hp: HParams, batch: Batch):
    return lambda dtype: rope_cos_sin(hp, batch.positions, dtype)


GRAPH = trunk.graph(
    "deepseek2", HParams, _tensors, main_layout, mtp_layout,
    trunk.Trunk(_rope, trunk.prenorm(mla, ms.ffn), mtp_block=trunk.nextn_block),
    archs=("deepseek2",),  # the GGUF arches this graph runs (graph_for finds it by them)
)
