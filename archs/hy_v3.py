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
from typing import Any, ClassVar, Mapping

from gguf import Keys

from . import names, register
from .base import Checkpoint, MetaKV, Role
from .chained_mtp import ChainedMtpPlugin, Sizes, chained_table, check_stated_count, head_copies, norm_spec, routed_specs
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .metadata import MetadataWriter
from .nextn_moe import MOE_KEYS, MoeHparams, _TOWERS, parse_moe_hparams
from .plan_tools import RolePlan, plan_experts, text_model_name, trunk_indexed_mtp_count
from .tensor_table import Hook, TensorSpec, TensorTable

# Hy3's names of the MoE fields (nextn_moe.MOE_KEYS)
HY_V3_MOE_KEYS: Mapping[str, tuple[str, ...]] = {
    **MOE_KEYS, "n_routed_experts": ("num_experts", "num_local_experts"), "n_shared_experts": ("num_shared_experts",),
    "routed_scaling_factor": ("router_scaling_factor",), "norm_topk_prob": ("route_norm",)}
# transformers' HYV3Config defaults for the behavioural fields a config.json may leave out
DEFAULTS: Mapping[str, Any] = {"num_shared_experts": 1, "router_scaling_factor": 2.826, "rms_norm_eps": 1e-5,
                               "max_position_embeddings": 131072, "attention_bias": False, "route_norm": True}


_norm = norm_spec()
_ATTN = "{p}self_attn."
HY_V3_TABLE = chained_table(
    _norm,
    head=(_norm("blk.{bid}.nextn.shared_head_norm.weight", "{p}final_layernorm.weight", "nextn"), *head_copies()),
    attention=(
        TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.E)),
        TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.E)),
        TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.kv, s.E)),
        TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.E, s.q)),
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

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        cfg = ConfigReader(checkpoint.config)
        tc = cfg.text_model().with_defaults(DEFAULTS, "hy_v3 default")
        if tc.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported for hy_v3 (llama.cpp loads no biases)")
        rope = tc.with_rope().string("rope_type", default="default")
        if rope != "default":
            raise SpecconvError(f"config.json: rope type {rope!r} is not supported for hy_v3 (default only)")
        n = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        self.k = trunk_indexed_mtp_count(checkpoint, n)
        check_stated_count(self, tc.integer("num_nextn_predict_layers", default=None), self.k,
                           f"model.layers.{n}..{n + self.k - 1}", f"model.layers.{n}.*")
        self.moe_layers = {i for i in range(n + self.k) if f"model.layers.{i}.mlp.router.gate.weight" in checkpoint.tensors}
        types = tc.strings("mlp_layer_types", default=None)
        if types is not None and len(types) >= n:
            wrong = [i for i in range(n) if (types[i] == "sparse") != (i in self.moe_layers)]
            if wrong:
                raise SpecconvError(f"config.json mlp_layer_types disagrees with the checkpoint at layer {wrong[0]} "
                                    f"(router tensor {'missing' if types[wrong[0]] == 'sparse' else 'present'})")
        first_dense = min(self.moe_layers) if self.moe_layers else n
        derived = tc.with_values({"first_k_dense_replace": first_dense, "num_nextn_predict_layers": self.k},
                                 "from the checkpoint's tensors")
        self.hp: MoeHparams = parse_moe_hparams(cfg, derived, "hy_v3", HY_V3_MOE_KEYS, groups=False)
        hp = self.hp
        self.n, self.hidden, self.vocab, self.ffn = hp.num_hidden_layers, hp.hidden, hp.vocab, hp.ffn
        self.tied = hp.tie_embeddings
        self.num_key_value_heads = tc.integer("num_key_value_heads", default=hp.num_attention_heads, min=1)
        self.head_dim = tc.integer("head_dim", default=hp.hidden // hp.num_attention_heads, min=1)
        self.has_head_dim = tc.has("head_dim")
        if self.hp.num_attention_heads % self.num_key_value_heads:
            raise SpecconvError(f"config.json: num_attention_heads ({self.hp.num_attention_heads}) is not a multiple of "
                                f"num_key_value_heads ({self.num_key_value_heads})")

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        name = text_model_name(raw_name, _TOWERS, "vision tower (belongs in a separate mmproj file)")
        if isinstance(name, str) and re.match(r"^model\.layers\.\d+\.(embed_tokens|shared_head)\.", name):
            return (None, "MTP layer's copy of the embedding / LM head (the trunk's are used, as vLLM does)")
        return name

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = HY_V3_TABLE

    def sizes(self) -> Sizes:
        hp, total = self.hp, self.n + self.k
        return Sizes(num_hidden_layers=self.n, E=hp.hidden, V=self.vocab, heads=(hp.num_attention_heads,) * total,
                     kv_heads=(self.num_key_value_heads,) * total, head_dim=self.head_dim, moe_layers=frozenset(self.moe_layers),
                     ffn=hp.ffn, num_experts=hp.num_experts, expert_ffn=hp.expert_ffn, shared_ffn=hp.shared_ffn)

    def hooks(self) -> dict[str, Hook]:
        return {"experts": self._experts}

    def _experts(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        m = p + "mlp."
        plan_experts(plan, bid, m + "experts.", s.num_experts, s.expert_ffn, s.E, role, where=f"layer {bid} ({m}experts)",
                     count_field="num_experts")

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """In the order of llama.cpp's converter (TextModel's keys, then HYV3Model's)."""
        hp = self.hp
        w = MetadataWriter(self.gguf_arch)
        w.text_model(hp.num_hidden_layers + (self.k if keep_mtp else 0), hp.context_length, hp.hidden, hp.ffn, hp.num_attention_heads,
                     self.num_key_value_heads)
        w.f32(Keys.Rope.FREQ_BASE, hp.rope_theta)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, hp.rms_eps)
        w.experts(hp.num_experts, hp.num_experts_per_tok)
        if self.has_head_dim:
            w.head_sizes(self.head_dim)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.expert_ffn)
        w.u32(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, hp.shared_ffn)
        w.flag(Keys.LLM.EXPERT_WEIGHTS_NORM, hp.norm_topk)
        w.f32(Keys.LLM.EXPERT_WEIGHTS_SCALE, hp.routed_scale)
        w.u32(Keys.LLM.EXPERT_GATING_FUNC, names.EXPERT_GATING_SIGMOID)
        w.nextn(self.k if keep_mtp else 0)
        return w.kv
