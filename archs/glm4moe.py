"""GLM-4.5 / 4.6 / 4.5-Air (`Glm4MoeForCausalLM`) -> GGUF arch `glm4moe` (docs/reference/gguf-layout.md §7.4).

GQA attention with optional q/k/v biases and per-head q/k norms, partial NEOX rope (factor 0.5 by
default; no Q/K permutation), leading dense blocks then sigmoid-routed MoE with a correction bias
and expert groups, and the nextn layer(s) at `model.layers.{N}`. All norms are plain RMSNorm.
"""

from __future__ import annotations

from typing import ClassVar

from gguf import Keys

from . import names, register
from .base import Checkpoint, MetaKV
from .errors import SpecconvError
from .metadata import MetadataWriter
from .nextn_moe import NextnMoePlugin, nextn_moe_table, norm
from .tensor_table import TensorSpec, TensorTable


_A = "{p}self_attn."


def _proj(part: str, hf: str, rows) -> tuple[TensorSpec, TensorSpec]:
    """A q/k/v projection and its bias (written with attention_bias; optional to the runtime)."""
    return (TensorSpec(f"blk.{{bid}}.{part}.weight", f"{_A}{hf}.weight", lambda s: (rows(s), s.E)),
            TensorSpec(f"blk.{{bid}}.{part}.bias", f"{_A}{hf}.bias", lambda s: (rows(s),), "attn_bias", optional=True,
                       f32=True))


# GQA with optional q/k/v biases and per-head q/k norms (use_qk_norm), docs/reference/gguf-layout.md §7.4
GLM4MOE_TABLE = nextn_moe_table((
    *_proj("attn_q", "q_proj", lambda s: s.num_attention_heads * s.head_dim),
    *_proj("attn_k", "k_proj", lambda s: s.num_key_value_heads * s.head_dim),
    *_proj("attn_v", "v_proj", lambda s: s.num_key_value_heads * s.head_dim),
    TensorSpec("blk.{bid}.attn_output.weight", _A + "o_proj.weight", lambda s: (s.E, s.num_attention_heads * s.head_dim)),
    norm("blk.{bid}.attn_q_norm.weight", _A + "q_norm.weight", "qk_norm", lambda s: (s.head_dim,), optional=True),
    norm("blk.{bid}.attn_k_norm.weight", _A + "k_norm.weight", "qk_norm", lambda s: (s.head_dim,), optional=True),
), "post_attention_norm")


@register
class Glm4Moe(NextnMoePlugin):
    hf_architectures = ("Glm4MoeForCausalLM",)
    gguf_arch: ClassVar[str] = names.GLM4MOE
    llama_cpp_skips_absent_nextn: ClassVar[bool] = True  # trunk-only without the nextn tensors (inspect)
    hf_reference: ClassVar[dict[str, str]] = {"Glm4MoeForCausalLM": "Glm4MoeForCausalLM"}
    family: ClassVar[str] = "glm4moe"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "glm4"
    # <|endoftext|> as end-of-turn makes GLM generate endlessly: llama.cpp's GLM converter fixes these.
    special_tokens: ClassVar[dict[str, str]] = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>",
                                                "eom": "<|observation|>"}
    config_defaults: ClassVar[dict] = {  # transformers' Glm4MoeConfig
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "n_shared_experts": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "attention_bias": False, "use_qk_norm": False}

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        tc = self.tc
        hp = self.hp
        self.num_key_value_heads = tc.integer("num_key_value_heads", default=hp.num_attention_heads, min=1)
        self.head_dim = tc.integer("head_dim", default=hp.hidden // hp.num_attention_heads, min=1)
        if hp.num_attention_heads % self.num_key_value_heads:
            raise SpecconvError(f"config.json: num_attention_heads ({hp.num_attention_heads}) is not a multiple of "
                                f"num_key_value_heads ({self.num_key_value_heads})")
        factor = tc.with_rope().number("partial_rotary_factor", default=0.5)  # GLM's default (upstream too)
        self.rope_dim = int(self.head_dim * factor)
        if self.rope_dim % 2 or self.rope_dim == 0:
            raise SpecconvError(f"rotary dimension {self.rope_dim} (head_dim * partial_rotary_factor) must be even "
                                f"and positive")
        self.attention_bias = tc.flag("attention_bias", default=False)
        self.qk_norm = tc.flag("use_qk_norm", default=False)

    table: ClassVar[TensorTable] = GLM4MOE_TABLE

    def attention_sizes(self) -> dict:
        return dict(num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, attn_bias=self.attention_bias,
                    qk_norm=self.qk_norm)

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        w = MetadataWriter(self.gguf_arch)
        self._common_head_kv(w, keep_mtp, self.num_key_value_heads)
        w.head_sizes(self.head_dim)
        w.u32(Keys.Rope.DIMENSION_COUNT, self.rope_dim)
        self._common_moe_kv(w, keep_mtp)
        return w.kv
