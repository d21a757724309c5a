"""What GLM-4.5 (`glm4moe`) and DeepSeek-V3 (`deepseek2`) share: sigmoid-routed MoE with a
correction bias and expert groups, leading dense blocks, and nextn (MTP) layers stored as ordinary
`model.layers.{N+j}.*` blocks plus their `eh_proj / enorm / hnorm / shared_head.* / embed_tokens`
extras (docs/reference/gguf-layout.md §4.1, §6, §7.4, §7.5).

Subclasses supply the attention tensors, the name of the post-attention norm and the arch-specific
metadata; everything else (names, MTP count, FFN/MoE mapping, nextn extras, common KV) lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from gguf import Keys

from . import names
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, Role, TensorPlan
from .config_reader import MAX_LAYERS, ConfigReader
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import (
    RolePlan, add_output_head, add_swiglu, embedding_rows, plan_experts, text_model_name, trunk_indexed_mtp_count,
)
from .rope_scaling import RopeScaling, rope_scaling_of

_TOWERS = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.")
# HF nextn extras -> GGUF nextn part (docs/reference/gguf-layout.md §4.1)
NEXTN_EXTRAS = (("eh_proj", names.NEXTN_EH_PROJ), ("enorm", names.NEXTN_ENORM), ("hnorm", names.NEXTN_HNORM),
                ("shared_head.norm", names.NEXTN_SHARED_HEAD_NORM))
NEXTN_OPTIONAL = (("embed_tokens", names.NEXTN_EMBED_TOKENS), ("shared_head.head", names.NEXTN_SHARED_HEAD_HEAD))


@dataclass(frozen=True)
class MoeHparams:
    """Fields both families read the same way (transformers' Glm4MoeConfig / DeepseekV3Config)."""

    n_layer: int
    hidden: int
    vocab: int
    n_head: int
    ffn: int  # dense width (leading dense blocks)
    n_expert: int
    n_expert_used: int
    expert_ffn: int
    n_shared: int
    first_dense: int
    n_group: int | None
    topk_group: int | None
    routed_scale: float
    norm_topk: bool
    rms_eps: float
    rope_theta: float
    context_length: int
    tie_embeddings: bool
    mtp_layers_config: int
    yarn: RopeScaling | None

    @property
    def shared_ffn(self) -> int:
        return self.expert_ffn * self.n_shared


# The config keys of the MoE fields (transformers' Glm4MoeConfig / DeepseekV3Config names); a family
# with other names passes its own.
MOE_KEYS: Mapping[str, tuple[str, ...]] = {
    "n_routed_experts": ("n_routed_experts",), "n_shared_experts": ("n_shared_experts",),
    "routed_scaling_factor": ("routed_scaling_factor",), "norm_topk_prob": ("norm_topk_prob",),
    "num_nextn_predict_layers": ("num_nextn_predict_layers", "num_mtp_layers")}


def parse_moe_hparams(cfg: ConfigReader, tc: ConfigReader, family: str, keys: Mapping[str, tuple[str, ...]] = MOE_KEYS,
                      groups: bool = True) -> MoeHparams:
    """`cfg`: the whole config.json; `tc`: the text config with the family's transformers defaults
    (`text_fields`). `groups`: whether the family has expert groups (n_group / topk_group)."""
    n_layer, used = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS), tc.integer("num_experts_per_tok", min=1)
    n_expert = tc.integer(*keys["n_routed_experts"], min=1)
    if used > n_expert:
        raise SpecconvError(f"config.json: num_experts_per_tok ({used}) exceeds n_routed_experts ({n_expert})")
    n_group = tc.integer("n_group", default=None) if groups else None
    topk_group = tc.integer("topk_group", default=None) if groups else None
    if n_group is not None and n_group > 1:
        # llama.cpp's loader asserts exactly these (docs/reference/gguf-layout.md §7.4)
        if n_expert % n_group or not (0 < (topk_group or 0) < n_group) or n_group >= n_expert:
            raise SpecconvError(f"config.json: expert groups n_group={n_group}, topk_group={topk_group} do not fit "
                                f"{n_expert} experts (need E % n_group == 0, 0 < topk_group < n_group < E)")
    act = tc.string("hidden_act", default="silu")
    if act != "silu":
        raise SpecconvError(f"config.json: hidden_act {act!r} is not supported ({family} uses silu)")
    return MoeHparams(
        n_layer=n_layer, hidden=tc.integer("hidden_size", min=1), vocab=tc.integer("vocab_size", min=1),
        n_head=tc.integer("num_attention_heads", min=1), ffn=tc.integer("intermediate_size"), n_expert=n_expert,
        n_expert_used=used, expert_ffn=tc.integer("moe_intermediate_size"),
        n_shared=tc.integer(*keys["n_shared_experts"], default=0), first_dense=tc.integer("first_k_dense_replace",
                                                                                          default=0),
        n_group=n_group, topk_group=topk_group,
        routed_scale=tc.number(*keys["routed_scaling_factor"], default=1.0) or 1.0,
        norm_topk=tc.flag(*keys["norm_topk_prob"], default=True),
        rms_eps=tc.number("rms_norm_eps", default=1e-6) or 1e-6,
        rope_theta=tc.with_rope().number("rope_theta", default=10000.0),
        context_length=tc.integer("max_position_embeddings", default=4096),
        tie_embeddings=cfg.flag("tie_word_embeddings", default=tc.flag("tie_word_embeddings", default=False)),
        mtp_layers_config=tc.integer(*keys["num_nextn_predict_layers"], default=0),
        yarn=rope_scaling_of(tc, family, ("yarn",), mscale=True),
    )


