"""Step-3.5 / Step-3.7 hyperparameters: `Step35HParams`, read from config.json by the plugin
(archs/step35.py) and from GGUF metadata by the graph (runtime/graphs/step35.py), checked once.

config.json is read as the release writes it (`num_attention_groups`, `attention_other_setting`,
`moe_num_experts`, `moe_top_k`, `moe_layers_enum`, `rope_theta` / `partial_rotary_factors` lists of
N+k entries, ...), transformers' names as fallbacks. Per-block fields cover the trunk and the k MTP
blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from . import names
from .base import Checkpoint
from .chained_mtp import ChainedHParams, check_stated_count, kv_fields
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import HParamsReader
from .plan_tools import trunk_indexed_mtp_count

FULL, SWA = "full_attention", "sliding_attention"


def per_layer(values, n: int, default) -> list:
    """A per-layer value (one for all, or a list) as n entries: a release may list only the trunk, the
    MTP blocks then get the default (llama.cpp pads)."""
    if values is None:
        return [default] * n
    if not isinstance(values, list):
        return [values] * n
    return (list(values) + [default] * (n - len(values)))[:n]


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
        layer_types = per_layer(tc.strings("layer_types", default=None), total, FULL)
        if set(layer_types) - {FULL, SWA}:
            raise SpecconvError(f"config.json: layer_types may only hold {FULL} / {SWA}")
        factors = per_layer(tc.per_layer("partial_rotary_factors", "number"), total, None)
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
        total = sum(r.block_counts())
        head_dim = key("attention.key_length", type=int)
        r.check_value_length(head_dim)
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
    return [0.0 if v is None else v for v in per_layer(values, total, 0.0)]


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
