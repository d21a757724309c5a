"""Qwen3.5 / 3.6, dense (`qwen35`) and MoE (`qwen35moe`), with the `mtp.*` head as nextn blocks.

Mapping and transforms follow docs/reference/gguf-layout.md §7.1 / §7.2 (the pinned llama.cpp converter's
`Qwen3_5TextModel` / `Qwen3_5MoeTextModel`), with specconv's fixes of its pitfalls (§4.4, §7.1):
MTP count from config and names with an error when they disagree, `full_attention_interval` from
the actual layer pattern, `rope.dimension_sections` consistent with the rotary dimension.
"""

from __future__ import annotations

import re
from functools import partial
from typing import ClassVar

import numpy as np
from gguf import GGUFValueType, Keys

from . import names, register
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import RolePlan, add_output_head, add_swiglu, embedding_rows, plan_experts, text_model_name
from .qwen35_hparams import Qwen35Hparams, parse_hparams

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_TOWERS = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.audio_tower.",
           "audio_tower.", "model.multi_modal_projector.", "multi_modal_projector.")

class Qwen35Base(ArchPlugin):
    family: ClassVar[str] = "qwen35"
    moe: ClassVar[bool] = False
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "qwen35"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.hp: Qwen35Hparams = parse_hparams(checkpoint.config, self.moe)
        self._k = self._count_mtp_layers()

    # ------------------------------------------------------------------ naming

    @property
    def gguf_arch(self) -> str:
        return names.QWEN35MOE if self.moe else names.QWEN35

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        name = text_model_name(raw_name, _TOWERS, "vision/audio tower (belongs in a separate mmproj file)")
        if isinstance(name, str) and name.startswith("model.mtp."):
            name = name[len("model."):]
        return name

    # ------------------------------------------------------------------ structure

    @property
    def n_trunk_layers(self) -> int:
        return self.hp.n_layer

    @property
    def n_mtp_layers(self) -> int:
        return self._k

    def _count_mtp_layers(self) -> int:
        """k per docs/reference/gguf-layout.md §4.4: from the config, else from `mtp.layers.*`; both must agree."""
        from_names = 0
        for name in self.checkpoint.tensors:
            m = _MTP_LAYER.match(name)
            if m:
                from_names = max(from_names, int(m.group(1)) + 1)
        configured = self.hp.mtp_layers_config
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

    def vocab_size(self) -> int:
        return embedding_rows(self.checkpoint)

    # ------------------------------------------------------------------ tensors

    def tensor_plan(self) -> list[TensorPlan]:
        hp, plan = self.hp, RolePlan(self.checkpoint.tensors)
        H, V = hp.hidden, hp.vocab
        plan.add(names.TOKEN_EMBD, [plan.source("model.embed_tokens.weight", (V, H))], (V, H), Role.SHARED)
        for i in range(hp.n_layer):
            self._block(plan, i, f"model.layers.{i}.", linear=hp.recurrent[i], role=Role.TRUNK)
        plan.add(names.OUTPUT_NORM, [plan.source("model.norm.weight", (H,))], (H,), Role.SHARED, tf.plus_one, True)
        add_output_head(plan, hp.tie_embeddings, V, H)
        for j in range(self._k):
            bid = hp.n_layer + j
            if j == 0:
                self._nextn_extras(plan, bid)
            self._block(plan, bid, f"mtp.layers.{j}.", linear=False, role=Role.MTP)
        return plan.finish(self.gguf_arch)

    def _nextn_extras(self, plan: RolePlan, bid: int) -> None:
        H = self.hp.hidden
        eh_proj = plan.source("mtp.fc.weight", (H, 2 * H))  # input order: embedding half first, as llama.cpp
        plan.add(names.nextn(bid, names.NEXTN_EH_PROJ), [eh_proj], (H, 2 * H), Role.MTP)
        for part, hf in ((names.NEXTN_ENORM, "pre_fc_norm_embedding"), (names.NEXTN_HNORM, "pre_fc_norm_hidden"),
                         (names.NEXTN_SHARED_HEAD_NORM, "norm")):
            plan.add(names.nextn(bid, part), [plan.source(f"mtp.{hf}.weight", (H,))], (H,), Role.MTP, tf.plus_one, True)

    def _block(self, plan: RolePlan, bid: int, p: str, linear: bool, role: Role) -> None:
        H = self.hp.hidden
        plan.add(names.blk(bid, "attn_norm"), [plan.source(p + "input_layernorm.weight", (H,))], (H,), role,
                 tf.plus_one, True)
        (self._gated_delta_net if linear else self._attention)(plan, bid, p, role)
        plan.add(names.blk(bid, "post_attention_norm"), [plan.source(p + "post_attention_layernorm.weight", (H,))],
                 (H,), role, tf.plus_one, True)
        (self._moe if self.moe else self._mlp)(plan, bid, p, role)

    def _attention(self, plan: RolePlan, bid: int, p: str, role: Role) -> None:
        hp = self.hp
        H, q, kv = hp.hidden, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        a = p + "self_attn."
        # q_proj rows stay per head [q_h ; gate_h]: llama.cpp splits them itself (§7.1.1 item 5).
        for gguf_part, hf, shape in (("attn_q", "q_proj", (2 * q, H)), ("attn_k", "k_proj", (kv, H)),
                                     ("attn_v", "v_proj", (kv, H)), ("attn_output", "o_proj", (H, q))):
            plan.add(names.blk(bid, gguf_part), [plan.source(f"{a}{hf}.weight", shape)], shape, role)
        for gguf_part, hf in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
            plan.add(names.blk(bid, gguf_part), [plan.source(f"{a}{hf}.weight", (hp.head_dim,))], (hp.head_dim,),
                     role, tf.plus_one, True)

    def _gated_delta_net(self, plan: RolePlan, bid: int, p: str, role: Role) -> None:
        hp = self.hp
        H, nk, nv, r, dv, C, K = hp.hidden, hp.nk, hp.nv, hp.r, hp.dv, hp.conv_channels, hp.conv_kernel
        a = p + "linear_attn."
        # Every tensor indexed by value head is re-tiled with the same permutation (§7.1.1 item 4).
        rows = partial(_retiled, dim=0, nk=nk, r=r)
        plan.add(names.blk(bid, "attn_qkv"), [plan.source(a + "in_proj_qkv.weight", (C, H))], (C, H), role,
                 partial(_retiled, dim=0, nk=nk, r=r, block=dv, start=hp.qk_channels))
        plan.add(names.blk(bid, "attn_gate"), [plan.source(a + "in_proj_z.weight", (nv * dv, H))], (nv * dv, H),
                 role, partial(rows, block=dv))
        plan.add(names.blk(bid, "ssm_beta"), [plan.source(a + "in_proj_b.weight", (nv, H))], (nv, H), role,
                 partial(rows, block=1))
        plan.add(names.blk(bid, "ssm_alpha"), [plan.source(a + "in_proj_a.weight", (nv, H))], (nv, H), role,
                 partial(rows, block=1))
        plan.add(names.blk(bid, "ssm_a", None), [plan.source(a + "A_log", (nv,))], (nv,), role,
                 partial(_ssm_a, nk=nk, r=r), True)
        plan.add(names.blk(bid, "ssm_dt", "bias"), [plan.source(a + "dt_bias", (nv,))], (nv,), role,
                 partial(rows, block=1), True)
        plan.add(names.blk(bid, "ssm_conv1d"), [plan.source(a + "conv1d.weight", [(C, 1, K), (C, K)])], (C, K), role,
                 partial(_conv1d, shape=(C, K), nk=nk, r=r, block=dv, start=hp.qk_channels), True)
        plan.add(names.blk(bid, "ssm_norm"), [plan.source(a + "norm.weight", (dv,))], (dv,), role, tf.identity, True)
        plan.add(names.blk(bid, "ssm_out"), [plan.source(a + "out_proj.weight", (H, nv * dv))], (H, nv * dv), role,
                 partial(_retiled, dim=1, nk=nk, r=r, block=dv))

    def _mlp(self, plan: RolePlan, bid: int, p: str, role: Role) -> None:
        add_swiglu(plan, bid, p + "mlp.", self.hp.ffn, self.hp.hidden, role)

    def _moe(self, plan: RolePlan, bid: int, p: str, role: Role) -> None:
        hp = self.hp
        H, E, Fe, Fs = hp.hidden, hp.n_expert, hp.expert_ffn, hp.shared_ffn
        m = p + "mlp."
        plan.add(names.blk(bid, "ffn_gate_inp"), [plan.source(m + "gate.weight", (E, H))], (E, H), role,
                 tf.identity, True)
        self._experts(plan, bid, m, role)
        add_swiglu(plan, bid, m + "shared_expert.", Fs, H, role, "_shexp")
        # Written {H, 1}; llama.cpp accepts it as {H}.
        plan.add(names.blk(bid, "ffn_gate_inp_shexp"), [plan.source(m + "shared_expert_gate.weight", (1, H))],
                 (1, H), role, tf.identity, True)

    def _experts(self, plan: RolePlan, bid: int, m: str, role: Role) -> None:
        """Routed experts from the fused 3-D layout (releases) or per-expert tensors (save_pretrained)."""
        hp = self.hp
        plan_experts(plan, bid, m + "experts.", hp.n_expert, hp.expert_ffn, hp.hidden, role,
                     where=f"layer {bid} ({m.rstrip('.')})", count_field="num_experts")

    # ------------------------------------------------------------------ metadata

    # What qwen3next writes differently (archs/qwen3next.py overrides these three).
    writes_rope_sections: ClassVar[bool] = True  # rope.dimension_sections (M-RoPE); qwen3next: NEOX rope

    def _feed_forward_length(self) -> int | None:
        return self.hp.ffn

    def _full_attention_interval(self) -> int:
        return self.hp.full_attention_interval

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        hp = self.hp
        k = self._k if keep_mtp else 0
        # Same keys and order as the pinned upstream converter (TextModel, Qwen2Moe, mixins; for
        # qwen3next: TextModel, Qwen2MoeModel, _QwenMtpMixin, Qwen3NextModel).
        w = MetadataWriter(self.gguf_arch)
        w.text_model(hp.n_layer + k, hp.context_length, hp.hidden, self._feed_forward_length(), hp.n_head,
                     hp.n_head_kv)
        w.rope_scaling(hp.rope_scaling)
        if self.writes_rope_sections:
            w.array(Keys.Rope.DIMENSION_SECTIONS, hp.rope_sections, GGUFValueType.INT32)
        w.f32(Keys.Rope.FREQ_BASE, hp.rope_theta)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, hp.rms_eps)
        if hp.moe:
            w.experts(hp.n_expert, hp.n_expert_used)
        w.head_sizes(hp.head_dim)
        if hp.moe:
            w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.expert_ffn)
            w.u32(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, hp.shared_ffn)
        w.nextn(k)
        w.u32(Keys.SSM.CONV_KERNEL, hp.conv_kernel)
        w.u32(Keys.SSM.STATE_SIZE, hp.dk)
        w.u32(Keys.SSM.GROUP_COUNT, hp.nk)
        w.u32(Keys.SSM.TIME_STEP_RANK, hp.nv)
        w.u32(Keys.SSM.INNER_SIZE, hp.nv * hp.dv)
        w.array(names.recurrent_layers_key("{arch}"), hp.recurrent + [False] * k, GGUFValueType.BOOL)
        w.u32(Keys.LLM.FULL_ATTENTION_INTERVAL, self._full_attention_interval())
        w.u32(Keys.Rope.DIMENSION_COUNT, hp.rope_dim)
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
    moe = False


@register
class Qwen35Moe(Qwen35Base):
    hf_architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    moe = True
