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

from dataclasses import dataclass
from typing import ClassVar

from gguf import Keys

from . import names, register
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import RolePlan, add_output_head, embedding_rows, plan_experts, text_model_name
from .rope_scaling import rope_scaling_of
from .tensor_table import AttentionWidths, Block, TensorSpec, TensorTable

QWEN3, QWEN3MOE = "qwen3", "qwen3moe"
EXPERT_WEIGHTS_NORM = "expert_weights_norm"  # `{arch}.expert_weights_norm` (bool), llama.cpp's key


@dataclass(frozen=True)
class Sizes(AttentionWidths):
    """The dimensions of the Qwen3 table: the plugin's from config.json, the graph's from GGUF metadata
    (runtime/graphs/qwen3.py, V = "V")."""

    num_hidden_layers: int
    moe: bool
    E: int  # hidden size
    V: int | str  # vocabulary
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn: int = 0
    num_experts: int = 0
    expert_ffn: int = 0


def block_tags(s: Sizes, bid: int) -> frozenset[str]:
    return frozenset({"moe" if s.moe else "dense"})


def _norm(gguf: str, hf: str, dim=lambda s: (s.E,)) -> TensorSpec:
    return TensorSpec(gguf, hf, dim, f32=True)  # plain RMSNorm weights, kept F32


_ATTN, _MLP = "{p}self_attn.", "{p}mlp."
QWEN3_TABLE = TensorTable((
    TensorSpec(names.TOKEN_EMBD, "model.embed_tokens.weight", lambda s: (s.V, s.E)),
    _norm(names.OUTPUT_NORM, "model.norm.weight"),
    TensorSpec(names.OUTPUT, None, lambda s: (s.V, s.E), optional=True, hook="output_head"),  # absent when tied
    _norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
    TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.E)),
    TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.E)),
    TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.kv, s.E)),
    TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.E, s.q)),
    _norm("blk.{bid}.attn_q_norm.weight", _ATTN + "q_norm.weight", lambda s: (s.head_dim,)),
    _norm("blk.{bid}.attn_k_norm.weight", _ATTN + "k_norm.weight", lambda s: (s.head_dim,)),
    _norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight"),
    TensorSpec("blk.{bid}.ffn_gate.weight", _MLP + "gate_proj.weight", lambda s: (s.ffn, s.E), "dense"),
    TensorSpec("blk.{bid}.ffn_up.weight", _MLP + "up_proj.weight", lambda s: (s.ffn, s.E), "dense"),
    TensorSpec("blk.{bid}.ffn_down.weight", _MLP + "down_proj.weight", lambda s: (s.E, s.ffn), "dense"),
    TensorSpec("blk.{bid}.ffn_gate_inp.weight", _MLP + "gate.weight", lambda s: (s.num_experts, s.E), "moe", f32=True),
    TensorSpec("blk.{bid}.ffn_gate_exps.weight", None, lambda s: (s.num_experts, s.expert_ffn, s.E), "moe",
               hook="experts"),
    TensorSpec("blk.{bid}.ffn_up_exps.weight", None, lambda s: (s.num_experts, s.expert_ffn, s.E), "moe",
               hook="experts"),
    TensorSpec("blk.{bid}.ffn_down_exps.weight", None, lambda s: (s.num_experts, s.E, s.expert_ffn), "moe",
               hook="experts"),
), block_tags)


