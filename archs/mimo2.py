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
config.json is read into `Mimo2HParams` (archs/mimo2_hparams.py), with the release's field names.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from gguf import GGUFValueType, Keys

from . import names, register
from . import transforms as tf
from .base import MetaKV, Role
from .chained_mtp import ChainedMtpPlugin, chained_table, head_copies, norm_spec, routed_specs
from .metadata import MetadataWriter
from .mimo2_hparams import Mimo2HParams
from .plan_tools import RolePlan, routed_experts, text_model_name
from .tensor_table import Hook, TensorSpec, TensorTable

_TOWERS = ("visual.", "model.visual.", "audio_tokenizer.", "model.audio_tokenizer.", "speech_embeddings.")


def concat_rows(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays, axis=0)


_norm = norm_spec()
_ATTN = "{p}self_attn."
MIMO2_TABLE = chained_table(
    _norm,
    head=(_norm("blk.{bid}.layer_output_norm.weight", "{p}final_layernorm.weight", "nextn", optional=True),
          TensorSpec("blk.{bid}.nextn.shared_head_norm.weight", None, lambda s: (s.hidden_size,), "nextn", optional=True,
                     f32=True), *head_copies()),  # other converters' head ends
    attention=(
        TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.hidden_size), "split_qkv",
                   optional=True),
        TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.hidden_size), "split_qkv",
                   optional=True),
        TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.v, s.hidden_size), "split_qkv",
                   optional=True),
        TensorSpec("blk.{bid}.attn_qkv.weight", None, lambda s: (s.q + s.kv + s.v, s.hidden_size), "fused_qkv", optional=True,
                   hook="fused_qkv"),
        TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.hidden_size, s.o)),
        TensorSpec("blk.{bid}.attn_sinks.weight", None, lambda s: (s.num_attention_heads,), optional=True, f32=True, hook="sinks"),
    ),
    ffn_norm=(_norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight", "trunk"),
              _norm("blk.{bid}.ffn_norm.weight", "{p}pre_mlp_layernorm.weight", "nextn")),
    routed=routed_specs("{p}mlp.gate.weight", "exp_probs_b.bias", "{p}mlp.gate.e_score_correction_bias"),
)


@register
class MiMo2(ChainedMtpPlugin):
    hf_architectures = ("MiMoV2FlashForCausalLM",)
    gguf_arch: ClassVar[str] = names.MIMO2
    family: ClassVar[str] = "mimo2"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "qwen2"

    HParams: ClassVar[type[Mimo2HParams]] = Mimo2HParams

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        return text_model_name(raw_name, _TOWERS, "vision / audio tower (belongs in a separate mmproj file)")

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = MIMO2_TABLE

    def hooks(self) -> dict[str, Hook]:
        return {**super().hooks(), "experts": routed_experts("n_routed_experts"), "fused_qkv": self._fused_qkv,
                "sinks": self._sinks}

    def mtp_source(self) -> str:
        return "model.mtp.layers.*"

    def block_prefix(self, bid: int) -> str:
        n = self.hp.num_hidden_layers
        return f"model.mtp.layers.{bid - n}." if bid >= n else f"model.layers.{bid}."

    def _fused_qkv(self, plan: RolePlan, s: Mimo2HParams, bid: int, p: str, role: Role) -> None:
        a = p + "self_attn."
        srcs = [plan.source(a + "q_proj.weight", (s.q, s.hidden_size)), plan.source(a + "k_proj.weight", (s.kv, s.hidden_size)),
                plan.source(a + "v_proj.weight", (s.v, s.hidden_size))]
        plan.add(names.blk(bid, "attn_qkv"), srcs, (s.q + s.kv + s.v, s.hidden_size), role, concat_rows)

    def _sinks(self, plan: RolePlan, s: Mimo2HParams, bid: int, p: str, role: Role) -> None:
        a = p + "self_attn."
        if plan.has(a + "attention_sink_bias"):
            plan.add(names.blk(bid, "attn_sinks"), [plan.source(a + "attention_sink_bias", (s.num_attention_heads,))],
                     (s.num_attention_heads,), role, tf.identity, True)

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        """In the order of llama.cpp's converter (TextModel's keys, where MimoV2Model's later writes of
        the same key keep their first place, then MimoV2Model's own); integer arrays as it writes them."""
        i32 = GGUFValueType.INT32
        hp, k = self.hp, self.hp.num_nextn_predict_layers if keep_mtp else 0
        blocks = hp.num_hidden_layers + k
        w = MetadataWriter(self.gguf_arch)
        w.text_model(blocks, hp.max_position_embeddings, hp.hidden_size, hp.intermediate_size,
                     hp.num_attention_heads, hp.num_key_value_heads[:blocks], array_type=i32, rope_theta=hp.rope_theta,
                     rope_theta_swa=hp.swa_rope_theta, experts=(hp.num_experts, hp.num_experts_per_tok),
                     expert_groups=(hp.n_group, hp.topk_group) if hp.expert_groups_stated else None,
                     expert_gating_func=names.EXPERT_GATING_SIGMOID, key_length=hp.head_dim, value_length=hp.v_head_dim)
        w.u32(Keys.Attention.SLIDING_WINDOW, hp.sliding_window)
        w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, hp.hybrid_layer_pattern[:blocks], i32)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.moe_intermediate_size)
        w.u32(Keys.Rope.DIMENSION_COUNT, hp.rotary_dim)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, hp.rms_norm_eps)
        w.f32("{arch}.attention.value_scale", hp.attention_value_scale)
        w.nextn(k)
        return w.kv