class NextnMoePlugin(ArchPlugin):
    """Base of the glm4moe and deepseek2 plugins."""

    family: ClassVar[str] = ""
    post_attention_norm: ClassVar[str] = "post_attention_norm"  # GGUF name of the FFN-input norm
    # transformers' config-class defaults for behavioural fields a config.json may leave out, so a
    # missing field means what it means to transformers (e.g. DeepSeek's routed scale 2.5)
    config_defaults: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.tc = self.text_fields(checkpoint.config)
        self.hp = parse_moe_hparams(ConfigReader(checkpoint.config), self.tc, self.family)
        self._k = self._count_mtp_layers()
        if self._k and self.hp.first_dense > self.hp.n_layer:
            raise SpecconvError(f"config.json: first_k_dense_replace ({self.hp.first_dense}) exceeds "
                                f"num_hidden_layers ({self.hp.n_layer}); the nextn block must be an MoE block")

    @classmethod
    def text_fields(cls, config: Mapping[str, Any]) -> ConfigReader:
        """The text config with the family's transformers defaults filled in (a subclass may derive
        fields, e.g. GLM-4.7-Flash's leading dense count from `mlp_layer_types`)."""
        return ConfigReader(config).text_model().with_defaults(cls.config_defaults, f"{cls.family} default")

    # ------------------------------------------------------------------ naming

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        name = text_model_name(raw_name, _TOWERS, "vision tower (belongs in a separate mmproj file)")
        if isinstance(name, str) and name.endswith("e_score_correction_bias"):
            name = name[: -len("_bias")] + ".bias"  # docs/reference/gguf-layout.md §6: -> exp_probs_b.bias
        return name

    # ------------------------------------------------------------------ structure

    @property
    def n_trunk_layers(self) -> int:
        return self.hp.n_layer

    @property
    def n_mtp_layers(self) -> int:
        return self._k

    def _count_mtp_layers(self) -> int:
        """k = the layers `model.layers.{N..}` present; they must be the config's count, contiguous.

        A checkpoint without any nextn tensors converts without MTP even when config.json declares
        some: transformers' configs default to num_nextn_predict_layers=1 and its save_pretrained
        drops the nextn weights, so that config value alone does not mean they were ever there.
        """
        n = self.hp.n_layer
        k = trunk_indexed_mtp_count(self.checkpoint, n)
        configured = self.hp.mtp_layers_config
        if k and k != configured:
            raise SpecconvError(f"config.json says num_nextn_predict_layers={configured}, but the checkpoint holds "
                                f"{k} nextn layer(s) (model.layers.{n}..{n + k - 1})")
        return k

    def vocab_size(self) -> int:
        return embedding_rows(self.checkpoint)

    # ------------------------------------------------------------------ tensors

    def tensor_plan(self) -> list[TensorPlan]:
        hp, plan = self.hp, RolePlan(self.checkpoint.tensors)
        H, V = hp.hidden, hp.vocab
        plan.add(names.TOKEN_EMBD, [plan.source("model.embed_tokens.weight", (V, H))], (V, H), Role.SHARED)
        for i in range(hp.n_layer + self._k):
            role = Role.TRUNK if i < hp.n_layer else Role.MTP
            p = f"model.layers.{i}."
            if role == Role.MTP:
                self._nextn_extras(plan, i, p)
            self._norm(plan, names.blk(i, "attn_norm"), p + "input_layernorm.weight", role)
            self._attention(plan, i, p + "self_attn.", role)
            self._norm(plan, names.blk(i, self.post_attention_norm), p + "post_attention_layernorm.weight", role)
            (self._dense if i < hp.first_dense else self._moe)(plan, i, p + "mlp.", role)
        self._norm(plan, names.OUTPUT_NORM, "model.norm.weight", Role.SHARED)
        add_output_head(plan, hp.tie_embeddings, V, H)
        return plan.finish(self.gguf_arch)

    def _norm(self, plan: RolePlan, gguf_name: str, hf: str, role: Role, width: int | None = None) -> None:
        """A plain-weight RMSNorm (no +1 for these families), kept F32."""
        w = self.hp.hidden if width is None else width
        plan.add(gguf_name, [plan.source(hf, (w,))], (w,), role, tf.identity, True)

    def _nextn_extras(self, plan: RolePlan, bid: int, p: str) -> None:
        H, V = self.hp.hidden, self.hp.vocab
        plan.add(names.nextn(bid, names.NEXTN_EH_PROJ), [plan.source(p + "eh_proj.weight", (H, 2 * H))], (H, 2 * H),
                 Role.MTP)  # input order: embedding half first, as in HF and llama.cpp
        for hf, part in NEXTN_EXTRAS[1:]:
            self._norm(plan, names.nextn(bid, part), f"{p}{hf}.weight", Role.MTP)
        # Optional copies (GLM-4.5, DeepSeek-V3 ship them; GLM-4.6 does not): kept as they are,
        # since llama.cpp prefers them over token_embd / output when present.
        for hf, part in NEXTN_OPTIONAL:
            if plan.has(f"{p}{hf}.weight"):
                plan.add(names.nextn(bid, part), [plan.source(f"{p}{hf}.weight", (V, H))], (V, H), Role.MTP)

    def _attention(self, plan: RolePlan, bid: int, a: str, role: Role) -> None:
        raise NotImplementedError

    def _dense(self, plan: RolePlan, bid: int, m: str, role: Role) -> None:
        add_swiglu(plan, bid, m, self.hp.ffn, self.hp.hidden, role)

    def _moe(self, plan: RolePlan, bid: int, m: str, role: Role) -> None:
        hp = self.hp
        H, E, Fs = hp.hidden, hp.n_expert, hp.shared_ffn
        plan.add(names.blk(bid, "ffn_gate_inp"), [plan.source(m + "gate.weight", (E, H))], (E, H), role,
                 tf.identity, True)
        plan.add(names.blk(bid, "exp_probs_b", "bias"), [plan.source(m + "gate.e_score_correction.bias", (E,))],
                 (E,), role, tf.identity, True)
        ex = m + "experts."
        plan_experts(plan, bid, ex, E, hp.expert_ffn, H, role, where=f"layer {bid} ({ex.rstrip('.')})",
                     count_field="n_routed_experts")
        if hp.n_shared:
            add_swiglu(plan, bid, m + "shared_experts.", Fs, H, role, "_shexp")

    # ------------------------------------------------------------------ metadata

    def _common_head_kv(self, w: MetadataWriter, keep_mtp: bool, n_head_kv: int) -> None:
        hp = self.hp
        w.text_model(hp.n_layer + (self._k if keep_mtp else 0), hp.context_length, hp.hidden, hp.ffn, hp.n_head,
                     n_head_kv)
        w.rope_scaling(hp.yarn)
        w.f32(Keys.Rope.FREQ_BASE, hp.rope_theta)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, hp.rms_eps)
        w.experts(hp.n_expert, hp.n_expert_used)
        w.expert_groups(hp.n_group, hp.topk_group)

    def _common_moe_kv(self, w: MetadataWriter, keep_mtp: bool) -> None:
        hp = self.hp
        w.u32(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, hp.first_dense)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.expert_ffn)
        w.u32(Keys.LLM.EXPERT_SHARED_COUNT, hp.n_shared)
        # Always explicit: a missing key means softmax to llama.cpp's deepseek2 (docs/reference/gguf-layout.md §7.5).
        w.u32(Keys.LLM.EXPERT_GATING_FUNC, names.EXPERT_GATING_SIGMOID)
        w.f32(Keys.LLM.EXPERT_WEIGHTS_SCALE, hp.routed_scale)
        w.flag(Keys.LLM.EXPERT_WEIGHTS_NORM, hp.norm_topk)
        w.nextn(self._k if keep_mtp else 0)
