"""GLM-4.5 / 4.6 / 4.5-Air (`Glm4MoeForCausalLM`) -> GGUF arch `glm4moe` (docs/reference/gguf-layout.md §7.4).

GQA attention with optional q/k/v biases and per-head q/k norms, partial NEOX rope (factor 0.5 by
default; no Q/K permutation), leading dense blocks then sigmoid-routed MoE with a correction bias
and expert groups, and the nextn layer(s) at `model.layers.{N}`. All norms are plain RMSNorm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gguf import Keys

from . import names, register
from .base import MetaKV
from .config_reader import ConfigReader
from .errors import SpecconvError
from .hparams import HParamsReader
from .metadata import MetadataWriter
from .nextn_moe import NextnMoePlugin, nextn_moe_table, norm
from .nextn_moe_hparams import NextnMoeHParams
from .tensor_table import TensorSpec, TensorTable


@dataclass(kw_only=True)
class Glm4MoeHParams(NextnMoeHParams):
    """GQA attention (num_key_value_heads, head_dim; rope on the first rotary_dim = head_dim ·
    partial_rotary_factor dims of each head) with optional q/k/v biases and per-head q/k norms."""

    family: ClassVar[str] = "glm4moe"
    gguf_arch: ClassVar[str] = names.GLM4MOE
    config_defaults: ClassVar[dict] = {  # transformers' Glm4MoeConfig
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "n_shared_experts": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "attention_bias": False, "use_qk_norm": False}
    yarn_log_multiplier: ClassVar[bool] = False  # llama.cpp's glm4moe reads no mscale key

    # config.json's; a file's metadata does not say, and its blocks may hold them (optional tensors)
    attention_bias: bool = False
    use_qk_norm: bool = False

    def attention_tags(self, bid: int) -> set[str]:
        stated = (("attn_bias", self.attention_bias), ("qk_norm", self.use_qk_norm))
        return {t for t, on in stated if on or self.from_file}

    @classmethod
    def fields_from_config(cls, cfg: ConfigReader, tc: ConfigReader) -> dict[str, Any]:
        f = super().fields_from_config(cfg, tc)
        _, kv_heads, head_dim = tc.attention_heads()
        factor = tc.with_rope().number("partial_rotary_factor", default=0.5)  # GLM's default (upstream too)
        rotary_dim = int(head_dim * factor)
        if rotary_dim % 2 or rotary_dim == 0:
            raise SpecconvError(f"rotary dimension {rotary_dim} (head_dim * partial_rotary_factor) must be even "
                                f"and positive")
        return dict(f, num_key_value_heads=kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
                    attention_bias=tc.flag("attention_bias", default=False),
                    use_qk_norm=tc.flag("use_qk_norm", default=False))

    @classmethod
    def fields_from_kv(cls, r: HParamsReader) -> dict[str, Any]:
        f = super().fields_from_kv(r)
        key, heads = r.key, f["num_attention_heads"]
        head_dim = key("attention.key_length", f["hidden_size"] // heads, int)
        if key("attention.value_length", head_dim, int) != head_dim:
            raise SpecconvError("glm4moe: attention.key_length != value_length")
        kv_heads = key("attention.head_count_kv", heads, int)
        if heads % kv_heads:
            raise SpecconvError(f"glm4moe: {heads} heads are not a multiple of {kv_heads} KV heads")
        return dict(f, num_key_value_heads=kv_heads, head_dim=head_dim,
                    rotary_dim=key("rope.dimension_count", head_dim // 2, int))


_A = "{p}self_attn."


def _proj(part: str, hf: str, rows) -> tuple[TensorSpec, TensorSpec]:
    """A q/k/v projection and its bias (written with attention_bias; optional to the runtime)."""
    return (TensorSpec(f"blk.{{bid}}.{part}.weight", f"{_A}{hf}.weight", lambda s: (rows(s), s.hidden_size)),
            TensorSpec(f"blk.{{bid}}.{part}.bias", f"{_A}{hf}.bias", lambda s: (rows(s),), "attn_bias", optional=True,
                       f32=True))


# GQA with optional q/k/v biases and per-head q/k norms (use_qk_norm), docs/reference/gguf-layout.md §7.4
GLM4MOE_TABLE = nextn_moe_table((
    *_proj("attn_q", "q_proj", lambda s: s.num_attention_heads * s.head_dim),
    *_proj("attn_k", "k_proj", lambda s: s.num_key_value_heads * s.head_dim),
    *_proj("attn_v", "v_proj", lambda s: s.num_key_value_heads * s.head_dim),
    TensorSpec("blk.{bid}.attn_output.weight", _A + "o_proj.weight",
               lambda s: (s.hidden_size, s.num_attention_heads * s.head_dim)),
    norm("blk.{bid}.attn_q_norm.weight", _A + "q_norm.weight", "qk_norm", lambda s: (s.head_dim,), optional=True),
    norm("blk.{bid}.attn_k_norm.weight", _A + "k_norm.weight", "qk_norm", lambda s: (s.head_dim,), optional=True),
), "post_attention_norm")


@register
class Glm4Moe(NextnMoePlugin):
    hf_architectures = ("Glm4MoeForCausalLM",)
    gguf_arch: ClassVar[str] = Glm4MoeHParams.gguf_arch
    llama_cpp_skips_absent_nextn: ClassVar[bool] = True  # trunk-only without the nextn tensors (inspect)
    hf_reference: ClassVar[dict[str, str]] = {"Glm4MoeForCausalLM": "Glm4MoeForCausalLM"}
    HParams = Glm4MoeHParams
    family: ClassVar[str] = Glm4MoeHParams.family
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "glm4"
    # <|endoftext|> as end-of-turn makes GLM generate endlessly: llama.cpp's GLM converter fixes these.
    special_tokens: ClassVar[dict[str, str]] = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>",
                                                "eom": "<|observation|>"}
    table: ClassVar[TensorTable] = GLM4MOE_TABLE

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        hp = self.hp
        w = MetadataWriter(self.gguf_arch)
        self._common_head_kv(w, keep_mtp, hp.num_key_value_heads)
        w.head_sizes(hp.head_dim)
        w.u32(Keys.Rope.DIMENSION_COUNT, hp.rotary_dim)
        self._common_moe_kv(w, keep_mtp)
        return w.kv
