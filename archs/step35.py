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

from functools import partial
from typing import ClassVar

import numpy as np
from gguf import GGUFValueType, Keys

from . import names, register
from .base import Checkpoint, MetaKV, Role
from .chained_mtp import ChainedMtpPlugin, Sizes, chained_table, check_stated_count, head_copies, norm_spec, routed_specs
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
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
        TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.E)),
        TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.E)),
        TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.kv, s.E)),
        TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.E, s.q)),
        _norm("blk.{bid}.attn_q_norm.weight", _ATTN + "q_norm.weight", dim=lambda s: (s.head_dim,), optional=True),
        _norm("blk.{bid}.attn_k_norm.weight", _ATTN + "k_norm.weight", dim=lambda s: (s.head_dim,), optional=True),
        TensorSpec("blk.{bid}.attn_gate.weight", None, lambda s: (s.num_attention_heads, s.E), optional=True, hook="attn_gate"),
    ),
    ffn_norm=(_norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight"),),
    routed=routed_specs("{p}moe.gate.weight", "exp_probs_b.bias", "{p}moe.router_bias", experts_hf="{p}moe.",
                        shared_hf="{p}share_expert.", router_shapes=lambda s: [(s.num_experts, s.E), (s.num_experts, s.E, 1)],
                        router_transform=lambda s: partial(_squeeze_to, (s.num_experts, s.E))),
)


