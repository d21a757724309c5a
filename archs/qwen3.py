"""Qwen3 dense (`Qwen3ForCausalLM` -> GGUF `qwen3`) and Qwen3-MoE (`Qwen3MoeForCausalLM` -> `qwen3moe`).

What the pinned llama.cpp converter writes for them (its `Qwen3Model` / `Qwen3MoeModel` on top of
`TextModel`): plain renames, no q/k row permutation (the graphs use NEOX rope, HF's rotate-half),
per-head `attn_q_norm` / `attn_k_norm` of head_dim, no +1 on any norm. Qwen3-MoE experts come
per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the release layout) and are stacked into
3-D `ffn_*_exps`; transformers' fused in-memory layout is accepted too. The router is
`ffn_gate_inp` (F32); there is no shared expert.

`norm_topk_prob`: llama.cpp's qwen3moe graph always renormalises the top-k weights, which is what
the releases configure (true). For a checkpoint that says false, the plugin adds
`qwen3moe.expert_weights_norm = false` (a key llama.cpp's qwen3moe loader ignores) so that
specconv's runtime follows the config; docs/archs.md notes the consequence for llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Mapping

from gguf import Keys

from . import names, register
from .base import ArchPlugin, Checkpoint, MetaKV, Role
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import FamilyHParams, HParamsReader
from .metadata import MetadataWriter
from .plan_tools import RolePlan, add_output_head, routed_experts, text_model_name
from .rope_scaling import RopeScaling, rope_scaling_of
from .tensor_table import AttentionWidths, Hook, TensorSpec, TensorTable, expert_specs, swiglu_specs

QWEN3, QWEN3MOE = "qwen3", "qwen3moe"
EXPERT_WEIGHTS_NORM = "expert_weights_norm"  # `{arch}.expert_weights_norm` (bool), llama.cpp's key


@dataclass(kw_only=True)
class Qwen3HParams(AttentionWidths, FamilyHParams):
    """A Qwen3 / Qwen3-MoE model's hyperparameters under transformers' Qwen3Config / Qwen3MoeConfig
    names: the plugin's from config.json (`from_config`), the graph's from GGUF metadata (`from_kv`,
    runtime/graphs/qwen3.py); the table's shapes read them."""

    arch: str = QWEN3
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    intermediate_size: int = 0
    moe_intermediate_size: int = 0  # Qwen3-MoE: each expert's FFN width
    norm_topk_prob: bool = True  # renormalise the top-k router weights (GGUF expert_weights_norm)
    rope_theta: float | None = None  # None: not stated (llama.cpp's 10000 applies)
    rope_scaling: RopeScaling | None = None  # linear or YaRN (rope.scaling.*)
    rms_norm_eps: float = 1e-6
    states_head_dim: bool = False  # head_dim stated (config.json's head_dim; GGUF attention.key_length)
    tie_word_embeddings: bool = False  # config.json only: a file says it by having no output.weight

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rope_freq_base(self) -> float:
        """θ of the rope: rope_theta, or llama.cpp's default where neither config nor file states it."""
        return 10000.0 if self.rope_theta is None else self.rope_theta

    @classmethod
    def from_config(cls, config: Mapping[str, Any], moe: bool = False) -> "Qwen3HParams":
        """`moe`: a Qwen3-MoE config (Qwen3MoeForCausalLM), whose expert fields are read and checked."""
        cfg = ConfigReader(config)
        hidden_size = cfg.integer("hidden_size", min=1)
        num_hidden_layers = cfg.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        heads, n_kv, head_dim = cfg.attention_heads()
        ffn = cfg.integer("intermediate_size", min=1)
        act = cfg.string("hidden_act", default="silu")
        if act != "silu":
            raise SpecconvError(f"config.json: hidden_act {act!r} is not supported (qwen3 uses silu)")
        if cfg.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported (llama.cpp's qwen3 graphs "
                                "have no q/k/v biases)")
        if cfg.flag("use_sliding_window", default=False):
            raise SpecconvError("config.json: use_sliding_window=true is not supported (llama.cpp's qwen3 "
                                "graphs attend to the whole context)")
        return cls(arch=QWEN3MOE if moe else QWEN3, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                   num_attention_heads=heads, num_key_value_heads=n_kv, head_dim=head_dim, rotary_dim=head_dim,
                   intermediate_size=ffn, rope_scaling=rope_scaling_of(cfg, "Qwen3", unscaled=("default", "mrope")),
                   max_position_embeddings=cfg.integer("max_position_embeddings", default=None, min=1) or 0,
                   rope_theta=cfg.with_rope().number("rope_theta", default=None),
                   rms_norm_eps=cfg.number("rms_norm_eps", default=1e-6), states_head_dim=cfg.has("head_dim"),
                   tie_word_embeddings=cfg.flag("tie_word_embeddings", default=False),
                   vocab_size=cfg.integer("vocab_size", default=0), **(_experts_of(cfg) if moe else {}))

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "Qwen3HParams":
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        hidden_size, heads, head_dim = r.attention_widths()
        r.check_value_length(head_dim)
        hp = cls(arch=arch, num_hidden_layers=key("block_count", type=int), hidden_size=hidden_size,
                 num_attention_heads=heads, num_key_value_heads=key("attention.head_count_kv", heads, int),
                 head_dim=head_dim, rotary_dim=key("rope.dimension_count", head_dim, int),
                 rope_theta=key("rope.freq_base", None, float), rope_scaling=_rope_scaling_from_kv(r),
                 rms_norm_eps=key("attention.layer_norm_rms_epsilon", type=float),
                 intermediate_size=key("feed_forward_length", 0, int), num_experts=key("expert_count", 0, int),
                 num_experts_per_tok=key("expert_used_count", 0, int),
                 moe_intermediate_size=key("expert_feed_forward_length", 0, int),
                 norm_topk_prob=key(EXPERT_WEIGHTS_NORM, True, bool),
                 vocab_size=r.vocab_size(),
                 max_position_embeddings=key("context_length", 0, int), states_head_dim=r.has("attention.key_length"),
                 from_file=True)
        if arch == QWEN3MOE and not (hp.num_experts and 0 < hp.num_experts_per_tok <= hp.num_experts):
            raise SpecconvError(f"qwen3moe file with expert_count {hp.num_experts}, expert_used_count "
                                f"{hp.num_experts_per_tok}")
        if hp.num_attention_heads % hp.num_key_value_heads:
            raise SpecconvError(f"{arch}: head_count {hp.num_attention_heads} is not a multiple of head_count_kv "
                                f"{hp.num_key_value_heads}")
        if not (hp.moe_intermediate_size if hp.is_moe else hp.intermediate_size):
            raise SpecconvError(f"{arch}: the feed-forward width is missing or 0")
        return hp


