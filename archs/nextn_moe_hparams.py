"""The hyperparameters every nextn-MoE family shares (GLM-4.5 `glm4moe`, DeepSeek-V3 `deepseek2` and
the DSA arches), under transformers' names (Glm4MoeConfig / DeepseekV3Config): read from config.json
by the plugin (`from_config`) and from GGUF metadata by the runtime graph (`from_kv`), and read as
the sizes of the family's tensor table (archs/nextn_moe.py).

Each family subclasses `NextnMoeHParams` in its plugin module with its attention fields
(archs/glm4moe.py, deepseek2.py, dsa.py) and its transformers config-class defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from . import names
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import FamilyHParams, HParamsReader
from .rope_scaling import RopeScaling, rope_scaling_of

GATINGS = (names.EXPERT_GATING_SOFTMAX, names.EXPERT_GATING_SIGMOID)  # the router functions the graphs run

# The config keys of the MoE fields (transformers' Glm4MoeConfig / DeepseekV3Config names); a family
# with other names passes its own.
MOE_KEYS: Mapping[str, tuple[str, ...]] = {
    "n_routed_experts": ("n_routed_experts",), "n_shared_experts": ("n_shared_experts",),
    "routed_scaling_factor": ("routed_scaling_factor",), "norm_topk_prob": ("norm_topk_prob",),
    "num_nextn_predict_layers": ("num_nextn_predict_layers", "num_mtp_layers")}


def moe_config_fields(cfg: ConfigReader, tc: ConfigReader, family: str, keys: Mapping[str, tuple[str, ...]] = MOE_KEYS,
                      groups: bool = True, yarn_log_multiplier: bool = True) -> dict[str, Any]:
    """The `NextnMoeHParams` fields of config.json. `cfg`: the whole file; `tc`: the text config with
    the family's transformers defaults. `groups`: whether the family has expert groups (n_group /
    topk_group). `yarn_log_multiplier`: whether the family's file carries YaRN's mscale_all_dim
    (archs/rope_scaling.py rope_scaling_of's `mscale`)."""
    num_hidden_layers = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
    used = tc.integer("num_experts_per_tok", min=1)
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
    return dict(
        num_hidden_layers=num_hidden_layers, hidden_size=tc.integer("hidden_size", min=1),
        vocab_size=tc.integer("vocab_size", min=1), num_attention_heads=tc.integer("num_attention_heads", min=1),
        intermediate_size=tc.integer("intermediate_size"), num_experts=num_experts, num_experts_per_tok=used,
        moe_intermediate_size=tc.integer("moe_intermediate_size"),
        n_shared_experts=tc.integer(*keys["n_shared_experts"], default=0),
        first_k_dense_replace=tc.integer("first_k_dense_replace", default=0), n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=tc.number(*keys["routed_scaling_factor"], default=1.0) or 1.0,
        norm_topk_prob=tc.flag(*keys["norm_topk_prob"], default=True),
        rms_norm_eps=tc.number("rms_norm_eps", default=1e-6) or 1e-6,
        rope_theta=tc.with_rope().number("rope_theta", default=10000.0),
        max_position_embeddings=tc.integer("max_position_embeddings", default=4096),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", default=tc.flag("tie_word_embeddings", default=False)),
        num_nextn_predict_layers=tc.integer(*keys["num_nextn_predict_layers"], default=0),
        rope_scaling=rope_scaling_of(tc, family, ("yarn",), mscale=yarn_log_multiplier),
    )


def yarn_from_kv(r: HParamsReader) -> RopeScaling | None:
    """A file's YaRN rope scaling as archs/metadata.py writes it (DeepSeek's `mscale_all_dim` decoded
    from llama.cpp's legacy 0.1·x log multiplier); None for none, or a type these graphs do not run."""
    if r.key("rope.scaling.type", None, str) != "yarn":
        return None
    log_mul = r.key("rope.scaling.yarn_log_multiplier", None, float)
    return RopeScaling("yarn", r.key("rope.scaling.factor", type=float),
                       r.key("rope.scaling.original_context_length", type=int),
                       r.key("rope.scaling.yarn_ext_factor", None, float),
                       r.key("rope.scaling.yarn_attn_factor", None, float),
                       r.key("rope.scaling.yarn_beta_fast", None, float),
                       r.key("rope.scaling.yarn_beta_slow", None, float),
                       None if log_mul is None else log_mul / 0.1)


@dataclass(kw_only=True)
class NextnMoeHParams(FamilyHParams):
    """Leading dense blocks (`intermediate_size`), then sigmoid-routed MoE blocks (`num_experts` is
    the config's `n_routed_experts`) with `n_shared_experts` un-gated shared experts, and the nextn
    (MTP) blocks after the trunk."""

    family: ClassVar[str] = ""  # the plugin family, for messages
    gguf_arch: ClassVar[str] = ""
    # transformers' config-class defaults for behavioural fields a config.json may leave out, so a
    # missing field means what it means to transformers (e.g. DeepSeek's routed scale 2.5)
    config_defaults: ClassVar[Mapping[str, Any]] = {}
    # whether the file carries YaRN's mscale_all_dim (rope.scaling.yarn_log_multiplier, DeepSeek's);
    # without it the converter writes transformers' resolved attention factor instead
    yarn_log_multiplier: ClassVar[bool] = True

    intermediate_size: int = 0  # the leading dense blocks' FFN width
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0  # leading dense blocks
    n_group: int | None = None  # expert groups; None (or 1): one group
    topk_group: int | None = None  # groups a token's experts come from
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    rms_norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # YaRN only
    tie_word_embeddings: bool = False
    # GGUF's expert_gating_func: the router's function (config.json's families all route with sigmoid)
    expert_gating_func: int = names.EXPERT_GATING_SIGMOID

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared experts' FFN (all shared experts as one)."""
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_block(self, bid: int) -> bool:
        return bid >= self.first_k_dense_replace

    def attention_tags(self, bid: int) -> set[str]:
        """The tags of block `bid`'s attention variant in the family's table (archs/nextn_moe.py)."""
        return set()

    # ---- config.json ----------------------------------------------------------------------------

    @classmethod
    def text_config(cls, config: Mapping[str, Any]) -> ConfigReader:
        """The text config with the family's transformers defaults filled in (a subclass may derive
        fields, e.g. GLM-4.7-Flash's leading dense count from `mlp_layer_types`)."""
        return ConfigReader(config).text_model().with_defaults(cls.config_defaults, f"{cls.family} default")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> NextnMoeHParams:
        return cls(arch=cls.gguf_arch, **cls.fields_from_config(ConfigReader(config), cls.text_config(config)))

    @classmethod
    def fields_from_config(cls, cfg: ConfigReader, tc: ConfigReader) -> dict[str, Any]:
        """The fields of config.json (`cfg`), checked; `tc`: `text_config`. A subclass adds its own."""
        return moe_config_fields(cfg, tc, cls.family, yarn_log_multiplier=cls.yarn_log_multiplier)

    # ---- GGUF metadata --------------------------------------------------------------------------

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> NextnMoeHParams:
        return cls(from_file=True, **cls.fields_from_kv(HParamsReader(kv)))

    @classmethod
    def fields_from_kv(cls, r: HParamsReader) -> dict[str, Any]:
        """The fields of a file's metadata, checked (types and ranges: runtime/validate.py check_kv)."""
        arch, key = r.arch, r.key
        n, nextn = r.block_counts()
        # A missing key means what it means to llama.cpp: sigmoid for glm4moe and glm-dsa, softmax for
        # deepseek2 (except its GLM-4.7-Flash special case) and deepseek32, which is wrong for DeepSeek-V3
        # but is what files from llama.cpp's converter say (docs/reference/gguf-layout.md §7.5); the
        # runtime runs the file as written.
        lite_glm = key("vocab_size", 0, int) == 154880 and n in (47, 48)
        sigmoid = arch in (names.GLM4MOE, names.GLM_DSA) or lite_glm
        gating = key("expert_gating_func", names.EXPERT_GATING_SIGMOID if sigmoid else names.EXPERT_GATING_SOFTMAX, int)
        if gating not in GATINGS:
            raise SpecconvError(f"{arch}.expert_gating_func is {gating}; supported: softmax (1), sigmoid (2)")
        f = dict(
            arch=arch, num_hidden_layers=n, num_nextn_predict_layers=nextn,
            hidden_size=key("embedding_length", type=int),
            vocab_size=r.vocab_size(),
            max_position_embeddings=key("context_length", 0, int),
            num_attention_heads=key("attention.head_count", type=int),
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", type=float),
            rope_theta=key("rope.freq_base", 10000.0, float),
            rope_scaling=yarn_from_kv(r), intermediate_size=key("feed_forward_length", 0, int),
            num_experts=key("expert_count", type=int), num_experts_per_tok=key("expert_used_count", type=int),
            moe_intermediate_size=key("expert_feed_forward_length", type=int),
            n_shared_experts=key("expert_shared_count", 0, int),
            first_k_dense_replace=key("leading_dense_block_count", 0, int),
            n_group=key("expert_group_count", None, int), topk_group=key("expert_group_used_count", None, int),
            routed_scaling_factor=key("expert_weights_scale", 1.0, float) or 1.0,
            norm_topk_prob=key("expert_weights_norm", False, bool), expert_gating_func=gating)
        experts, used = f["num_experts"], f["num_experts_per_tok"]
        groups, groups_used = f["n_group"] or 1, f["topk_group"] or 1
        if groups > 1 and (experts % groups or not 0 < groups_used < groups):
            raise SpecconvError(f"{arch}: {groups} expert groups ({groups_used} used) do not fit {experts} experts")
        if f["first_k_dense_replace"] > n + nextn:
            raise SpecconvError(f"{arch}.leading_dense_block_count {f['first_k_dense_replace']} exceeds block_count "
                                f"{n + nextn}")
        if experts < 1:
            raise SpecconvError(f"{arch}: expert_used_count {used} must be within 1..expert_count {experts}")
        if groups > 1 and (experts // groups < 2 or used > groups_used * (experts // groups)):
            raise SpecconvError(f"{arch}: {groups} expert groups ({groups_used} used) of {experts} experts "
                                f"cannot give {used} experts (and need 2 per group)")
        return f