@register
class Step35(ChainedMtpPlugin):
    hf_architectures = ("Step3p5ForCausalLM", "Step3p7ForConditionalGeneration")
    gguf_arch: ClassVar[str] = names.STEP35
    family: ClassVar[str] = "step35"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "deepseek-v3"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        cfg = ConfigReader(checkpoint.config)
        tc = cfg.text_model()
        self.n = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        self.k = trunk_indexed_mtp_count(checkpoint, self.n)
        configured = tc.integer("num_nextn_predict_layers", "num_mtp_layers", default=None)
        check_stated_count(self, configured, self.k, f"model.layers.{self.n}..{self.n + self.k - 1}",
                           f"model.layers.{self.n}.*")
        self.n_meta = configured or 0  # llama.cpp sizes its per-layer arrays by N + the stated count
        total = self.n + self.k
        self.hidden, self.vocab = tc.integer("hidden_size", min=1), tc.integer("vocab_size", min=1)
        self.head_dim = tc.integer("head_dim", min=1)
        self.ffn = tc.integer("intermediate_size")
        num_attention_heads = tc.integer("num_attention_heads", min=1)
        n_kv = tc.integer("num_attention_groups", "num_key_value_heads", min=1)
        other = tc.section("attention_other_setting")
        n_head_swa = other.integer("num_attention_heads",
                                   default=tc.integer("num_sliding_attention_heads", default=num_attention_heads, min=1), min=1)
        n_kv_swa = other.integer("num_attention_groups", default=n_kv, min=1)
        if other.integer("head_dim", default=self.head_dim) != self.head_dim:
            raise SpecconvError("config.json: attention_other_setting.head_dim differs from head_dim "
                                "(llama.cpp's step35 has one head size)")
        self.layer_types = _per_layer(tc.strings("layer_types", default=None), total, FULL)
        if set(self.layer_types) - {FULL, SWA}:
            raise SpecconvError(f"config.json: layer_types may only hold {FULL} / {SWA}")
        factors = _per_layer(tc.per_layer("partial_rotary_factors", "number"), total, None)
        for i, (t, f) in enumerate(zip(self.layer_types, factors)):
            want = 1.0 if t == SWA else 0.5
            if f is not None and f != want:
                raise SpecconvError(f"config.json: partial_rotary_factors[{i}] = {f}; llama.cpp's step35 rotates "
                                    f"{'all' if t == SWA else 'half'} of the head on {t} layers ({want})")
        self.n_heads = [n_head_swa if t == SWA else num_attention_heads for t in self.layer_types]
        self.n_kvs = [n_kv_swa if t == SWA else n_kv for t in self.layer_types]
        for i, (h, kv) in enumerate(zip(self.n_heads, self.n_kvs)):
            if h % kv:
                raise SpecconvError(f"config.json: layer {i} has {h} heads, not a multiple of {kv} KV heads")
        self.sliding_window = (tc.integer("sliding_window") if SWA in self.layer_types
                               else tc.integer("sliding_window", default=0))
        self.rope_full, self.rope_swa = self._rope_bases(tc)
        scalar = tc.number("query_pre_attn_scalar", default=None)
        if scalar is not None and scalar != float(self.head_dim):
            raise SpecconvError("config.json: query_pre_attn_scalar ≠ head_dim (llama.cpp scales by head_dim^-1/2)")
        if tc.flag("use_bidirectional_attention", default=False):
            raise SpecconvError("config.json: use_bidirectional_attention is not supported (causal decoding)")
        self.num_experts = tc.integer("moe_num_experts", "n_routed_experts", "num_local_experts", min=1)
        self.num_experts_per_tok = tc.integer("moe_top_k", "num_experts_per_tok", min=1)
        self.expert_ffn = tc.integer("moe_intermediate_size")
        self.shared_ffn = tc.integer("share_expert_dim", "share_expert_dims")
        self.moe_layers = {i for i in range(total) if f"model.layers.{i}.moe.gate.weight" in checkpoint.tensors}
        enum = tc.string("moe_layers_enum", default="")
        if enum.strip():
            try:
                stated = {int(x) for x in enum.split(",") if x.strip()}
            except ValueError:
                raise tc.error("moe_layers_enum", f"= {enum!r} is not comma-separated layer numbers") from None
            wrong = [i for i in range(self.n) if (i in stated) != (i in self.moe_layers)]
            if wrong:
                raise SpecconvError(f"config.json moe_layers_enum disagrees with the checkpoint at layer {wrong[0]}")
            self.leading_dense = max(0, min(stated))
        else:
            self.leading_dense = 0
        self.rms_eps = tc.number("rms_norm_eps", default=1e-5)
        self.clamp = self._clamps(tc, "swiglu_limits", total)
        self.clamp_shared = self._clamps(tc, "swiglu_limits_shared", total)
        self.tied = cfg.flag("tie_word_embeddings", default=tc.flag("tie_word_embeddings", default=False))
        rope = tc.section("rope_scaling")
        kind = rope.string("rope_type", "type", default=None)
        if kind not in (None, "default"):
            raise SpecconvError(f"config.json: rope scaling {kind!r} is not supported for step35 yet (default rope only)")
        self.context_length = tc.integer("max_position_embeddings", default=4096, min=1)
        self.moe_scale = tc.number("moe_router_scaling_factor", default=1.0)
        self.norm_expert_weight = tc.flag("norm_expert_weight", default=True)
        self.moe_every = tc.integer("moe_every_n_layer", default=1)

    @staticmethod
    def _clamps(tc: ConfigReader, key: str, total: int) -> list[float] | None:
        values = tc.per_layer(key, "number")
        if values is None:
            return None
        return [0.0 if v is None else v for v in _per_layer(values, total, 0.0)]

    def _rope_bases(self, tc: ConfigReader) -> tuple[float, float]:
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
        first = lambda t: next((theta[i] for i, x in enumerate(self.layer_types) if x == t and i < len(theta)),  # noqa: E731
                               theta[0])
        return first(FULL), first(SWA)

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        return text_model_name(raw_name, _TOWERS, "vision tower (belongs in a separate mmproj file)")

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = STEP35_TABLE

    def sizes(self) -> Sizes:
        return Sizes(num_hidden_layers=self.n, E=self.hidden, V=self.vocab, heads=tuple(self.n_heads), kv_heads=tuple(self.n_kvs),
                     head_dim=self.head_dim, moe_layers=frozenset(self.moe_layers), ffn=self.ffn,
                     num_experts=self.num_experts, expert_ffn=self.expert_ffn, shared_ffn=self.shared_ffn)

    def hooks(self) -> dict[str, Hook]:
        return {"head_copies": self._head_copies, "attn_gate": self._attn_gate}

    def _head_copies(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        for hf, part in (("transformer.shared_head.output", names.NEXTN_SHARED_HEAD_HEAD),
                         ("embed_tokens", names.NEXTN_EMBED_TOKENS)):
            if plan.has(f"{p}{hf}.weight"):  # llama.cpp prefers a block's own copies when present
                plan.add(names.nextn(bid, part), [plan.source(f"{p}{hf}.weight", (s.V, s.E))], (s.V, s.E), role)

    def _attn_gate(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        a = p + "self_attn."
        if plan.has(a + "g_proj.weight"):  # head-wise gate: one row per head (llama.cpp has no per-element gate)
            shape = (s.num_attention_heads, s.E)
            src = plan.source(a + "g_proj.weight", [shape, shape + (1,)])
            plan.add(names.blk(bid, "attn_gate"), [src], shape, role, partial(_squeeze_to, shape))

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """In the order of llama.cpp's converter (TextModel's keys, where Step35Model's later
        writes of the same key keep their first place, then Step35Model's own)."""
        i32 = GGUFValueType.INT32  # integer arrays as llama.cpp's converter writes them (Python ints)
        total = self.n + (self.n_meta if keep_mtp else 0)
        types = _per_layer(self.layer_types, total, FULL)
        w = MetadataWriter(self.gguf_arch)
        # head_count_kv comes later here (Step35Model's own write)
        w.text_model(self.n + (self.k if keep_mtp else 0), self.context_length, self.hidden, self.ffn,
                     self.n_heads[:total] + [self.n_heads[-1]] * (total - len(self.n_heads)), None, array_type=i32)
        w.f32(Keys.Rope.FREQ_BASE, self.rope_full)
        if SWA in self.layer_types:
            w.f32(Keys.Rope.FREQ_BASE_SWA, self.rope_swa)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, self.rms_eps)
        w.head_sizes(self.head_dim)
        w.count(Keys.Attention.HEAD_COUNT_KV, self.n_kvs[:total] + [self.n_kvs[-1]] * (total - len(self.n_kvs)), i32)
        w.u32(Keys.Attention.SLIDING_WINDOW, self.sliding_window)
        w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, [t == SWA for t in types], GGUFValueType.BOOL)
        w.experts(self.num_experts, self.num_experts_per_tok)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, self.expert_ffn)
        w.u32(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, self.shared_ffn)
        w.f32(Keys.LLM.EXPERT_WEIGHTS_SCALE, self.moe_scale)
        # transformers and vLLM always renormalise the top-k weights; llama.cpp defaults to false
        # when the key is absent, so it is always written
        w.flag(Keys.LLM.EXPERT_WEIGHTS_NORM, self.norm_expert_weight)
        w.u32(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, self.leading_dense)
        w.u32(Keys.LLM.MOE_EVERY_N_LAYERS, self.moe_every)
        for key, values in (("swiglu_clamp_exp", self.clamp), ("swiglu_clamp_shexp", self.clamp_shared)):
            if values is not None:
                w.array("{arch}." + key, (values + [0.0] * total)[:total], GGUFValueType.FLOAT32)
        w.nextn(self.k if keep_mtp else 0)
        return w.kv


