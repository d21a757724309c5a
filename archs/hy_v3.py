"""Tencent Hy3 (`HYV3ForCausalLM`) -> GGUF arch `hy_v3` (llama.cpp 0c1e570, src/models/hy-v3.cpp).

GQA attention with per-head q/k RMSNorms before a full-width NEOX rope, dense SwiGLU in the layers
without a router, sigmoid-routed MoE (selection bias `mlp.expert_bias`, renormalised top-k times
`router_scaling_factor`) plus one always-on shared expert elsewhere, and k chained MTP blocks at
`model.layers.{N..N+k-1}`: `eh_proj / enorm / hnorm`, a full decoder block and `final_layernorm`
(-> `nextn.shared_head_norm`, applied before the shared LM head; docs/mtp.md §Chained MTP heads).

Release names (transformers' `hy_v3` conversion mapping): `mlp.router.gate.weight` (router),
`mlp.expert_bias`, `mlp.shared_mlp.*`, per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`
(transformers' fused `gate_up_proj` is accepted too). An MTP layer's own `embed_tokens` /
`shared_head.*` copies are skipped: vLLM and transformers use the trunk's embedding and LM head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from gguf import Keys

from . import names, register
from .base import Checkpoint, MetaKV
from .chained_mtp import (ChainedHParams, ChainedMtpPlugin, chained_table, check_stated_count, head_copies,
                          kv_fields, norm_spec, routed_specs)
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import HParamsReader
from .metadata import MetadataWriter
from .nextn_moe import _TOWERS
from .plan_tools import routed_experts, text_model_name, trunk_indexed_mtp_count
from .tensor_table import Hook, TensorSpec, TensorTable

# transformers' HYV3Config defaults for the behavioural fields a config.json may leave out
DEFAULTS: Mapping[str, Any] = {"num_shared_experts": 1, "router_scaling_factor": 2.826, "rms_norm_eps": 1e-5,
                               "max_position_embeddings": 131072, "attention_bias": False, "route_norm": True}


@dataclass(kw_only=True)
class HyV3HParams(ChainedHParams):
    """Hy3's hyperparameters under HYV3Config's names (router_scaling_factor and route_norm are the
    routing's routed_scaling_factor and norm_topk_prob; the shared expert's width is
    num_shared_experts x moe_intermediate_size)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    head_dim_stated: bool = False  # config.json states head_dim, so the file holds attention.key_length

    @classmethod
    def from_config(cls, checkpoint: Checkpoint) -> "HyV3HParams":
        """config.json (HYV3Config's defaults for what it leaves out), with what the checkpoint's tensor
        names say: k MTP layers at model.layers.{N..}, the routed layers (those with a router)."""
        cfg = ConfigReader(checkpoint.config)
        tc = cfg.text_model().with_defaults(DEFAULTS, "hy_v3 default")
        if tc.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported for hy_v3 (llama.cpp loads no biases)")
        rope = tc.with_rope().string("rope_type", default="default")
        if rope != "default":
            raise SpecconvError(f"config.json: rope type {rope!r} is not supported for hy_v3 (default only)")
        n = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        k = trunk_indexed_mtp_count(checkpoint, n)
        stated = tc.integer("num_nextn_predict_layers", default=None)
        check_stated_count(stated, k, f"model.layers.{n}..{n + k - 1}")
        moe_layers = frozenset(i for i in range(n + k) if f"model.layers.{i}.mlp.router.gate.weight" in checkpoint.tensors)
        types = tc.strings("mlp_layer_types", default=None)
        if types is not None and len(types) >= n:
            wrong = [i for i in range(n) if (types[i] == "sparse") != (i in moe_layers)]
            if wrong:
                raise SpecconvError(f"config.json mlp_layer_types disagrees with the checkpoint at layer {wrong[0]} "
                                    f"(router tensor {'missing' if types[wrong[0]] == 'sparse' else 'present'})")
        used, num_experts = tc.integer("num_experts_per_tok", min=1), tc.integer("num_experts", "num_local_experts", min=1)
        if used > num_experts:
            raise SpecconvError(f"config.json: num_experts_per_tok ({used}) exceeds n_routed_experts ({num_experts})")
        act = tc.string("hidden_act", default="silu")
        if act != "silu":
            raise SpecconvError(f"config.json: hidden_act {act!r} is not supported (hy_v3 uses silu)")
        hidden_size, num_attention_heads = tc.integer("hidden_size", min=1), tc.integer("num_attention_heads", min=1)
        vocab_size = tc.integer("vocab_size", min=1)
        intermediate_size, moe_intermediate_size = tc.integer("intermediate_size"), tc.integer("moe_intermediate_size")
        shared = tc.integer("num_shared_experts", default=0)
        fields = dict(routed_scaling_factor=tc.number("router_scaling_factor", default=1.0) or 1.0,
                      norm_topk_prob=tc.flag("route_norm", default=True),
                      rms_norm_eps=tc.number("rms_norm_eps", default=1e-6) or 1e-6,
                      rope_theta=tc.with_rope().number("rope_theta", default=10000.0),
                      max_position_embeddings=tc.integer("max_position_embeddings", default=4096),
                      tie_word_embeddings=cfg.flag("tie_word_embeddings",
                                                   default=tc.flag("tie_word_embeddings", default=False)))
        _, num_key_value_heads, head_dim = tc.attention_heads()
        return cls(arch=names.HY_V3, num_hidden_layers=n, num_nextn_predict_layers=k, mtp_layers_in_config=stated,
                   hidden_size=hidden_size, vocab_size=vocab_size, num_attention_heads=num_attention_heads,
                   num_key_value_heads=num_key_value_heads, head_dim=head_dim, head_dim_stated=tc.has("head_dim"),
                   intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
                   shared_expert_intermediate_size=moe_intermediate_size * shared, moe_layers=moe_layers,
                   num_experts=num_experts, num_experts_per_tok=used, **fields)

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "HyV3HParams":
        """GGUF metadata; the FFN widths are each block's tensors' (ChainedHParams)."""
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        _, num_attention_heads, head_dim = r.attention_widths()
        r.check_value_length(head_dim)
        num_key_value_heads = key("attention.head_count_kv", num_attention_heads, int)
        if num_attention_heads % num_key_value_heads:
            raise SpecconvError(f"{arch}: {num_attention_heads} heads are not a multiple of {num_key_value_heads} KV heads")
        return cls(**kv_fields(r), num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                   head_dim=head_dim, head_dim_stated=r.has("attention.key_length"),
                   rope_theta=key("rope.freq_base", 10000.0, float), num_experts=key("expert_count", 0, int),
                   routed_scaling_factor=key("expert_weights_scale", 1.0, float) or 1.0,
                   norm_topk_prob=key("expert_weights_norm", False, bool))


