"""Xiaomi MiMo-V2-Flash (`MiMoV2FlashForCausalLM`) -> GGUF arch `mimo2` (llama.cpp 0c1e570,
src/models/mimo2.cpp).

Full-attention and sliding-window layers (`hybrid_layer_pattern`; the sliding ones with their own KV
head count and per-head attention sinks), value heads narrower than query/key heads, partial NEOX
rope with separate bases, a constant `attention_value_scale` on the attention output, a dense first
layer then sigmoid-routed, group-limited MoE without shared experts, and k MTP blocks under
`model.mtp.layers.{0..k-1}` (eh_proj / enorm / hnorm, a sliding-window decoder block with a dense
MLP, `final_layernorm` -> `layer_output_norm`), written as blocks N..N+k-1.

Where this differs from llama.cpp's converter, on purpose (docs/archs.md §mimo2):
* the MTP blocks' attention is written fused (`attn_qkv` = [Q; K; V] rows): llama.cpp's mimo2 MTP
  graph asserts `MIMO2 MTP requires fused attn_qkv`, and its converter writes them split (its
  `--fuse-qkv` skips `model.mtp.*`), so its own files cannot build an MTP context;
* `attention.sliding_window` = `sliding_window_size + 1`, the window transformers (and SGLang's
  reference) attend over; llama.cpp's converter writes `sliding_window`, one token narrower;
* k is counted from the `model.mtp.layers.*` names (the config states none; llama.cpp assumes 3).
config.json is read as the release writes it: transformers 5.23's MiMoV2FlashConfig does not read
`hybrid_layer_pattern`, `rope_theta` / `swa_rope_theta` or `partial_rotary_factor`.
"""

from __future__ import annotations

import re
from typing import ClassVar

import numpy as np
from gguf import GGUFValueType, Keys

from . import names, register
from . import transforms as tf
from .base import Checkpoint, MetaKV, Role
from .chained_mtp import ChainedMtpPlugin, Sizes, chained_table, check_stated_count, head_copies, norm_spec, routed_specs
from .config_reader import MAX_LAYERS, ConfigReader
from .errors import SpecconvError
from .plan_tools import RolePlan, plan_experts, text_model_name
from .tensor_table import Hook, TensorSpec, TensorTable

_MTP = re.compile(r"^model\.mtp\.layers\.(\d+)\.(.+)$")
_TOWERS = ("visual.", "model.visual.", "audio_tokenizer.", "model.audio_tokenizer.", "speech_embeddings.")


def concat_rows(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays, axis=0)


_norm = norm_spec()
_ATTN = "{p}self_attn."
MIMO2_TABLE = chained_table(
    _norm,
    head=(_norm("blk.{bid}.layer_output_norm.weight", "{p}final_layernorm.weight", "nextn", optional=True),
          TensorSpec("blk.{bid}.nextn.shared_head_norm.weight", None, lambda s: (s.E,), "nextn", optional=True,
                     f32=True), *head_copies()),  # other converters' head ends
    attention=(
        TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.E), "split_qkv",
                   optional=True),
        TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.E), "split_qkv",
                   optional=True),
        TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.v, s.E), "split_qkv",
                   optional=True),
        TensorSpec("blk.{bid}.attn_qkv.weight", None, lambda s: (s.q + s.kv + s.v, s.E), "fused_qkv", optional=True,
                   hook="fused_qkv"),
        TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.E, s.o)),
        TensorSpec("blk.{bid}.attn_sinks.weight", None, lambda s: (s.n_head,), optional=True, f32=True, hook="sinks"),
    ),
    ffn_norm=(_norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight", "trunk"),
              _norm("blk.{bid}.ffn_norm.weight", "{p}pre_mlp_layernorm.weight", "nextn")),
    routed=routed_specs("{p}mlp.gate.weight", "exp_probs_b.bias", "{p}mlp.gate.e_score_correction_bias"),
)


