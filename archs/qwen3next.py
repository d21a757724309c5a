"""Qwen3-Next (`Qwen3NextForCausalLM`) -> GGUF arch `qwen3next`, with the `mtp.*` head as a nextn block.

What it shares with Qwen3.5-MoE (archs/qwen35.py, imported, not copied): names, the `+1` on
zero-centred norms, `ssm_a = -exp(A_log)`, `dt_bias` -> `ssm_dt.bias`, full attention with the
per-head [q | gate] rows, experts (fused or per expert), the gated shared expert, and the MTP head
(`mtp.fc / pre_fc_norm_* / norm / layers.{j}`, count taken from the `mtp.layers.*` names, since the
release's config.json states none). What differs (docs/reference/gguf-layout.md §7.3, llama.cpp's `Qwen3NextModel`):

* `linear_attn.in_proj_qkvz` [nk·(2dk + 2r·dv), H] holds, per key head g, rows [q_g | k_g | v_g | z_g];
  it is gathered into `attn_qkv` = [Q; K; V] and `attn_gate` = Z (each part concatenated over g).
* `linear_attn.in_proj_ba` [2nv, H] (per key head [b_g (r) | a_g (r)]) goes unchanged to `ssm_ba`.
* No value-head re-tiling anywhere: llama.cpp's qwen3next graph repeats key heads in grouped
  (interleaved) order, value head h reading key head h // r, as transformers does.
* KV: `feed_forward_length` is written, no `rope.dimension_sections` (NEOX rope), the configured
  `full_attention_interval` (default 4; `recurrent_layers` carries the actual pattern).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, ClassVar, Mapping

import numpy as np

from . import names, register
from . import transforms as tf
from .config_reader import ConfigReader
from .errors import SpecconvError
from .qwen35 import QWEN35_TABLE, Qwen35Base
from .qwen35_hparams import Qwen35HParams
from .tensor_table import TensorSpec, TensorTable


@tf.layout_only
def qkvz_part(ts: list[np.ndarray], nk: int, dk: int, vr: int, part: str) -> np.ndarray:
    """in_proj_qkvz rows grouped per key head -> [Q; K; V] (part "qkv") or Z (part "z")."""
    w = ts[0].reshape(nk, 2 * dk + 2 * vr, -1)
    if part == "z":
        return np.ascontiguousarray(w[:, 2 * dk + vr:]).reshape(nk * vr, -1)
    q, k, v = w[:, :dk], w[:, dk:2 * dk], w[:, 2 * dk:2 * dk + vr]
    return np.concatenate([q.reshape(nk * dk, -1), k.reshape(nk * dk, -1), v.reshape(nk * vr, -1)], axis=0)


def neg_exp(ts: list[np.ndarray]) -> np.ndarray:
    """ssm_a = -exp(A_log) (correctly rounded, transforms.exp)."""
    return -tf.exp(ts[0])


_LA = "{p}linear_attn."
_CONV = lambda s: (s.conv_channels, s.linear_conv_kernel_dim)  # noqa: E731
# in_proj_qkvz holds per key head q and k (linear_key_head_dim rows each), then v and z (_VR rows each)
_VR = lambda s: s.value_heads_per_key_head * s.linear_value_head_dim  # noqa: E731
_QKVZ = lambda s: (s.linear_num_key_heads * (2 * s.linear_key_head_dim + 2 * _VR(s)), s.hidden_size)  # noqa: E731

# Qwen3.5's table (archs/qwen35.py) with this Gated DeltaNet: q|k|v and z gathered from one projection,
# b|a as one tensor, no value-head re-tiling
QWEN3NEXT_TABLE = QWEN35_TABLE.replacing("recurrent", (
    TensorSpec("blk.{bid}.attn_qkv.weight", _LA + "in_proj_qkvz.weight", lambda s: (s.conv_channels, s.hidden_size),
               "recurrent", hf_shape=_QKVZ, transform=lambda s: partial(
                   qkvz_part, nk=s.linear_num_key_heads, dk=s.linear_key_head_dim, vr=_VR(s), part="qkv")),
    TensorSpec("blk.{bid}.attn_gate.weight", _LA + "in_proj_qkvz.weight",
               lambda s: (s.linear_value_width, s.hidden_size), "recurrent", hf_shape=_QKVZ, transform=lambda s: partial(
                   qkvz_part, nk=s.linear_num_key_heads, dk=s.linear_key_head_dim, vr=_VR(s), part="z")),
    TensorSpec("blk.{bid}.ssm_ba.weight", _LA + "in_proj_ba.weight",
               lambda s: (2 * s.linear_num_value_heads, s.hidden_size), "recurrent"),
    TensorSpec("blk.{bid}.ssm_a", _LA + "A_log", lambda s: (s.linear_num_value_heads,), "recurrent", f32=True,
               transform=lambda s: neg_exp),
    TensorSpec("blk.{bid}.ssm_dt.bias", _LA + "dt_bias", lambda s: (s.linear_num_value_heads,), "recurrent",
               f32=True),
    TensorSpec("blk.{bid}.ssm_conv1d.weight", _LA + "conv1d.weight", _CONV, "recurrent", f32=True,
               hf_shape=lambda s: [(s.conv_channels, 1, s.linear_conv_kernel_dim), _CONV(s)],
               transform=lambda s: partial(tf.reshape, shape=_CONV(s))),
    TensorSpec("blk.{bid}.ssm_norm.weight", _LA + "norm.weight", lambda s: (s.linear_value_head_dim,), "recurrent",
               f32=True),
    TensorSpec("blk.{bid}.ssm_out.weight", _LA + "out_proj.weight", lambda s: (s.hidden_size, s.linear_value_width),
               "recurrent"),
))


class Qwen3NextHParams(Qwen35HParams):
    """Qwen3.5-MoE's fields, read with Qwen3-Next's rules: config.json's `intermediate_size` is written
    as feed_forward_length and its `full_attention_interval` as configured (default 4;
    recurrent_layers carries the actual pattern); a file with rope scaling is refused."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], arch: str = names.QWEN3NEXT) -> Qwen3NextHParams:
        hp = super().from_config(config, arch)
        tc = ConfigReader(config).text_model()
        intermediate_size = tc.integer("intermediate_size", default=None, min=1)
        # llama.cpp's qwen3next loader gives every block a router and experts, and always renormalises
        # the top-k weights (docs/reference/gguf-layout.md §7.3): refuse configs transformers would run otherwise.
        if tc.integers("mlp_only_layers", default=None) or tc.integer("decoder_sparse_step", default=1) != 1:
            raise SpecconvError("config.json: dense layers (mlp_only_layers / decoder_sparse_step != 1) are not "
                                "supported (llama.cpp's qwen3next has MoE in every block)")
        if not tc.flag("norm_topk_prob", default=True):
            raise SpecconvError("config.json: norm_topk_prob=false is not supported (llama.cpp's qwen3next always "
                                "renormalises the top-k expert weights)")
        return replace(hp, intermediate_size=intermediate_size or 0,
                       full_attention_interval=tc.integer("full_attention_interval", default=4, min=1))

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> Qwen3NextHParams:
        hp = super().from_kv(kv)
        if hp.rope_scaling is not None:
            raise SpecconvError(f"{hp.arch}.rope.scaling.type is {hp.rope_scaling.kind!r}: the runtime's qwen3next graph runs "
                                f"unscaled rope only (the releases' configuration)")
        if not hp.num_experts:
            raise SpecconvError("qwen3next file without expert_count (every qwen3next block is MoE)")
        return hp


@register
class Qwen3Next(Qwen35Base):
    hf_architectures = ("Qwen3NextForCausalLM",)
    gguf_arch: ClassVar[str] = names.QWEN3NEXT
    hf_reference: ClassVar[dict[str, str]] = {"Qwen3NextForCausalLM": "Qwen3NextForCausalLM"}
    family: ClassVar[str] = "qwen3next"
    moe: ClassVar[bool] = True
    tokenizer_pre: ClassVar[str] = "qwen2"
    HParams: ClassVar[type[Qwen35HParams]] = Qwen3NextHParams

    table: ClassVar[TensorTable] = QWEN3NEXT_TABLE

    # metadata: Qwen35Base's keys and order, without rope.dimension_sections (and with what
    # Qwen3NextHParams reads differently: feed_forward_length, full_attention_interval)
    writes_rope_sections: ClassVar[bool] = False
