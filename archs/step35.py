"""StepFun Step-3.5-Flash / Step-3.7-Flash (`Step3p5ForCausalLM`, `Step3p7ForConditionalGeneration`)
-> GGUF arch `step35` (llama.cpp 0c1e570, src/models/step35.cpp).

Full-attention and sliding-window layers with their own head counts (`attention_other_setting`),
partial rotary on full layers (half the head) and full rotary on sliding ones, per-head q/k norms, a
head-wise sigmoid attention gate (`g_proj`), leading dense layers then sigmoid-routed MoE (selection
bias `moe.router_bias`) plus a shared expert, optional per-layer SwiGLU clamps, and k chained MTP
blocks at `model.layers.{N..N+k-1}` (eh_proj / enorm / hnorm, a full decoder block, and the block's
own `transformer.shared_head.{norm,output}`). Every RMSNorm is Gemma-style (1 + w): +1 is added.

config.json is read as the release writes it (`num_attention_groups`, `moe_num_experts`, `moe_top_k`,
`moe_layers_enum`, `rope_theta` / `partial_rotary_factors` lists of N+k entries, ...): transformers
5.23's Step3p7TextConfig rewrites and truncates those fields, and llama.cpp's converter then fails
(measured-notes). transformers' names are accepted as fallbacks. The vision tower of the 3.7 release
is skipped with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Mapping

import numpy as np
from gguf import GGUFValueType, Keys

from . import names, register
from .base import Checkpoint, MetaKV, Role
from .chained_mtp import (ChainedHParams, ChainedMtpPlugin, block_counts, chained_table, check_stated_count, head_copies,
                          kv_fields, norm_spec, routed_specs)
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import HParamsReader
from .metadata import MetadataWriter
from .plan_tools import RolePlan, text_model_name, trunk_indexed_mtp_count
from .tensor_table import Hook, TensorSpec, TensorTable

_TOWERS = ("vision_model.", "model.vision_model.", "vit_large_projector.", "model.multi_modal_projector.")
FULL, SWA = "full_attention", "sliding_attention"


def _squeeze_to(shape: tuple[int, ...], arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0].reshape(shape)


def plus_one(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] + np.float32(1.0)


def _per_layer(values, n: int, default) -> list:
    """A per-layer value (one for all, or a list) as n entries: a release may list only the trunk, the
    MTP blocks then get the default (llama.cpp pads)."""
    if values is None:
        return [default] * n
    if not isinstance(values, list):
        return [values] * n
    return (list(values) + [default] * (n - len(values)))[:n]


_norm = norm_spec(plus_one)  # every RMSNorm is Gemma-style: 1 + w
_ATTN = "{p}self_attn."
STEP35_TABLE = chained_table(
    _norm,
    head=(_norm("blk.{bid}.nextn.shared_head_norm.weight", "{p}transformer.shared_head.norm.weight", "nextn"),
          *head_copies(on_file=True)),
    attention=(
        TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.hidden_size)),
        TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.hidden_size)),
        TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.kv, s.hidden_size)),
        TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.hidden_size, s.q)),
        _norm("blk.{bid}.attn_q_norm.weight", _ATTN + "q_norm.weight", dim=lambda s: (s.head_dim,), optional=True),
        _norm("blk.{bid}.attn_k_norm.weight", _ATTN + "k_norm.weight", dim=lambda s: (s.head_dim,), optional=True),
        TensorSpec("blk.{bid}.attn_gate.weight", None, lambda s: (s.num_attention_heads, s.hidden_size), optional=True, hook="attn_gate"),
    ),
    ffn_norm=(_norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight"),),
    routed=routed_specs("{p}moe.gate.weight", "exp_probs_b.bias", "{p}moe.router_bias", experts_hf="{p}moe.",
                        shared_hf="{p}share_expert.", router_shapes=lambda s: [(s.num_experts, s.hidden_size), (s.num_experts, s.hidden_size, 1)],
                        router_transform=lambda s: partial(_squeeze_to, (s.num_experts, s.hidden_size))),
)


@dataclass(kw_only=True)
class Step35HParams(ChainedHParams):
    """Step-3.5's hyperparameters: head counts, layer types and SwiGLU limits per block (trunk and MTP);
    full-attention blocks rope half the head with rope_theta, sliding ones their rotary dims with
    swa_rope_theta. config.json's moe_router_scaling_factor and norm_expert_weight are the routing's
    routed_scaling_factor and norm_topk_prob, its share_expert_dim the shared_expert_intermediate_size."""

    num_attention_heads: list[int]
    num_key_value_heads: list[int]
    head_dim: int
    layer_types: list[str]  # FULL or SWA, per block
    sliding_window: int  # 0: no sliding-window block
    rope_theta: float  # full-attention blocks
    swa_rope_theta: float
    full_rotary_dim: int  # rope width of a full-attention block (half of GGUF's rope.dimension_count)
    swa_rotary_dim: int  # of a sliding-window block (rope.dimension_count_swa)
    leading_dense_block_count: int = 0  # blocks before the first routed one (config.json's moe_layers_enum)
    moe_every_n_layer: int = 1
    swiglu_limits: list[float] | None = None  # the routed experts' clamp per block (0: none); None: no clamps
    swiglu_limits_shared: list[float] | None = None  # the dense and shared SwiGLUs'

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SWA

    def expert_limit(self, i: int) -> float:
        return self.swiglu_limits[i] if self.swiglu_limits else 0.0

    def shared_limit(self, i: int) -> float:
        return self.swiglu_limits_shared[i] if self.swiglu_limits_shared else 0.0

    @classmethod
    def from_config(cls, checkpoint: Checkpoint) -> "Step35HParams":
        """config.json as the release writes it (transformers' names as fallbacks), with what the
        checkpoint's tensor names say: k MTP layers at model.layers.{N..}, the routed ones."""
        cfg = ConfigReader(checkpoint.config)
        tc = cfg.text_model()
        n = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        k = trunk_indexed_mtp_count(checkpoint, n)
        stated = tc.integer("num_nextn_predict_layers", "num_mtp_layers", default=None)
        check_stated_count(stated, k, f"model.layers.{n}..{n + k - 1}")
        total = n + k
        hidden_size, vocab_size = tc.integer("hidden_size", min=1), tc.integer("vocab_size", min=1)
        head_dim, intermediate_size = tc.integer("head_dim", min=1), tc.integer("intermediate_size")
        num_attention_heads = tc.integer("num_attention_heads", min=1)
        n_kv = tc.integer("num_attention_groups", "num_key_value_heads", min=1)
        other = tc.section("attention_other_setting")
        n_head_swa = other.integer("num_attention_heads",
                                   default=tc.integer("num_sliding_attention_heads", default=num_attention_heads, min=1), min=1)
        n_kv_swa = other.integer("num_attention_groups", default=n_kv, min=1)
        if other.integer("head_dim", default=head_dim) != head_dim:
            raise SpecconvError("config.json: attention_other_setting.head_dim differs from head_dim "
                                "(llama.cpp's step35 has one head size)")
        layer_types = _per_layer(tc.strings("layer_types", default=None), total, FULL)
        if set(layer_types) - {FULL, SWA}:
            raise SpecconvError(f"config.json: layer_types may only hold {FULL} / {SWA}")
        factors = _per_layer(tc.per_layer("partial_rotary_factors", "number"), total, None)
        for i, (t, f) in enumerate(zip(layer_types, factors)):
            want = 1.0 if t == SWA else 0.5
            if f is not None and f != want:
                raise SpecconvError(f"config.json: partial_rotary_factors[{i}] = {f}; llama.cpp's step35 rotates "
                                    f"{'all' if t == SWA else 'half'} of the head on {t} layers ({want})")
        heads = [n_head_swa if t == SWA else num_attention_heads for t in layer_types]
        kv_heads = [n_kv_swa if t == SWA else n_kv for t in layer_types]
        for i, (h, kv) in enumerate(zip(heads, kv_heads)):
            if h % kv:
                raise SpecconvError(f"config.json: layer {i} has {h} heads, not a multiple of {kv} KV heads")
        sliding_window = tc.integer("sliding_window") if SWA in layer_types else tc.integer("sliding_window", default=0)
        rope_theta, swa_rope_theta = _rope_bases(tc, layer_types)
        scalar = tc.number("query_pre_attn_scalar", default=None)
        if scalar is not None and scalar != float(head_dim):
            raise SpecconvError("config.json: query_pre_attn_scalar ≠ head_dim (llama.cpp scales by head_dim^-1/2)")
        if tc.flag("use_bidirectional_attention", default=False):
            raise SpecconvError("config.json: use_bidirectional_attention is not supported (causal decoding)")
        experts = dict(num_experts=tc.integer("moe_num_experts", "n_routed_experts", "num_local_experts", min=1),
                       num_experts_per_tok=tc.integer("moe_top_k", "num_experts_per_tok", min=1),
                       moe_intermediate_size=tc.integer("moe_intermediate_size"),
                       shared_expert_intermediate_size=tc.integer("share_expert_dim", "share_expert_dims"))
        moe_layers = frozenset(i for i in range(total) if f"model.layers.{i}.moe.gate.weight" in checkpoint.tensors)
        leading_dense = _leading_dense(tc, n, moe_layers)
        rms_norm_eps = tc.number("rms_norm_eps", default=1e-5)
        limits = dict(swiglu_limits=_clamps(tc, "swiglu_limits", total),
                      swiglu_limits_shared=_clamps(tc, "swiglu_limits_shared", total))
        tied = cfg.flag("tie_word_embeddings", default=tc.flag("tie_word_embeddings", default=False))
        kind = tc.section("rope_scaling").string("rope_type", "type", default=None)
        if kind not in (None, "default"):
            raise SpecconvError(f"config.json: rope scaling {kind!r} is not supported for step35 yet (default rope only)")
        return cls(arch=names.STEP35, num_hidden_layers=n, num_nextn_predict_layers=k, mtp_layers_in_config=stated,
                   hidden_size=hidden_size, vocab_size=vocab_size, intermediate_size=intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   layer_types=layer_types, sliding_window=sliding_window, rope_theta=rope_theta,
                   swa_rope_theta=swa_rope_theta, full_rotary_dim=head_dim // 2, swa_rotary_dim=head_dim,
                   moe_layers=moe_layers, leading_dense_block_count=leading_dense, rms_norm_eps=rms_norm_eps,
                   tie_word_embeddings=tied, **experts, **limits,
                   max_position_embeddings=tc.integer("max_position_embeddings", default=4096, min=1),
                   routed_scaling_factor=tc.number("moe_router_scaling_factor", default=1.0),
                   norm_topk_prob=tc.flag("norm_expert_weight", default=True),
                   moe_every_n_layer=tc.integer("moe_every_n_layer", default=1))

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "Step35HParams":
        """GGUF metadata (head counts per block, as llama.cpp's get_key_or_arr reads them); the FFN
        widths are each block's tensors' (ChainedHParams)."""
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        total = sum(block_counts(r))
        head_dim = key("attention.key_length", type=int)
        if key("attention.value_length", head_dim, int) != head_dim:
            raise SpecconvError(f"{arch}: attention.key_length != value_length")
        heads, kv_heads = r.per_layer("attention.head_count", total), r.per_layer("attention.head_count_kv", total)
        for i, (h, k) in enumerate(zip(heads, kv_heads)):
            if h % k:
                raise SpecconvError(f"{arch}: block {i} has {h} heads, not a multiple of {k} KV heads")
        rotary_dim, base = key("rope.dimension_count", head_dim, int), key("rope.freq_base", 10000.0, float)
        swa = r.per_layer("attention.sliding_window_pattern", total, False, bool)
        limits = {field: r.per_layer(name, total, type=float) if r.has(name) else None
                  for field, name in (("swiglu_limits", "swiglu_clamp_exp"), ("swiglu_limits_shared", "swiglu_clamp_shexp"))}
        return cls(**kv_fields(r), head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                   layer_types=[SWA if s else FULL for s in swa], sliding_window=key("attention.sliding_window", 0, int),
                   full_rotary_dim=rotary_dim // 2,  # llama.cpp: full-attention blocks rotate half the rope dims
                   swa_rotary_dim=key("rope.dimension_count_swa", rotary_dim, int), rope_theta=base,
                   swa_rope_theta=key("rope.freq_base_swa", base, float),
                   leading_dense_block_count=key("leading_dense_block_count", 0, int),
                   moe_every_n_layer=key("moe_every_n_layers", 1, int),
                   routed_scaling_factor=key("expert_weights_scale", 1.0, float) or 1.0,
                   norm_topk_prob=key("expert_weights_norm", False, bool), **limits)


def _leading_dense(tc: ConfigReader, n: int, moe_layers: frozenset[int]) -> int:
    """The dense blocks before the first routed one, as moe_layers_enum states them (checked against
    the checkpoint's routers); 0 when it states none."""
    enum = tc.string("moe_layers_enum", default="")
    if not enum.strip():
        return 0
    try:
        stated = {int(x) for x in enum.split(",") if x.strip()}
    except ValueError:
        raise tc.error("moe_layers_enum", f"= {enum!r} is not comma-separated layer numbers") from None
    wrong = [i for i in range(n) if (i in stated) != (i in moe_layers)]
    if wrong:
        raise SpecconvError(f"config.json moe_layers_enum disagrees with the checkpoint at layer {wrong[0]}")
    return max(0, min(stated))


def _clamps(tc: ConfigReader, key: str, total: int) -> list[float] | None:
    values = tc.per_layer(key, "number")
    if values is None:
        return None
    return [0.0 if v is None else v for v in _per_layer(values, total, 0.0)]


def _rope_bases(tc: ConfigReader, layer_types: list[str]) -> tuple[float, float]:
    """(full, sliding) rope theta: a list gives each layer its own (the first layer of each type, as
    transformers reads it); llama.cpp's converter takes entries 0 and 1, the same for the releases
    (layer 0 full, layer 1 sliding)."""
    theta = tc.per_layer("rope_theta", "number")
    params = tc.section("rope_parameters")
    if theta is None and params.data:
        if params.has(FULL):
            full = params.section(FULL).number("rope_theta")
            return full, params.section(SWA if params.has(SWA) else FULL).number("rope_theta")
        theta = params.number("rope_theta", default=None)
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, list):
        return theta, theta
    if not theta or None in theta:
        raise tc.error("rope_theta", "must hold a number for every layer")
    first = lambda t: next((theta[i] for i, x in enumerate(layer_types) if x == t and i < len(theta)),  # noqa: E731
                           theta[0])
    return first(FULL), first(SWA)


