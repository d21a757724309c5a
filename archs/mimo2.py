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
config.json is read into `Mimo2Hparams` (archs/mimo2_hparams.py), with the release's field names.
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
from .config_reader import ConfigReader
from .errors import SpecconvError
from .metadata import MetadataWriter
from .mimo2_hparams import Mimo2Hparams
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
        self.hp = hp = Mimo2Hparams.from_config(cfg)
        self.n, self.hidden, self.vocab = hp.num_hidden_layers, hp.hidden_size, hp.vocab_size
        self.ffn, self.tied = hp.intermediate_size, hp.tie_word_embeddings
        seen = {int(m.group(1)) for m in map(_MTP.match, checkpoint.tensors) if m}
        self.k = max(seen) + 1 if seen else 0
        if seen and sorted(seen) != list(range(self.k)):
            raise SpecconvError(f"checkpoint holds MTP layers model.mtp.layers.{sorted(seen)}, not 0..{self.k - 1}")
        check_stated_count(self, hp.num_nextn_predict_layers, self.k, "model.mtp.layers.*")
        self.moe_layers = {i for i in range(self.n) if f"model.layers.{i}.mlp.gate.weight" in checkpoint.tensors}
        freq = hp.moe_layer_freq
        if isinstance(freq, list) and len(freq) >= self.n:
            wrong = [i for i in range(self.n) if bool(freq[i]) != (i in self.moe_layers)]
            if wrong:
                raise SpecconvError(f"config.json moe_layer_freq disagrees with the checkpoint at layer {wrong[0]}")

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
        hp, H, mtp = self.hp, self.hidden, i >= self.n
        swa = mtp or hp.hybrid_layer_pattern[i]  # the MTP blocks are sliding-window blocks (vLLM's MiMoV2MTPLayer)
        kv = hp.swa_num_key_value_heads if swa else hp.num_key_value_heads
        n_head = hp.num_attention_heads
        q_rows, k_rows, v_rows = n_head * hp.head_dim, kv * hp.head_dim, kv * hp.v_head_dim
        srcs = [plan.source(a + "q_proj.weight", (q_rows, H)), plan.source(a + "k_proj.weight", (k_rows, H)),
                plan.source(a + "v_proj.weight", (v_rows, H))]
        if mtp:  # llama.cpp's MTP graph reads only a fused attn_qkv
            rows = q_rows + k_rows + v_rows
            plan.add(names.blk(i, "attn_qkv"), srcs, (rows, H), role, concat_rows)
        else:
            for part, src, rows in zip(("attn_q", "attn_k", "attn_v"), srcs, (q_rows, k_rows, v_rows)):
                plan.add(names.blk(i, part), [src], (rows, H), role)
        o_cols = n_head * hp.v_head_dim
        plan.add(names.blk(i, "attn_output"), [plan.source(a + "o_proj.weight", (H, o_cols))], (H, o_cols), role)
        if plan.has(a + "attention_sink_bias"):
            plan.add(names.blk(i, "attn_sinks"), [plan.source(a + "attention_sink_bias", (n_head,))],
                     (n_head,), role, tf.identity, True)

    def _moe(self, plan: RolePlan, i: int, p: str, role: Role) -> None:
        H, E, m = self.hidden, self.hp.n_routed_experts, p + "mlp."
        plan.add(names.blk(i, "ffn_gate_inp"), [plan.source(m + "gate.weight", (E, H))], (E, H), role, tf.identity, True)
        plan.add(names.blk(i, "exp_probs_b", "bias"), [plan.source(m + "gate.e_score_correction_bias", (E,))], (E,),
                 role, tf.identity, True)
        plan_experts(plan, i, m + "experts.", E, self.hp.moe_intermediate_size, H, role,
                     where=f"layer {i} ({m}experts)", count_field="n_routed_experts")

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """In the order of llama.cpp's converter (TextModel's keys, where MimoV2Model's later writes of
        the same key keep their first place, then MimoV2Model's own); integer arrays as it writes them."""
        i32 = GGUFValueType.INT32
        hp, k = self.hp, self.k if keep_mtp else 0
        pattern = list(hp.hybrid_layer_pattern) + [1] * k
        w = MetadataWriter(self.gguf_arch)
        w.text_model(self.n + k, hp.max_position_embeddings, hp.hidden_size, hp.intermediate_size,
                     hp.num_attention_heads,
                     [hp.swa_num_key_value_heads if s else hp.num_key_value_heads for s in pattern], array_type=i32)
        w.f32(Keys.Rope.FREQ_BASE, hp.rope_theta)
        w.f32(Keys.Rope.FREQ_BASE_SWA, hp.swa_rope_theta)
        w.experts(hp.n_routed_experts, hp.num_experts_per_tok)
        w.expert_groups(hp.n_group, hp.topk_group)
        w.u32(Keys.LLM.EXPERT_GATING_FUNC, names.EXPERT_GATING_SIGMOID)
        w.head_sizes(hp.head_dim, hp.v_head_dim)
        w.u32(Keys.Attention.SLIDING_WINDOW, hp.sliding_window)
        w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, pattern, i32)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.moe_intermediate_size)
        w.u32(Keys.Rope.DIMENSION_COUNT, hp.rotary_dim)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, hp.layernorm_epsilon)
        w.f32("{arch}.attention.value_scale", hp.attention_value_scale)
        w.nextn(k)
        return w.kv
