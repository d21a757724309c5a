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

from typing import ClassVar

from gguf import Keys

from . import names, register
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .config_reader import MAX_LAYERS, ConfigReader
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import RolePlan, add_output_head, add_swiglu, embedding_rows, plan_experts, text_model_name
from .rope_scaling import rope_scaling_of

QWEN3, QWEN3MOE = "qwen3", "qwen3moe"
EXPERT_WEIGHTS_NORM = "expert_weights_norm"  # `{arch}.expert_weights_norm` (bool), llama.cpp's key


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
        self.n_head = cfg.integer("num_attention_heads", min=1)
        self.n_kv = cfg.integer("num_key_value_heads", default=self.n_head, min=1)
        self.hd = cfg.integer("head_dim", default=self.H // self.n_head, min=1)
        self.F = cfg.integer("intermediate_size", min=1)
        if self.n_head % self.n_kv:
            raise SpecconvError(f"config.json: num_attention_heads {self.n_head} is not a multiple of "
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

    @property
    def gguf_arch(self) -> str:
        return QWEN3MOE if self.moe else QWEN3

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

    def tensor_plan(self) -> list[TensorPlan]:
        plan, H, V = RolePlan(self.checkpoint.tensors), self.H, self.vocab_size()
        trunk = Role.TRUNK
        plan.add(names.TOKEN_EMBD, [plan.source("model.embed_tokens.weight", (V, H))], (V, H), Role.SHARED)
        q, kv = self.n_head * self.hd, self.n_kv * self.hd
        for i in range(self.L):
            p = f"model.layers.{i}."
            plan.add(names.blk(i, "attn_norm"), [plan.source(p + "input_layernorm.weight", (H,))], (H,), trunk,
                     tf.identity, True)
            for part, hf, shape in (("attn_q", "q_proj", (q, H)), ("attn_k", "k_proj", (kv, H)),
                                    ("attn_v", "v_proj", (kv, H)), ("attn_output", "o_proj", (H, q))):
                plan.add(names.blk(i, part), [plan.source(f"{p}self_attn.{hf}.weight", shape)], shape, trunk)
            for part, hf in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
                plan.add(names.blk(i, part), [plan.source(f"{p}self_attn.{hf}.weight", (self.hd,))], (self.hd,),
                         trunk, tf.identity, True)
            plan.add(names.blk(i, "ffn_norm"), [plan.source(p + "post_attention_layernorm.weight", (H,))], (H,),
                     trunk, tf.identity, True)
            if self.moe:
                m = p + "mlp."
                plan.add(names.blk(i, "ffn_gate_inp"), [plan.source(m + "gate.weight", (self.E, H))], (self.E, H),
                         trunk, tf.identity, True)
                plan_experts(plan, i, m + "experts.", self.E, self.Fe, H, trunk, where=f"layer {i} (mlp.experts)",
                             count_field="num_experts")
            else:
                add_swiglu(plan, i, p + "mlp.", self.F, H, trunk)
        plan.add(names.OUTPUT_NORM, [plan.source("model.norm.weight", (H,))], (H,), Role.SHARED, tf.identity, True)
        tied = self.tied
        if tied and plan.has("lm_head.weight"):
            # llama.cpp's converter writes a saved head even when tied: the same file, byte for byte
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", (V, H))], (V, H), Role.SHARED)
        else:
            add_output_head(plan, tied, V, H)
        return plan.finish(self.gguf_arch)

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        # The keys and order of llama.cpp's TextModel.set_gguf_parameters (+ Qwen2MoeModel's).
        w = MetadataWriter(self.gguf_arch)
        w.text_model(self.L, self.context_length, self.H, self.F, self.n_head, self.n_kv)
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
    moe = False


@register
class Qwen3Moe(Qwen3Base):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)
    moe = True