@register
class MiMo2(ChainedMtpPlugin):
    hf_architectures = ("MiMoV2FlashForCausalLM",)
    family: ClassVar[str] = "mimo2"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "qwen2"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        cfg = ConfigReader(checkpoint.config)
        tc = self.tc = cfg.text_model()
        self.n = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        seen = {int(m.group(1)) for m in map(_MTP.match, checkpoint.tensors) if m}
        self.k = max(seen) + 1 if seen else 0
        if seen and sorted(seen) != list(range(self.k)):
            raise SpecconvError(f"checkpoint holds MTP layers model.mtp.layers.{sorted(seen)}, not 0..{self.k - 1}")
        check_stated_count(self, tc.integer("num_nextn_predict_layers", default=None), self.k, "model.mtp.layers.*")
        self.hidden, self.vocab = tc.integer("hidden_size", min=1), tc.integer("vocab_size", min=1)
        self.ffn = tc.integer("intermediate_size")
        self.n_head = tc.integer("num_attention_heads", min=1)
        self.n_kv = tc.integer("num_key_value_heads", min=1)
        self.n_kv_swa = tc.integer("swa_num_key_value_heads", default=2 * self.n_kv, min=1)  # transformers' rule: twice
        self.hd, self.vhd = tc.integer("head_dim", min=1), tc.integer("v_head_dim", min=1)
        for key, want in (("swa_num_attention_heads", self.n_head), ("swa_head_dim", self.hd),
                          ("swa_v_head_dim", self.vhd)):
            got = tc.integer(key, default=want)
            if got != want:
                raise SpecconvError(f"config.json: {key} = {got} differs from the full layers' {want} "
                                    f"(llama.cpp's mimo2 has one value for both)")
        if self.n_head % self.n_kv or self.n_head % self.n_kv_swa:
            raise SpecconvError(f"config.json: {self.n_head} heads are not a multiple of {self.n_kv} / "
                                f"{self.n_kv_swa} KV heads")
        pattern = tc.integers("hybrid_layer_pattern", default=None)
        if pattern is None and tc.has("layer_types"):
            pattern = [int(t == "sliding_attention") for t in tc.strings("layer_types")]
        if pattern is None or len(pattern) < self.n:
            raise SpecconvError("config.json: hybrid_layer_pattern must list the N trunk layers (1 = sliding window)")
        self.swa = [int(bool(x)) for x in pattern[:self.n]]
        window = tc.integer("sliding_window_size", default=None)
        self.window = window + 1 if window is not None else tc.integer("sliding_window")
        # transformers' form (rope_parameters per layer type) when the release's fields are absent
        rp = tc.section("rope_parameters")
        full, swa = rp.section("full_attention"), rp.section("sliding_attention")
        self.rope_base = tc.number("rope_theta", default=full.number("rope_theta", default=10000.0))
        self.rope_base_swa = tc.number("swa_rope_theta", default=swa.number("rope_theta", default=self.rope_base))
        self.rope_dim = int(self.hd * tc.number("partial_rotary_factor",
                                                default=full.number("partial_rotary_factor", default=1.0)))
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.hd:
            raise SpecconvError(f"rotary dimension {self.rope_dim} (head_dim * partial_rotary_factor) must be even "
                                f"and within the head")
        self.v_scale = tc.number("attention_value_scale", default=None)
        self.n_expert = tc.integer("n_routed_experts", "num_local_experts", min=1)
        self.n_expert_used = tc.integer("num_experts_per_tok", min=1)
        self.expert_ffn = tc.integer("moe_intermediate_size")
        if tc.string("scoring_func", default="sigmoid") != "sigmoid":
            raise SpecconvError("config.json: scoring_func must be sigmoid (llama.cpp's mimo2 router is)")
        if not tc.flag("norm_topk_prob", default=True):
            raise SpecconvError("config.json: norm_topk_prob=false is not supported (llama.cpp's mimo2 renormalises)")
        if (tc.number("routed_scaling_factor", default=1.0) or 1.0) != 1.0:
            raise SpecconvError("config.json: routed_scaling_factor ≠ 1 is not supported (llama.cpp's mimo2 "
                                "does not scale the routing weights)")
        self.moe_layers = {i for i in range(self.n) if f"model.layers.{i}.mlp.gate.weight" in checkpoint.tensors}
        freq = tc.per_layer("moe_layer_freq", "integer")  # a list of 0 / 1 per layer (a number: no pattern)
        if isinstance(freq, list) and len(freq) >= self.n:
            wrong = [i for i in range(self.n) if bool(freq[i]) != (i in self.moe_layers)]
            if wrong:
                raise SpecconvError(f"config.json moe_layer_freq disagrees with the checkpoint at layer {wrong[0]}")
        self.eps = tc.number("layernorm_epsilon", "rms_norm_eps", default=1e-5)
        self.tied = cfg.flag("tie_word_embeddings", default=tc.flag("tie_word_embeddings", default=False))
        if tc.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported for mimo2")
        self.context_length = tc.integer("max_position_embeddings", default=4096, min=1)
        self.n_group = tc.integer("n_group", default=None)
        self.topk_group = tc.integer("topk_group", default=None)

    @property
    def gguf_arch(self) -> str:
        return names.MIMO2

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        return text_model_name(raw_name, _TOWERS, "vision / audio tower (belongs in a separate mmproj file)")

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = MIMO2_TABLE

    def sizes(self) -> Sizes:
        total = self.n + self.k
        # the MTP blocks are sliding-window blocks (vLLM's MiMoV2MTPLayer)
        kv_heads = tuple(self.n_kv_swa if i >= self.n or self.swa[i] else self.n_kv for i in range(total))
        return Sizes(n_layer=self.n, E=self.hidden, V=self.vocab, heads=(self.n_head,) * total, kv_heads=kv_heads,
                     head_dim=self.hd, v_head_dim=self.vhd, moe_layers=frozenset(self.moe_layers), ffn=self.ffn,
                     n_expert=self.n_expert, expert_ffn=self.expert_ffn)

    def hooks(self) -> dict[str, Hook]:
        return {"experts": self._experts, "fused_qkv": self._fused_qkv, "sinks": self._sinks}

    def _prefix(self, i: int) -> str:
        return f"model.mtp.layers.{i - self.n}." if i >= self.n else f"model.layers.{i}."

    def _fused_qkv(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        a = p + "self_attn."
        srcs = [plan.source(a + "q_proj.weight", (s.q, s.E)), plan.source(a + "k_proj.weight", (s.kv, s.E)),
                plan.source(a + "v_proj.weight", (s.v, s.E))]
        plan.add(names.blk(bid, "attn_qkv"), srcs, (s.q + s.kv + s.v, s.E), role, concat_rows)

    def _sinks(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        a = p + "self_attn."
        if plan.has(a + "attention_sink_bias"):
            plan.add(names.blk(bid, "attn_sinks"), [plan.source(a + "attention_sink_bias", (s.n_head,))],
                     (s.n_head,), role, tf.identity, True)

    def _experts(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        m = p + "mlp."
        plan_experts(plan, bid, m + "experts.", s.n_expert, s.expert_ffn, s.E, role, where=f"layer {bid} ({m}experts)",
                     count_field="n_routed_experts")

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """In the order of llama.cpp's converter (TextModel's keys, where MimoV2Model's later writes of
        the same key keep their first place, then MimoV2Model's own); integer arrays as it writes them."""
        u32, i32, f32 = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32
        arr = GGUFValueType.ARRAY
        k = self.k if keep_mtp else 0
        pattern = self.swa + [1] * k
        kv: list[MetaKV] = []
        put = self._putter(kv)

        put(Keys.LLM.BLOCK_COUNT, self.n + k, u32)
        put(Keys.LLM.CONTEXT_LENGTH, self.context_length, u32)
        put(Keys.LLM.EMBEDDING_LENGTH, self.hidden, u32)
        put(Keys.LLM.FEED_FORWARD_LENGTH, self.ffn, u32)
        put(Keys.Attention.HEAD_COUNT, self.n_head, u32)
        put(Keys.Attention.HEAD_COUNT_KV, [self.n_kv_swa if s else self.n_kv for s in pattern], arr, i32)
        put(Keys.Rope.FREQ_BASE, self.rope_base, f32)
        put(Keys.Rope.FREQ_BASE_SWA, self.rope_base_swa, f32)
        put(Keys.LLM.EXPERT_COUNT, self.n_expert, u32)
        put(Keys.LLM.EXPERT_USED_COUNT, self.n_expert_used, u32)
        if self.n_group is not None:
            put(Keys.LLM.EXPERT_GROUP_COUNT, self.n_group, u32)
        if self.topk_group is not None:
            put(Keys.LLM.EXPERT_GROUP_USED_COUNT, self.topk_group, u32)
        put(Keys.LLM.EXPERT_GATING_FUNC, names.EXPERT_GATING_SIGMOID, u32)
        put(Keys.Attention.KEY_LENGTH, self.hd, u32)
        put(Keys.Attention.VALUE_LENGTH, self.vhd, u32)
        put(Keys.Attention.SLIDING_WINDOW, self.window, u32)
        put(Keys.Attention.SLIDING_WINDOW_PATTERN, pattern, arr, i32)
        put(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, self.expert_ffn, u32)
        put(Keys.Rope.DIMENSION_COUNT, self.rope_dim, u32)
        put(Keys.Attention.LAYERNORM_RMS_EPS, self.eps, f32)
        if self.v_scale is not None:
            put("{arch}.attention.value_scale", self.v_scale, f32)
        if k:
            put(Keys.LLM.NEXTN_PREDICT_LAYERS, k, u32)
        return kv
