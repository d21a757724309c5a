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

from functools import partial
from typing import ClassVar

import numpy as np

from . import names, register
from . import transforms as tf
from .base import Checkpoint
from .config_reader import ConfigReader
from .errors import SpecconvError
from .qwen35 import QWEN35_TABLE, Qwen35Base
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
_CONV = lambda s: (s.conv_channels, s.conv_kernel)  # noqa: E731

# Qwen3.5's table (archs/qwen35.py) with this Gated DeltaNet: q|k|v and z gathered from one projection,
# b|a as one tensor, no value-head re-tiling
QWEN3NEXT_TABLE = QWEN35_TABLE.replacing("recurrent", (
    TensorSpec("blk.{bid}.attn_qkv.weight", _LA + "in_proj_qkvz.weight", lambda s: (s.conv_channels, s.E),
               "recurrent", hf_shape=lambda s: (s.nk * (2 * s.dk + 2 * s.r * s.dv), s.E),
               transform=lambda s: partial(qkvz_part, nk=s.nk, dk=s.dk, vr=s.r * s.dv, part="qkv")),
    TensorSpec("blk.{bid}.attn_gate.weight", _LA + "in_proj_qkvz.weight", lambda s: (s.nv * s.dv, s.E),
               "recurrent", hf_shape=lambda s: (s.nk * (2 * s.dk + 2 * s.r * s.dv), s.E),
               transform=lambda s: partial(qkvz_part, nk=s.nk, dk=s.dk, vr=s.r * s.dv, part="z")),
    TensorSpec("blk.{bid}.ssm_ba.weight", _LA + "in_proj_ba.weight", lambda s: (2 * s.nv, s.E), "recurrent"),
    TensorSpec("blk.{bid}.ssm_a", _LA + "A_log", lambda s: (s.nv,), "recurrent", f32=True,
               transform=lambda s: neg_exp),
    TensorSpec("blk.{bid}.ssm_dt.bias", _LA + "dt_bias", lambda s: (s.nv,), "recurrent", f32=True),
    TensorSpec("blk.{bid}.ssm_conv1d.weight", _LA + "conv1d.weight", _CONV, "recurrent", f32=True,
               hf_shape=lambda s: [(s.conv_channels, 1, s.conv_kernel), _CONV(s)],
               transform=lambda s: partial(tf.reshape, shape=_CONV(s))),
    TensorSpec("blk.{bid}.ssm_norm.weight", _LA + "norm.weight", lambda s: (s.dv,), "recurrent", f32=True),
    TensorSpec("blk.{bid}.ssm_out.weight", _LA + "out_proj.weight", lambda s: (s.E, s.nv * s.dv), "recurrent"),
))


@register
class Qwen3Next(Qwen35Base):
    hf_architectures = ("Qwen3NextForCausalLM",)
    gguf_arch: ClassVar[str] = names.QWEN3NEXT
    hf_reference: ClassVar[dict[str, str]] = {"Qwen3NextForCausalLM": "Qwen3NextForCausalLM"}
    family: ClassVar[str] = "qwen3next"
    moe: ClassVar[bool] = True
    tokenizer_pre: ClassVar[str] = "qwen2"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        tc = ConfigReader(checkpoint.config).text_model()
        self.ffn = tc.integer("intermediate_size", default=None, min=1)
        # llama.cpp's qwen3next loader gives every block a router and experts, and always renormalises
        # the top-k weights (docs/reference/gguf-layout.md §7.3): refuse configs transformers would run otherwise.
        if tc.integers("mlp_only_layers", default=None) or tc.integer("decoder_sparse_step", default=1) != 1:
            raise SpecconvError("config.json: dense layers (mlp_only_layers / decoder_sparse_step != 1) are not "
                                "supported (llama.cpp's qwen3next has MoE in every block)")
        if not tc.flag("norm_topk_prob", default=True):
            raise SpecconvError("config.json: norm_topk_prob=false is not supported (llama.cpp's qwen3next always "
                                "renormalises the top-k expert weights)")
        self.interval = tc.integer("full_attention_interval", default=4, min=1)

    table: ClassVar[TensorTable] = QWEN3NEXT_TABLE

    # metadata: Qwen35Base's keys and order, with these three differences
    writes_rope_sections: ClassVar[bool] = False

    def _feed_forward_length(self) -> int | None:
        return self.ffn

    def _full_attention_interval(self) -> int:
        return self.interval  # as configured (default 4); recurrent_layers carries the actual pattern