def _experts_of(cfg: ConfigReader) -> dict[str, Any]:
    """A Qwen3-MoE config's expert fields, checked: every layer routed (llama.cpp's qwen3moe has no dense one)."""
    count = cfg.integer("num_experts", "num_local_experts", min=1)
    used = cfg.integer("num_experts_per_tok", min=1)
    width = cfg.integer("moe_intermediate_size", min=1)
    if not 0 < used <= count:
        raise SpecconvError(f"config.json: num_experts_per_tok {used} is not in 1..{count}")
    if cfg.integers("mlp_only_layers", default=None) or cfg.integer("decoder_sparse_step", default=1) != 1:
        raise SpecconvError("config.json: dense layers in a Qwen3-MoE (mlp_only_layers / "
                            "decoder_sparse_step != 1) are not supported (llama.cpp's qwen3moe has none)")
    return dict(num_experts=count, num_experts_per_tok=used, moe_intermediate_size=width,
                norm_topk_prob=cfg.flag("norm_topk_prob", default=False))


def _rope_scaling_from_kv(r: HParamsReader) -> RopeScaling | None:
    """rope.scaling.* as archs/metadata.py writes them (a key not written reads as None)."""
    kind, key = r.key("rope.scaling.type", None, str), r.key
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return RopeScaling("linear", key("rope.scaling.factor", type=float))
    if kind == "yarn":
        return RopeScaling("yarn", key("rope.scaling.factor", type=float),
                           key("rope.scaling.original_context_length", type=int),
                           key("rope.scaling.yarn_ext_factor", None, float),
                           key("rope.scaling.yarn_attn_factor", None, float),
                           key("rope.scaling.yarn_beta_fast", None, float),
                           key("rope.scaling.yarn_beta_slow", None, float))
    raise SpecconvError(f"{r.arch}: rope scaling {kind!r} is not supported by the runtime's qwen3 graph "
                        f"(default, linear and yarn are)")


def block_tags(s: Qwen3HParams, bid: int) -> frozenset[str]:
    return frozenset({"moe" if s.is_moe else "dense"})