class Qwen3Base(ArchPlugin):
    family: ClassVar[str] = "qwen3"
    moe: ClassVar[bool] = False
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "qwen2"  # what llama.cpp's hash table names the Qwen3 tokenizer

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        cfg = ConfigReader(checkpoint.config)
        self.H = cfg.integer("hidden_size", min=1)
        self.L = cfg.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        self.num_attention_heads = cfg.integer("num_attention_heads", min=1)
        self.n_kv = cfg.integer("num_key_value_heads", default=self.num_attention_heads, min=1)
        self.hd = cfg.integer("head_dim", default=self.H // self.num_attention_heads, min=1)
        self.F = cfg.integer("intermediate_size", min=1)
        if self.num_attention_heads % self.n_kv:
            raise SpecconvError(f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple of "
                                f"num_key_value_heads {self.n_kv}")
        act = cfg.string("hidden_act", default="silu")
        if act != "silu":
            raise SpecconvError(f"config.json: hidden_act {act!r} is not supported (qwen3 uses silu)")
        if cfg.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported (llama.cpp's qwen3 graphs "
                                "have no q/k/v biases)")
        if cfg.flag("use_sliding_window", default=False):
            raise SpecconvError("config.json: use_sliding_window=true is not supported (llama.cpp's qwen3 "
                                "graphs attend to the whole context)")
        self.rope_scaling = rope_scaling_of(cfg, "Qwen3", unscaled=("default", "mrope"))
        self.context_length = cfg.integer("max_position_embeddings", default=None, min=1)
        self.rope_theta = cfg.with_rope().number("rope_theta", default=None)
        self.rms_eps = cfg.number("rms_norm_eps", default=1e-6)
        self.has_head_dim = cfg.has("head_dim")
        self.tied = cfg.flag("tie_word_embeddings", default=False)
        if self.moe:
            self.E = cfg.integer("num_experts", "num_local_experts", min=1)
            self.k_used = cfg.integer("num_experts_per_tok", min=1)
            self.Fe = cfg.integer("moe_intermediate_size", min=1)
            if not 0 < self.k_used <= self.E:
                raise SpecconvError(f"config.json: num_experts_per_tok {self.k_used} is not in 1..{self.E}")
            if cfg.integers("mlp_only_layers", default=None) or cfg.integer("decoder_sparse_step", default=1) != 1:
                raise SpecconvError("config.json: dense layers in a Qwen3-MoE (mlp_only_layers / "
                                    "decoder_sparse_step != 1) are not supported (llama.cpp's qwen3moe has none)")
            self.norm_topk = cfg.flag("norm_topk_prob", default=False)

    @classmethod
    def normalize_name(cls, raw_name: str):
        return text_model_name(raw_name, (), "")

    @property
    def n_trunk_layers(self) -> int:
        return self.L

    @property
    def n_mtp_layers(self) -> int:
        return 0

    def vocab_size(self) -> int:
        return embedding_rows(self.checkpoint)

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = QWEN3_TABLE

    def tensor_plan(self) -> list[TensorPlan]:
        plan = RolePlan(self.checkpoint.tensors)
        blocks = [Block(i, f"model.layers.{i}.", Role.TRUNK) for i in range(self.L)]
        self.table.plan(plan, self.sizes(), blocks, {"output_head": self._output_head, "experts": self._experts})
        return plan.finish(self.gguf_arch)

    def sizes(self) -> Sizes:
        return Sizes(num_hidden_layers=self.L, moe=self.moe, E=self.H, V=self.vocab_size(), num_attention_heads=self.num_attention_heads,
                     num_key_value_heads=self.n_kv, head_dim=self.hd, ffn=self.F, num_experts=self.E if self.moe else 0,
                     expert_ffn=self.Fe if self.moe else 0)

    def _output_head(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        if self.tied and plan.has("lm_head.weight"):
            # llama.cpp's converter writes a saved head even when tied: the same file, byte for byte
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", (s.V, s.E))], (s.V, s.E), Role.SHARED)
        else:
            add_output_head(plan, self.tied, s.V, s.E)

    def _experts(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        plan_experts(plan, bid, p + "mlp.experts.", s.num_experts, s.expert_ffn, s.E, role,
                     where=f"layer {bid} (mlp.experts)", count_field="num_experts")

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        # The keys and order of llama.cpp's TextModel.set_gguf_parameters (+ Qwen2MoeModel's).
        w = MetadataWriter(self.gguf_arch)
        w.text_model(self.L, self.context_length, self.H, self.F, self.num_attention_heads, self.n_kv)
        w.rope_scaling(self.rope_scaling)
        w.f32(Keys.Rope.FREQ_BASE, self.rope_theta)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, self.rms_eps)
        if self.moe:
            w.experts(self.E, self.k_used)
        if self.has_head_dim:
            w.head_sizes(self.hd)
        if self.moe:
            w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, self.Fe)
            if not self.norm_topk:  # not written upstream (llama.cpp renormalises); see the module docstring
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