@register
class Step35(ChainedMtpPlugin):
    hf_architectures = ("Step3p5ForCausalLM", "Step3p7ForConditionalGeneration")
    family: ClassVar[str] = "step35"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "deepseek-v3"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.hp = Step35HParams.from_config(checkpoint)
        self.missing_mtp = self.hp.missing_mtp(f"model.layers.{self.hp.num_hidden_layers}.*")

    @property
    def gguf_arch(self) -> str:
        return names.STEP35

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        return text_model_name(raw_name, _TOWERS, "vision tower (belongs in a separate mmproj file)")

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = STEP35_TABLE

    def hooks(self) -> dict[str, Hook]:
        return {"head_copies": self._head_copies, "attn_gate": self._attn_gate}

    def _head_copies(self, plan: RolePlan, s: Step35HParams, bid: int, p: str, role: Role) -> None:
        for hf, part in (("transformer.shared_head.output", names.NEXTN_SHARED_HEAD_HEAD),
                         ("embed_tokens", names.NEXTN_EMBED_TOKENS)):
            if plan.has(f"{p}{hf}.weight"):  # llama.cpp prefers a block's own copies when present
                plan.add(names.nextn(bid, part), [plan.source(f"{p}{hf}.weight", (s.vocab_dim, s.hidden_size))], (s.vocab_dim, s.hidden_size), role)

    def _attn_gate(self, plan: RolePlan, s: Step35HParams, bid: int, p: str, role: Role) -> None:
        a = p + "self_attn."
        if plan.has(a + "g_proj.weight"):  # head-wise gate: one row per head (llama.cpp has no per-element gate)
            shape = (s.num_attention_heads, s.hidden_size)
            src = plan.source(a + "g_proj.weight", [shape, shape + (1,)])
            plan.add(names.blk(bid, "attn_gate"), [src], shape, role, partial(_squeeze_to, shape))

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """In the order of llama.cpp's converter (TextModel's keys, where Step35Model's later
        writes of the same key keep their first place, then Step35Model's own)."""
        i32 = GGUFValueType.INT32  # integer arrays as llama.cpp's converter writes them (Python ints)
        hp, k = self.hp, self.hp.num_nextn_predict_layers if keep_mtp else 0
        n = hp.num_hidden_layers
        total = n + ((hp.mtp_layers_in_config or 0) if keep_mtp else 0)  # llama.cpp sizes its arrays by the stated count
        types = _per_layer(hp.layer_types, total, FULL)
        heads, kv_heads = hp.num_attention_heads, hp.num_key_value_heads
        w = MetadataWriter(self.gguf_arch)
        # head_count_kv comes later here (Step35Model's own write)
        w.text_model(n + k, hp.max_position_embeddings, hp.hidden_size, hp.intermediate_size,
                     heads[:total] + [heads[-1]] * (total - len(heads)), None, array_type=i32)
        w.f32(Keys.Rope.FREQ_BASE, hp.rope_theta)
        if SWA in hp.layer_types:
            w.f32(Keys.Rope.FREQ_BASE_SWA, hp.swa_rope_theta)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, hp.rms_norm_eps)
        w.head_sizes(hp.head_dim)
        w.count(Keys.Attention.HEAD_COUNT_KV, kv_heads[:total] + [kv_heads[-1]] * (total - len(kv_heads)), i32)
        w.u32(Keys.Attention.SLIDING_WINDOW, hp.sliding_window)
        w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, [t == SWA for t in types], GGUFValueType.BOOL)
        w.experts(hp.num_experts, hp.num_experts_per_tok)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.moe_intermediate_size)
        w.u32(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, hp.shared_expert_intermediate_size)
        w.f32(Keys.LLM.EXPERT_WEIGHTS_SCALE, hp.routed_scaling_factor)
        # transformers and vLLM always renormalise the top-k weights; llama.cpp defaults to false
        # when the key is absent, so it is always written
        w.flag(Keys.LLM.EXPERT_WEIGHTS_NORM, hp.norm_topk_prob)
        w.u32(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, hp.leading_dense_block_count)
        w.u32(Keys.LLM.MOE_EVERY_N_LAYERS, hp.moe_every_n_layer)
        for key, values in (("swiglu_clamp_exp", hp.swiglu_limits), ("swiglu_clamp_shexp", hp.swiglu_limits_shared)):
            if values is not None:
                w.array("{arch}." + key, (values + [0.0] * total)[:total], GGUFValueType.FLOAT32)
        w.nextn(k)
        return w.kv
