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
from .chained_mtp import ChainedMtpPlugin, check_stated_count
from .config_reader import MAX_LAYERS, ConfigReader
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import RolePlan, plan_experts, text_model_name

_MTP = re.compile(r"^model\.mtp\.layers\.(\d+)\.(.+)$")
_TOWERS = ("visual.", "model.visual.", "audio_tokenizer.", "model.audio_tokenizer.", "speech_embeddings.")


def concat_rows(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays, axis=0)


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

    def _prefix(self, i: int) -> str:
        return f"model.mtp.layers.{i - self.n}." if i >= self.n else f"model.layers.{i}."

    def _ffn_norm_source(self, i: int) -> str:
        return "pre_mlp_layernorm" if i >= self.n else "post_attention_layernorm"

    def _mtp_head(self, plan: RolePlan, i: int, p: str, role: Role) -> None:
        self._norm(plan, names.blk(i, "layer_output_norm"), p + "final_layernorm.weight", role)

    def _attention(self, plan: RolePlan, i: int, a: str, role: Role) -> None:
        H, mtp = self.hidden, i >= self.n
        swa = mtp or self.swa[i]  # the MTP blocks are sliding-window blocks (vLLM's MiMoV2MTPLayer)
        kv = self.n_kv_swa if swa else self.n_kv
        q_rows, k_rows, v_rows = self.n_head * self.hd, kv * self.hd, kv * self.vhd
        srcs = [plan.source(a + "q_proj.weight", (q_rows, H)), plan.source(a + "k_proj.weight", (k_rows, H)),
                plan.source(a + "v_proj.weight", (v_rows, H))]
        if mtp:  # llama.cpp's MTP graph reads only a fused attn_qkv
            rows = q_rows + k_rows + v_rows
            plan.add(names.blk(i, "attn_qkv"), srcs, (rows, H), role, concat_rows)
        else:
            for part, src, rows in zip(("attn_q", "attn_k", "attn_v"), srcs, (q_rows, k_rows, v_rows)):
                plan.add(names.blk(i, part), [src], (rows, H), role)
        plan.add(names.blk(i, "attn_output"), [plan.source(a + "o_proj.weight", (H, self.n_head * self.vhd))],
                 (H, self.n_head * self.vhd), role)
        if plan.has(a + "attention_sink_bias"):
            plan.add(names.blk(i, "attn_sinks"), [plan.source(a + "attention_sink_bias", (self.n_head,))],
                     (self.n_head,), role, tf.identity, True)

    def _moe(self, plan: RolePlan, i: int, p: str, role: Role) -> None:
        H, E, m = self.hidden, self.n_expert, p + "mlp."
        plan.add(names.blk(i, "ffn_gate_inp"), [plan.source(m + "gate.weight", (E, H))], (E, H), role, tf.identity, True)
        plan.add(names.blk(i, "exp_probs_b", "bias"), [plan.source(m + "gate.e_score_correction_bias", (E,))], (E,),
                 role, tf.identity, True)
        plan_experts(plan, i, m + "experts.", E, self.expert_ffn, H, role, where=f"layer {i} ({m}experts)",
                     count_field="n_routed_experts")

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """In the order of llama.cpp's converter (TextModel's keys, where MimoV2Model's later writes of
        the same key keep their first place, then MimoV2Model's own); integer arrays as it writes them."""
        i32 = GGUFValueType.INT32
        k = self.k if keep_mtp else 0
        pattern = self.swa + [1] * k
        w = MetadataWriter(self.gguf_arch)
        w.text_model(self.n + k, self.context_length, self.hidden, self.ffn, self.n_head,
                     [self.n_kv_swa if s else self.n_kv for s in pattern], array_type=i32)
        w.f32(Keys.Rope.FREQ_BASE, self.rope_base)
        w.f32(Keys.Rope.FREQ_BASE_SWA, self.rope_base_swa)
        w.experts(self.n_expert, self.n_expert_used)
        w.expert_groups(self.n_group, self.topk_group)
        w.u32(Keys.LLM.EXPERT_GATING_FUNC, names.EXPERT_GATING_SIGMOID)
        w.head_sizes(self.hd, self.vhd)
        w.u32(Keys.Attention.SLIDING_WINDOW, self.window)
        w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, pattern, i32)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, self.expert_ffn)
        w.u32(Keys.Rope.DIMENSION_COUNT, self.rope_dim)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, self.eps)
        w.f32("{arch}.attention.value_scale", self.v_scale)
        w.nextn(k)
        return w.kv