_norm = norm_spec()
_ATTN = "{p}self_attn."
HY_V3_TABLE = chained_table(
    _norm,
    head=(_norm("blk.{bid}.nextn.shared_head_norm.weight", "{p}final_layernorm.weight", "nextn"), *head_copies()),
    attention=(
        TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.hidden_size)),
        TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.hidden_size)),
        TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.kv, s.hidden_size)),
        TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.hidden_size, s.q)),
        _norm("blk.{bid}.attn_q_norm.weight", _ATTN + "q_norm.weight", dim=lambda s: (s.head_dim,)),
        _norm("blk.{bid}.attn_k_norm.weight", _ATTN + "k_norm.weight", dim=lambda s: (s.head_dim,)),
    ),
    ffn_norm=(_norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight"),),
    # llama.cpp's hy_v3 loader names the selection bias without a suffix (tn(FFN_EXP_PROBS_B, i))
    routed=routed_specs("{p}mlp.router.gate.weight", "exp_probs_b", "{p}mlp.expert_bias",
                        shared_hf="{p}mlp.shared_mlp."),
)


@register
class HyV3(ChainedMtpPlugin):
    hf_architectures = ("HYV3ForCausalLM",)
    gguf_arch: ClassVar[str] = names.HY_V3
    hf_reference: ClassVar[dict[str, str]] = {"HYV3ForCausalLM": "HYV3ForCausalLM"}
    family: ClassVar[str] = "hy_v3"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "hy_v4"  # the Hy tokenizer llama.cpp 0c1e570 knows (Hy4-preview)
    HParams: ClassVar[type[HyV3HParams]] = HyV3HParams

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        name = text_model_name(raw_name, _TOWERS, "vision tower (belongs in a separate mmproj file)")
        if isinstance(name, str) and re.match(r"^model\.layers\.\d+\.(embed_tokens|shared_head)\.", name):
            return (None, "MTP layer's copy of the embedding / LM head (the trunk's are used, as vLLM does)")
        return name

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = HY_V3_TABLE

    def hooks(self) -> dict[str, Hook]:
        return {**super().hooks(), "experts": routed_experts("num_experts")}

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """In the order of llama.cpp's converter (TextModel's keys, then HYV3Model's)."""
        hp, k = self.hp, self.hp.num_nextn_predict_layers if keep_mtp else 0
        w = MetadataWriter(self.gguf_arch)
        w.text_model(hp.num_hidden_layers + k, hp.max_position_embeddings, hp.hidden_size, hp.intermediate_size,
                     hp.num_attention_heads, hp.num_key_value_heads, rope_theta=hp.rope_theta,
                     rms_norm_eps=hp.rms_norm_eps, experts=(hp.num_experts, hp.num_experts_per_tok),
                     key_length=hp.head_dim if hp.head_dim_stated else None)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.moe_intermediate_size)
        w.u32(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, hp.shared_expert_intermediate_size)
        w.flag(Keys.LLM.EXPERT_WEIGHTS_NORM, hp.norm_topk_prob)
        w.f32(Keys.LLM.EXPERT_WEIGHTS_SCALE, hp.routed_scaling_factor)
        w.u32(Keys.LLM.EXPERT_GATING_FUNC, names.EXPERT_GATING_SIGMOID)
        w.nextn(k)
        return w.kv
