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
is skipped with a reason. config.json is read into `Step35HParams` (archs/step35_hparams.py).
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import numpy as np
from gguf import GGUFValueType, Keys

from . import names, register
from .base import MetaKV, Role
from .chained_mtp import ChainedMtpPlugin, chained_table, head_copies, norm_spec, routed_specs
from .metadata import MetadataWriter
from .plan_tools import RolePlan, text_model_name
from .step35_hparams import FULL, SWA, Step35HParams, per_layer
from .tensor_table import Hook, TensorSpec, TensorTable

_TOWERS = ("vision_model.", "model.vision_model.", "vit_large_projector.", "model.multi_modal_projector.")


def _squeeze_to(shape: tuple[int, ...], arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0].reshape(shape)


def plus_one(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] + np.float32(1.0)


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
        TensorSpec("blk.{bid}.attn_gate.weight", None, lambda s: (s.num_attention_heads, s.hidden_size), optional=True,
                   hook="attn_gate"),
    ),
    ffn_norm=(_norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight"),),
    routed=routed_specs("{p}moe.gate.weight", "exp_probs_b.bias", "{p}moe.router_bias", experts_hf="{p}moe.",
                        shared_hf="{p}share_expert.",
                        router_shapes=lambda s: [(s.num_experts, s.hidden_size), (s.num_experts, s.hidden_size, 1)],
                        router_transform=lambda s: partial(_squeeze_to, (s.num_experts, s.hidden_size))),
)


@register
class Step35(ChainedMtpPlugin):
    hf_architectures = ("Step3p5ForCausalLM", "Step3p7ForConditionalGeneration")
    gguf_arch: ClassVar[str] = names.STEP35
    family: ClassVar[str] = "step35"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "deepseek-v3"
    HParams: ClassVar[type[Step35HParams]] = Step35HParams

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        return text_model_name(raw_name, _TOWERS, "vision tower (belongs in a separate mmproj file)")

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = STEP35_TABLE

    def hooks(self) -> dict[str, Hook]:
        return {**super().hooks(), "head_copies": self._head_copies, "attn_gate": self._attn_gate}

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
        types = per_layer(hp.layer_types, total, FULL)
        heads, kv_heads = hp.num_attention_heads, hp.num_key_value_heads
        w = MetadataWriter(self.gguf_arch)
        # head_count_kv comes later here (Step35Model's own write)
        w.text_model(n + k, hp.max_position_embeddings, hp.hidden_size, hp.intermediate_size,
                     heads[:total] + [heads[-1]] * (total - len(heads)), None, array_type=i32, rope_theta=hp.rope_theta,
                     rope_theta_swa=hp.swa_rope_theta if SWA in hp.layer_types else None,
                     rms_norm_eps=hp.rms_norm_eps, key_length=hp.head_dim)
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
