"""Qwen3.5 / 3.6, dense (`qwen35`) and MoE (`qwen35moe`), with the `mtp.*` head as nextn blocks.

Mapping and transforms follow docs/reference/gguf-layout.md §7.1 / §7.2 (the pinned llama.cpp converter's
`Qwen3_5TextModel` / `Qwen3_5MoeTextModel`), with specconv's fixes of its pitfalls (§4.4, §7.1):
MTP count from config and names with an error when they disagree, `full_attention_interval` from
the actual layer pattern, `rope.dimension_sections` consistent with the rotary dimension.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from typing import ClassVar

import numpy as np
from gguf import GGUFValueType, Keys

from . import names, register
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, MetaKV
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import output_head, routed_experts, text_model_name
from .qwen35_hparams import Qwen35HParams
from .tensor_table import Hook, TensorSpec, TensorTable, expert_specs, swiglu_specs

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_TOWERS = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.audio_tower.",
           "audio_tower.", "model.multi_modal_projector.", "multi_modal_projector.")

# ---------------------------------------------------------------------- the tensor table


def block_tags(s: Qwen35HParams, bid: int) -> frozenset[str]:
    """A trunk block is recurrent or attention; the MTP block (bid = n_layer) is attention and holds the
    nextn head; the FFN of every block is dense or MoE."""
    mixer = "recurrent" if bid < s.num_hidden_layers and s.recurrent[bid] else "attention"
    return frozenset({mixer, "moe" if s.is_moe else "dense"} | ({"nextn"} if bid == s.num_hidden_layers else set()))


def _norm(gguf: str, hf: str, on: str = "", dim=lambda s: (s.hidden_size,)) -> TensorSpec:
    """A zero-centred RMSNorm: written as 1 + w, kept F32."""
    return TensorSpec(gguf, hf, dim, on, f32=True, transform=lambda s: tf.plus_one)


def _tiled(dim: int, per_head: str, after_qk: bool = False):
    """The value-head re-tiling along `dim` (docs/reference/gguf-layout.md §7.1.1 item 4) of blocks of
    `per_head` rows ("dv" or "1") per value head; `after_qk`: only the channels after q|k."""
    def transform(s: Qwen35HParams):
        start = {"start": s.linear_qk_channels} if after_qk else {}
        return partial(_retiled, dim=dim, nk=s.linear_num_key_heads, r=s.value_heads_per_key_head,
                       block=s.linear_value_head_dim if per_head == "dv" else 1, **start)
    return transform


_LA = "{p}linear_attn."
_MLP = "{p}mlp."
_CONV = lambda s: (s.conv_channels, s.linear_conv_kernel_dim)  # noqa: E731

QWEN35_GDN = (  # Qwen3.5's Gated DeltaNet (Qwen3-Next's differs: archs/qwen3next.py)
    TensorSpec("blk.{bid}.attn_qkv.weight", _LA + "in_proj_qkv.weight", lambda s: (s.conv_channels, s.hidden_size),
               "recurrent", transform=_tiled(0, "dv", after_qk=True)),
    TensorSpec("blk.{bid}.attn_gate.weight", _LA + "in_proj_z.weight",
               lambda s: (s.linear_value_width, s.hidden_size), "recurrent", transform=_tiled(0, "dv")),
    TensorSpec("blk.{bid}.ssm_beta.weight", _LA + "in_proj_b.weight",
               lambda s: (s.linear_num_value_heads, s.hidden_size), "recurrent", transform=_tiled(0, "1")),
    TensorSpec("blk.{bid}.ssm_alpha.weight", _LA + "in_proj_a.weight",
               lambda s: (s.linear_num_value_heads, s.hidden_size), "recurrent", transform=_tiled(0, "1")),
    TensorSpec("blk.{bid}.ssm_a", _LA + "A_log", lambda s: (s.linear_num_value_heads,), "recurrent", f32=True,
               transform=lambda s: partial(_ssm_a, nk=s.linear_num_key_heads, r=s.value_heads_per_key_head)),
    TensorSpec("blk.{bid}.ssm_dt.bias", _LA + "dt_bias", lambda s: (s.linear_num_value_heads,), "recurrent",
               f32=True, transform=_tiled(0, "1")),
    TensorSpec("blk.{bid}.ssm_conv1d.weight", _LA + "conv1d.weight", _CONV, "recurrent", f32=True,
               hf_shape=lambda s: [(s.conv_channels, 1, s.linear_conv_kernel_dim), _CONV(s)],
               transform=lambda s: partial(_conv1d, shape=_CONV(s), nk=s.linear_num_key_heads,
                                           r=s.value_heads_per_key_head, block=s.linear_value_head_dim,
                                           start=s.linear_qk_channels)),
    TensorSpec("blk.{bid}.ssm_norm.weight", _LA + "norm.weight", lambda s: (s.linear_value_head_dim,), "recurrent",
               f32=True),
    TensorSpec("blk.{bid}.ssm_out.weight", _LA + "out_proj.weight", lambda s: (s.hidden_size, s.linear_value_width),
               "recurrent", transform=_tiled(1, "dv")),
)

QWEN35_TABLE = TensorTable((
    TensorSpec(names.TOKEN_EMBD, "model.embed_tokens.weight", lambda s: (s.vocab_dim, s.hidden_size)),
    _norm(names.OUTPUT_NORM, "model.norm.weight"),
    TensorSpec(names.OUTPUT, None, lambda s: (s.vocab_dim, s.hidden_size), optional=True,
               hook="output_head"),  # absent when tied
    _norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
    # full attention; q_proj rows stay per head [q_h ; gate_h]: llama.cpp splits them (§7.1.1 item 5)
    TensorSpec("blk.{bid}.attn_q.weight", "{p}self_attn.q_proj.weight", lambda s: (2 * s.q, s.hidden_size),
               "attention"),
    TensorSpec("blk.{bid}.attn_k.weight", "{p}self_attn.k_proj.weight", lambda s: (s.kv, s.hidden_size), "attention"),
    TensorSpec("blk.{bid}.attn_v.weight", "{p}self_attn.v_proj.weight", lambda s: (s.kv, s.hidden_size), "attention"),
    TensorSpec("blk.{bid}.attn_output.weight", "{p}self_attn.o_proj.weight", lambda s: (s.hidden_size, s.q),
               "attention"),
    _norm("blk.{bid}.attn_q_norm.weight", "{p}self_attn.q_norm.weight", "attention", lambda s: (s.head_dim,)),
    _norm("blk.{bid}.attn_k_norm.weight", "{p}self_attn.k_norm.weight", "attention", lambda s: (s.head_dim,)),
    *QWEN35_GDN,
    _norm("blk.{bid}.post_attention_norm.weight", "{p}post_attention_layernorm.weight"),
    *swiglu_specs(_MLP, "dense"),
    TensorSpec("blk.{bid}.ffn_gate_inp.weight", _MLP + "gate.weight", lambda s: (s.num_experts, s.hidden_size), "moe",
               f32=True),
    *expert_specs(),
    *swiglu_specs(_MLP + "shared_expert.", "moe", lambda s: s.shared_expert_intermediate_size, "_shexp"),
    # written {H, 1}, as llama.cpp's converter writes it; its loader (and ours) also take {H}
    TensorSpec("blk.{bid}.ffn_gate_inp_shexp.weight", _MLP + "shared_expert_gate.weight",
               lambda s: (1, s.hidden_size), "moe", f32=True, accepts=lambda s: [(s.hidden_size,)]),
    # the MTP head (block n_layer); the embedding half comes first in eh_proj's input, as in llama.cpp
    TensorSpec("blk.{bid}.nextn.eh_proj.weight", "mtp.fc.weight", lambda s: (s.hidden_size, 2 * s.hidden_size),
               "nextn"),
    _norm("blk.{bid}.nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight", "nextn"),
    _norm("blk.{bid}.nextn.hnorm.weight", "mtp.pre_fc_norm_hidden.weight", "nextn"),
    TensorSpec("blk.{bid}.nextn.shared_head_norm.weight", "mtp.norm.weight", lambda s: (s.hidden_size,), "nextn",
               optional=True, f32=True, transform=lambda s: tf.plus_one),
    TensorSpec("blk.{bid}.nextn.embed_tokens.weight", None, lambda s: (s.vocab_dim, s.hidden_size), "nextn",
               optional=True),
    TensorSpec("blk.{bid}.nextn.shared_head_head.weight", None, lambda s: (s.vocab_dim, s.hidden_size), "nextn",
               optional=True),
), block_tags)


class Qwen35Base(ArchPlugin):
    family: ClassVar[str] = "qwen35"
    moe: ClassVar[bool] = False
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "qwen35"
    HParams: ClassVar[type[Qwen35HParams]] = Qwen35HParams  # Qwen3-Next reads config.json with its own rules

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        hp = self.HParams.from_config(checkpoint.config, self.gguf_arch)
        # config.json states the MTP block count; the checkpoint's blocks are what is converted
        self.hp = replace(hp, num_nextn_predict_layers=self._count_mtp_layers(hp.num_nextn_predict_layers))

    # ------------------------------------------------------------------ naming

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        name = text_model_name(raw_name, _TOWERS, "vision/audio tower (belongs in a separate mmproj file)")
        if isinstance(name, str) and name.startswith("model.mtp."):
            name = name[len("model."):]
        return name

    # ------------------------------------------------------------------ structure

    def _count_mtp_layers(self, configured: int) -> int:
        """k per docs/reference/gguf-layout.md §4.4: from the config (`configured`, 0 when it states none),
        else from `mtp.layers.*`; both must agree."""
        from_names = 0
        for name in self.checkpoint.tensors:
            m = _MTP_LAYER.match(name)
            if m:
                from_names = max(from_names, int(m.group(1)) + 1)
        if configured and not from_names and not any(n.startswith("mtp.") for n in self.checkpoint.tensors):
            # A stripped head: the trunk is still convertible, but only when the user asks for it.
            self.missing_mtp = (f"config.json says mtp_num_hidden_layers={configured}, but the checkpoint "
                                "holds 0 MTP layer(s) (its mtp.* weights were stripped)")
            return 0
        if configured and configured != from_names:
            raise SpecconvError(
                f"config.json says mtp_num_hidden_layers={configured}, but the checkpoint holds "
                f"{from_names} MTP layer(s) (mtp.layers.*); the checkpoint's MTP weights are incomplete")
        if not from_names and any(n.startswith("mtp.") for n in self.checkpoint.tensors):
            raise SpecconvError("checkpoint has mtp.* tensors but no mtp.layers.* block")
        return from_names

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = QWEN35_TABLE  # Qwen3-Next: its own (archs/qwen3next.py)

    def block_prefix(self, bid: int) -> str:
        n = self.hp.num_hidden_layers
        return f"mtp.layers.{bid - n}." if bid >= n else f"model.layers.{bid}."

    def hooks(self) -> dict[str, Hook]:
        return {"output_head": output_head, "experts": routed_experts("num_experts")}

    # ------------------------------------------------------------------ metadata

    # What qwen3next writes differently (its hparams read feed_forward_length and the interval as configured)
    writes_rope_sections: ClassVar[bool] = True  # rope.dimension_sections (M-RoPE); qwen3next: NEOX rope

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        hp = self.hp
        k = hp.num_nextn_predict_layers if keep_mtp else 0
        # Same keys and order as the pinned upstream converter (TextModel, Qwen2Moe, mixins; for
        # qwen3next: TextModel, Qwen2MoeModel, _QwenMtpMixin, Qwen3NextModel).
        w = MetadataWriter(self.gguf_arch)
        w.text_model(hp.num_hidden_layers + k, hp.max_position_embeddings, hp.hidden_size,
                     hp.intermediate_size or None, hp.num_attention_heads, hp.num_key_value_heads,
                     rope_scaling=hp.rope_scaling, rope_sections=hp.mrope_section if self.writes_rope_sections else None,
                     rope_theta=hp.rope_theta, rms_norm_eps=hp.rms_norm_eps,
                     experts=(hp.num_experts, hp.num_experts_per_tok) if hp.is_moe else None, key_length=hp.head_dim)
        if hp.is_moe:
            w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.moe_intermediate_size)
            w.u32(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, hp.shared_expert_intermediate_size)
        w.nextn(k)
        w.u32(Keys.SSM.CONV_KERNEL, hp.linear_conv_kernel_dim)
        w.u32(Keys.SSM.STATE_SIZE, hp.linear_key_head_dim)
        w.u32(Keys.SSM.GROUP_COUNT, hp.linear_num_key_heads)
        w.u32(Keys.SSM.TIME_STEP_RANK, hp.linear_num_value_heads)
        w.u32(Keys.SSM.INNER_SIZE, hp.linear_value_width)
        w.array(names.recurrent_layers_key("{arch}"), list(hp.recurrent) + [False] * k, GGUFValueType.BOOL)
        w.u32(Keys.LLM.FULL_ATTENTION_INTERVAL, hp.full_attention_interval)
        w.u32(Keys.Rope.DIMENSION_COUNT, hp.rotary_dim)
        return w.kv


# ---------------------------------------------------------------------- transforms


@tf.layout_only
def _retiled(ts: list[np.ndarray], dim: int, nk: int, r: int, block: int, start: int = 0) -> np.ndarray:
    return tf.retile_tail(ts[0], dim, start, nk, r, block)


def _ssm_a(ts: list[np.ndarray], nk: int, r: int) -> np.ndarray:
    """ssm_a = -exp(A_log), in value-head tiled order (the two operations commute)."""
    return tf.retile_v_heads(-tf.exp(ts[0]), 0, nk, r, 1)


@tf.layout_only
def _conv1d(ts: list[np.ndarray], shape: tuple[int, int], nk: int, r: int, block: int, start: int) -> np.ndarray:
    """[C,1,K] -> [C,K]; only the V channels (after q|k) are re-tiled."""
    return tf.retile_tail(ts[0].reshape(shape), 0, start, nk, r, block)


@register
class Qwen35(Qwen35Base):
    hf_architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    gguf_arch: ClassVar[str] = names.QWEN35
    hf_reference: ClassVar[dict[str, str]] = {"Qwen3_5ForCausalLM": "Qwen3_5ForCausalLM",  # a release too (key map)
                                                 "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM"}
    moe = False


@register
class Qwen35Moe(Qwen35Base):
    hf_architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    gguf_arch: ClassVar[str] = names.QWEN35MOE
    hf_reference: ClassVar[dict[str, str]] = {"Qwen3_5MoeForCausalLM": "Qwen3_5MoeForCausalLM",
                                                 "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
    moe = True
