"""What GLM-4.5 (`glm4moe`) and DeepSeek-V3 (`deepseek2`) share: sigmoid-routed MoE with a
correction bias and expert groups, leading dense blocks, and nextn (MTP) layers stored as ordinary
`model.layers.{N+j}.*` blocks plus their `eh_proj / enorm / hnorm / shared_head.* / embed_tokens`
extras (docs/reference/gguf-layout.md §4.1, §6, §7.4, §7.5).

Subclasses supply their table (`nextn_moe_table` of their attention tensors and FFN-input norm), the
attention fields of its sizes and the arch-specific metadata; everything else (names, MTP count,
FFN/MoE tensors, nextn extras, common KV) lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from gguf import Keys

from . import names
from .base import ArchPlugin, Checkpoint, Role, TensorPlan
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import (
    RolePlan, add_output_head, embedding_rows, plan_experts, text_model_name, trunk_indexed_mtp_count,
)
from .rope_scaling import RopeScaling, rope_scaling_of
from .tensor_table import Block, TensorSpec, TensorTable

_TOWERS = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.")
# HF nextn copies -> GGUF nextn part (docs/reference/gguf-layout.md §4.1)
NEXTN_OPTIONAL = (("embed_tokens", names.NEXTN_EMBED_TOKENS), ("shared_head.head", names.NEXTN_SHARED_HEAD_HEAD))


@dataclass(frozen=True)
class MoeHparams:
    """Fields both families read the same way (transformers' Glm4MoeConfig / DeepseekV3Config)."""

    num_hidden_layers: int
    hidden: int
    vocab: int
    num_attention_heads: int
    ffn: int  # dense width (leading dense blocks)
    num_experts: int
    num_experts_per_tok: int
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
    num_hidden_layers, used = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS), tc.integer("num_experts_per_tok", min=1)
    num_experts = tc.integer(*keys["n_routed_experts"], min=1)
    if used > num_experts:
        raise SpecconvError(f"config.json: num_experts_per_tok ({used}) exceeds n_routed_experts ({num_experts})")
    n_group = tc.integer("n_group", default=None) if groups else None
    topk_group = tc.integer("topk_group", default=None) if groups else None
    if n_group is not None and n_group > 1:
        # llama.cpp's loader asserts exactly these (docs/reference/gguf-layout.md §7.4)
        if num_experts % n_group or not (0 < (topk_group or 0) < n_group) or n_group >= num_experts:
            raise SpecconvError(f"config.json: expert groups n_group={n_group}, topk_group={topk_group} do not fit "
                                f"{num_experts} experts (need E % n_group == 0, 0 < topk_group < n_group < E)")
    act = tc.string("hidden_act", default="silu")
    if act != "silu":
        raise SpecconvError(f"config.json: hidden_act {act!r} is not supported ({family} uses silu)")
    return MoeHparams(
        num_hidden_layers=num_hidden_layers, hidden=tc.integer("hidden_size", min=1), vocab=tc.integer("vocab_size", min=1),
        num_attention_heads=tc.integer("num_attention_heads", min=1), ffn=tc.integer("intermediate_size"), num_experts=num_experts,
        num_experts_per_tok=used, expert_ffn=tc.integer("moe_intermediate_size"),
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


# ---------------------------------------------------------------------- the tensor table


@dataclass(frozen=True)
class Sizes:
    """The dimensions the nextn-MoE tables are written in: the plugin's from config.json, the graph's
    from GGUF metadata (runtime/graphs/glm4moe.py, deepseek2.py, dsa.py; V = "V")."""

    num_hidden_layers: int  # trunk blocks
    E: int  # hidden size
    V: int | str  # vocabulary
    num_attention_heads: int
    ffn: int  # dense width (leading dense blocks)
    num_experts: int
    expert_ffn: int
    n_shared: int  # shared experts (0: none)
    first_dense: int  # leading dense blocks
    # GQA (glm4moe); the bias and q/k-norm flags say which optional tensors a block may hold
    num_key_value_heads: int = 0
    head_dim: int = 0
    attn_bias: bool = False
    qk_norm: bool = False
    # MLA (deepseek2 and the DSA arches); q_lora 0: a plain attn_q
    q_lora: int = 0
    kv_lora: int = 0
    dn: int = 0
    dr: int = 0
    dv: int = 0
    rope_halves: bool = False  # the checkpoint rotates halves: its rope rows are reordered (archs/deepseek2.py)
    # the DSA lightning indexer: heads, width, and per trunk block whether it runs its own
    index_heads: int = 0
    index_dim: int = 0
    index_full: tuple[bool, ...] = ()

    @property
    def shared_ffn(self) -> int:
        return self.expert_ffn * self.n_shared


def block_tags(s: Sizes, bid: int) -> frozenset[str]:
    """dense below first_dense, else moe (+ shared with shared experts); nextn for the MTP blocks; the
    attention variant (q_lora / q_plain, attn_bias, qk_norm, indexer)."""
    moe = bid >= s.first_dense
    tags = {"moe" if moe else "dense", "q_lora" if s.q_lora else "q_plain"}
    tags |= {t for t, on in (("shared", moe and s.n_shared), ("nextn", bid >= s.num_hidden_layers), ("attn_bias", s.attn_bias),
                             ("qk_norm", s.qk_norm)) if on}
    if s.index_full and (bid >= s.num_hidden_layers or s.index_full[bid]):  # the nextn block runs its own indexer
        tags.add("indexer")
    return frozenset(tags)


def norm(gguf: str, hf: str, on: str = "", dim=lambda s: (s.E,), optional: bool = False) -> TensorSpec:
    """A plain-weight RMSNorm (no +1 in these families), kept F32."""
    return TensorSpec(gguf, hf, dim, on, optional=optional, f32=True)


_MLP = "{p}mlp."


def nextn_moe_table(attention: tuple[TensorSpec, ...], post_attention_norm: str) -> TensorTable:
    """The table of a nextn-MoE family from its attention tensors and its FFN-input norm's GGUF name."""
    return TensorTable((
        TensorSpec(names.TOKEN_EMBD, "model.embed_tokens.weight", lambda s: (s.V, s.E)),
        norm(names.OUTPUT_NORM, "model.norm.weight"),
        TensorSpec(names.OUTPUT, None, lambda s: (s.V, s.E), optional=True, hook="output_head"),  # absent when tied
        norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
        *attention,
        norm(f"blk.{{bid}}.{post_attention_norm}.weight", "{p}post_attention_layernorm.weight"),
        TensorSpec("blk.{bid}.ffn_gate.weight", _MLP + "gate_proj.weight", lambda s: (s.ffn, s.E), "dense"),
        TensorSpec("blk.{bid}.ffn_up.weight", _MLP + "up_proj.weight", lambda s: (s.ffn, s.E), "dense"),
        TensorSpec("blk.{bid}.ffn_down.weight", _MLP + "down_proj.weight", lambda s: (s.E, s.ffn), "dense"),
        TensorSpec("blk.{bid}.ffn_gate_inp.weight", _MLP + "gate.weight", lambda s: (s.num_experts, s.E), "moe",
                   f32=True),
        TensorSpec("blk.{bid}.exp_probs_b.bias", _MLP + "gate.e_score_correction.bias", lambda s: (s.num_experts,),
                   "moe", f32=True),
        *(TensorSpec(f"blk.{{bid}}.ffn_{x}_exps.weight", None, shape, "moe", hook="experts")
          for x, shape in (("gate", lambda s: (s.num_experts, s.expert_ffn, s.E)),
                           ("up", lambda s: (s.num_experts, s.expert_ffn, s.E)),
                           ("down", lambda s: (s.num_experts, s.E, s.expert_ffn)))),
        TensorSpec("blk.{bid}.ffn_gate_shexp.weight", _MLP + "shared_experts.gate_proj.weight",
                   lambda s: (s.shared_ffn, s.E), "moe shared"),
        TensorSpec("blk.{bid}.ffn_up_shexp.weight", _MLP + "shared_experts.up_proj.weight",
                   lambda s: (s.shared_ffn, s.E), "moe shared"),
        TensorSpec("blk.{bid}.ffn_down_shexp.weight", _MLP + "shared_experts.down_proj.weight",
                   lambda s: (s.E, s.shared_ffn), "moe shared"),
        # the nextn extras of every MTP block (docs/reference/gguf-layout.md §4.1); eh_proj's input is the
        # embedding half first, as in HF and llama.cpp
        TensorSpec("blk.{bid}.nextn.eh_proj.weight", "{p}eh_proj.weight", lambda s: (s.E, 2 * s.E), "nextn"),
        norm("blk.{bid}.nextn.enorm.weight", "{p}enorm.weight", "nextn"),
        norm("blk.{bid}.nextn.hnorm.weight", "{p}hnorm.weight", "nextn"),
        norm("blk.{bid}.nextn.shared_head_norm.weight", "{p}shared_head.norm.weight", "nextn", optional=True),
        # copies GLM-4.5 and DeepSeek-V3 ship (GLM-4.6 does not), kept as they are when present: llama.cpp
        # prefers them over token_embd / output
        TensorSpec("blk.{bid}.nextn.embed_tokens.weight", None, lambda s: (s.V, s.E), "nextn", optional=True,
                   hook="nextn_copies"),
        TensorSpec("blk.{bid}.nextn.shared_head_head.weight", None, lambda s: (s.V, s.E), "nextn", optional=True,
                   hook="nextn_copies"),
    ), block_tags)


class NextnMoePlugin(ArchPlugin):
    """Base of the glm4moe and deepseek2 plugins."""

    family: ClassVar[str] = ""
    mtp_as_trunk_layers: ClassVar[bool] = True  # nextn block j is model.layers.{N+j} (verify's MTP reference)
    # transformers' config-class defaults for behavioural fields a config.json may leave out, so a
    # missing field means what it means to transformers (e.g. DeepSeek's routed scale 2.5)
    config_defaults: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.tc = self.text_fields(checkpoint.config)
        self.hp = parse_moe_hparams(ConfigReader(checkpoint.config), self.tc, self.family)
        self._k = self._count_mtp_layers()
        if self._k and self.hp.first_dense > self.hp.num_hidden_layers:
            raise SpecconvError(f"config.json: first_k_dense_replace ({self.hp.first_dense}) exceeds "
                                f"num_hidden_layers ({self.hp.num_hidden_layers}); the nextn block must be an MoE block")

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
        return self.hp.num_hidden_layers

    @property
    def n_mtp_layers(self) -> int:
        return self._k

    def _count_mtp_layers(self) -> int:
        """k = the layers `model.layers.{N..}` present; they must be the config's count, contiguous.

        A checkpoint without any nextn tensors converts without MTP even when config.json declares
        some: transformers' configs default to num_nextn_predict_layers=1 and its save_pretrained
        drops the nextn weights, so that config value alone does not mean they were ever there.
        """
        n = self.hp.num_hidden_layers
        k = trunk_indexed_mtp_count(self.checkpoint, n)
        configured = self.hp.mtp_layers_config
        if k and k != configured:
            raise SpecconvError(f"config.json says num_nextn_predict_layers={configured}, but the checkpoint holds "
                                f"{k} nextn layer(s) (model.layers.{n}..{n + k - 1})")
        return k

    def vocab_size(self) -> int:
        return embedding_rows(self.checkpoint)

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable]  # the family's (archs/glm4moe.py, deepseek2.py, dsa.py)

    def sizes(self) -> Sizes:
        hp = self.hp
        return Sizes(num_hidden_layers=hp.num_hidden_layers, E=hp.hidden, V=hp.vocab, num_attention_heads=hp.num_attention_heads, ffn=hp.ffn, num_experts=hp.num_experts,
                     expert_ffn=hp.expert_ffn, n_shared=hp.n_shared, first_dense=hp.first_dense,
                     **self.attention_sizes())

    def attention_sizes(self) -> dict[str, Any]:
        """The family's attention fields of `Sizes`."""
        raise NotImplementedError

    def tensor_plan(self) -> list[TensorPlan]:
        plan = RolePlan(self.checkpoint.tensors)
        n = self.hp.num_hidden_layers
        blocks = [Block(i, f"model.layers.{i}.", Role.TRUNK if i < n else Role.MTP) for i in range(n + self._k)]
        hooks = {"output_head": self._output_head, "experts": self._experts, "nextn_copies": self._nextn_copies}
        self.table.plan(plan, self.sizes(), blocks, hooks)
        return plan.finish(self.gguf_arch)

    def _output_head(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        add_output_head(plan, self.hp.tie_embeddings, s.V, s.E)

    def _experts(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        ex = p + "mlp.experts."
        plan_experts(plan, bid, ex, s.num_experts, s.expert_ffn, s.E, role, where=f"layer {bid} ({ex.rstrip('.')})",
                     count_field="n_routed_experts")

    def _nextn_copies(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        for hf, part in NEXTN_OPTIONAL:
            if plan.has(f"{p}{hf}.weight"):
                plan.add(names.nextn(bid, part), [plan.source(f"{p}{hf}.weight", (s.V, s.E))], (s.V, s.E), Role.MTP)

    # ------------------------------------------------------------------ metadata

    def _common_head_kv(self, w: MetadataWriter, keep_mtp: bool, num_key_value_heads: int) -> None:
        hp = self.hp
        w.text_model(hp.num_hidden_layers + (self._k if keep_mtp else 0), hp.context_length, hp.hidden, hp.ffn, hp.num_attention_heads,
                     num_key_value_heads)
        w.rope_scaling(hp.yarn)
        w.f32(Keys.Rope.FREQ_BASE, hp.rope_theta)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, hp.rms_eps)
        w.experts(hp.num_experts, hp.num_experts_per_tok)
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