def _norm(gguf: str, hf: str, dim=lambda s: (s.hidden_size,)) -> TensorSpec:
    return TensorSpec(gguf, hf, dim, f32=True)  # plain RMSNorm weights, kept F32


_ATTN, _MLP = "{p}self_attn.", "{p}mlp."
# A Qwen3 decoder layer up to its FFN (DFlash drafters' layers too): pre-norm attention with per-head q/k norms.
QWEN3_ATTENTION = (
    _norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
    TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.hidden_size)),
    TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.hidden_size)),
    TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.kv, s.hidden_size)),
    TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.hidden_size, s.q)),
    _norm("blk.{bid}.attn_q_norm.weight", _ATTN + "q_norm.weight", lambda s: (s.head_dim,)),
    _norm("blk.{bid}.attn_k_norm.weight", _ATTN + "k_norm.weight", lambda s: (s.head_dim,)),
    _norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight"),
)
QWEN3_TABLE = TensorTable((
    TensorSpec(names.TOKEN_EMBD, "model.embed_tokens.weight", lambda s: (s.vocab_dim, s.hidden_size)),
    _norm(names.OUTPUT_NORM, "model.norm.weight"),
    TensorSpec(names.OUTPUT, None, lambda s: (s.vocab_dim, s.hidden_size), optional=True,
               hook="output_head"),  # absent when tied
    *QWEN3_ATTENTION,
    *swiglu_specs(_MLP, "dense"),
    TensorSpec("blk.{bid}.ffn_gate_inp.weight", _MLP + "gate.weight",
               lambda s: (s.num_experts, s.hidden_size), "moe", f32=True),
    *expert_specs(),
), block_tags)


class Qwen3Base(ArchPlugin):
    family: ClassVar[str] = "qwen3"
    moe: ClassVar[bool] = False
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "qwen2"  # what llama.cpp's hash table names the Qwen3 tokenizer

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.hp = Qwen3HParams.from_config(checkpoint.config, moe=self.moe)

    @classmethod
    def normalize_name(cls, raw_name: str):
        return text_model_name(raw_name, (), "")

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = QWEN3_TABLE

    def sizes(self) -> Qwen3HParams:
        """The hparams the file is written with: its vocabulary is the embedding's rows."""
        return replace(self.hp, vocab_size=self.vocab_size())

    def hooks(self) -> dict[str, Hook]:
        return {"output_head": self._output_head, "experts": routed_experts("num_experts")}

    def _output_head(self, plan: RolePlan, s: Qwen3HParams, bid: None, p: str, role: Role) -> None:
        if s.tie_word_embeddings and plan.has("lm_head.weight"):
            # llama.cpp's converter writes a saved head even when tied: the same file, byte for byte
            shape = (s.vocab_size, s.hidden_size)
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", shape)], shape, Role.SHARED)
        else:
            add_output_head(plan, s.tie_word_embeddings, s.vocab_size, s.hidden_size)

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        # The keys and order of llama.cpp's TextModel.set_gguf_parameters (+ Qwen2MoeModel's).
        hp = self.hp
        w = MetadataWriter(self.gguf_arch)
        w.text_model(hp.num_hidden_layers, hp.max_position_embeddings or None, hp.hidden_size, hp.intermediate_size,
                     hp.num_attention_heads, hp.num_key_value_heads, rope_scaling=hp.rope_scaling,
                     rope_theta=hp.rope_theta, rms_norm_eps=hp.rms_norm_eps,
                     experts=(hp.num_experts, hp.num_experts_per_tok) if hp.is_moe else None,
                     key_length=hp.head_dim if hp.states_head_dim else None)
        if hp.is_moe:
            w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.moe_intermediate_size)
            if not hp.norm_topk_prob:  # not written upstream (llama.cpp renormalises); see the module docstring
                w.flag("{arch}." + EXPERT_WEIGHTS_NORM, False)
        return w.kv


@register
class Qwen3(Qwen3Base):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM",)
    gguf_arch: ClassVar[str] = QWEN3
    hf_reference: ClassVar[dict[str, str]] = {"Qwen3ForCausalLM": "Qwen3ForCausalLM"}
    moe = False


@register
class Qwen3Moe(Qwen3Base):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)
    gguf_arch: ClassVar[str] = QWEN3MOE
    hf_reference: ClassVar[dict[str, str]] = {"Qwen3MoeForCausalLM": "Qwen3MoeForCausalLM"}
    moe = True
