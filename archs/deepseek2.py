"""DeepSeek-V3 / R1 (`DeepseekV3ForCausalLM`) -> GGUF arch `deepseek2` (docs/reference/gguf-layout.md §7.5).

Multi-head latent attention written the MLA way llama.cpp loads it: `kv_b_proj` split per head into
`attn_k_b` ([nh, kv_lora, dn], the transposed key half) and `attn_v_b` ([nh, dv, kv_lora]), KV
written as one latent head (`head_count_kv = 1`, `key_length = kv_lora + dr`). The expert gating
function is written explicitly (llama.cpp defaults deepseek2 to softmax), YaRN and the
`mscale_all_dim` log multiplier are written in llama.cpp's legacy encoding (0.1·mscale_all_dim).

Beyond llama.cpp's own converter, which drops it, the nextn layer `model.layers.{N}` is kept:
llama.cpp's deepseek2 runtime runs it (MTP contexts), and so does specconv's.

HF's `rope_interleave=True` (the releases) rotates adjacent pairs, which is llama.cpp's NORM rope,
so the weights go as they are. With `rope_interleave=False` HF rotates halves; the rope rows of
`q_b_proj` / `q_proj` and `kv_a_proj_with_mqa` are then reordered so adjacent-pair rope on the new
rows equals rotate-half on the old ones (q and k alike, so q·k is unchanged).
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import numpy as np
from gguf import Keys

from . import names, register
from . import transforms as tf
from .base import Checkpoint, MetaKV
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .metadata import MetadataWriter
from .nextn_moe import NextnMoePlugin, nextn_moe_table, norm
from .tensor_table import TensorSpec, TensorTable



def llamacpp_reads_as_lite(num_hidden_layers: int, vocab: int) -> bool:
    """llama.cpp's deepseek2 loader treats these trunk sizes as DeepSeek-V2-Lite and never reads
    q_lora_rank (src/models/deepseek2.cpp `is_lite`)."""
    return num_hidden_layers in (26, 27) or (num_hidden_layers == 48 and vocab == 128256)


@tf.layout_only
def kv_b_keys(ts: list[np.ndarray], nh: int, dn: int, dv: int) -> np.ndarray:
    """kv_b_proj [nh·(dn+dv), kv_lora] -> attn_k_b [nh, kv_lora, dn] (W_kb[h]ᵀ per head)."""
    w = ts[0].reshape(nh, dn + dv, -1)
    return np.ascontiguousarray(w[:, :dn, :].swapaxes(1, 2))


@tf.layout_only
def kv_b_values(ts: list[np.ndarray], nh: int, dn: int, dv: int) -> np.ndarray:
    """kv_b_proj [nh·(dn+dv), kv_lora] -> attn_v_b [nh, dv, kv_lora] (W_vb[h] per head)."""
    w = ts[0].reshape(nh, dn + dv, -1)
    return np.ascontiguousarray(w[:, dn:, :])


def half_to_pairs(dr: int) -> np.ndarray:
    """Row order turning rotate-half rope rows into adjacent pairs: new 2i <- old i, 2i+1 <- old i+dr/2."""
    return np.stack([np.arange(dr // 2), np.arange(dr // 2) + dr // 2], axis=1).reshape(-1)


@tf.layout_only
def reorder_rope_rows(ts: list[np.ndarray], block: int, rope_start: int, dr: int) -> np.ndarray:
    """Reorder the dr rope rows at offset rope_start of every `block` rows (a head, or the whole matrix)."""
    w = ts[0]
    g = w.reshape(-1, block, w.shape[-1]).copy()
    g[:, rope_start:rope_start + dr] = g[:, rope_start:rope_start + dr][:, half_to_pairs(dr)]
    return g.reshape(w.shape)


def _rope_rows(block, start):
    """Reorders the rope rows when the checkpoint rotates halves (module docstring); else identity."""
    return lambda s: (partial(reorder_rope_rows, block=block(s), rope_start=start(s), dr=s.dr) if s.rope_halves
                      else tf.identity)


_A = "{p}self_attn."
_QK = lambda s: s.dn + s.dr  # noqa: E731  (a query head's width)
_Q_ROWS = _rope_rows(_QK, lambda s: s.dn)
_KV_B_SOURCE = lambda s: (s.num_attention_heads * (s.dn + s.dv), s.kv_lora)  # noqa: E731

# MLA, written the way llama.cpp loads it (docs/reference/gguf-layout.md §7.5); the FFN-input norm is ffn_norm
MLA = (
    TensorSpec("blk.{bid}.attn_q.weight", _A + "q_proj.weight", lambda s: (s.num_attention_heads * _QK(s), s.E), "q_plain",
               transform=_Q_ROWS),
    TensorSpec("blk.{bid}.attn_q_a.weight", _A + "q_a_proj.weight", lambda s: (s.q_lora, s.E), "q_lora"),
    norm("blk.{bid}.attn_q_a_norm.weight", _A + "q_a_layernorm.weight", "q_lora", lambda s: (s.q_lora,)),
    TensorSpec("blk.{bid}.attn_q_b.weight", _A + "q_b_proj.weight", lambda s: (s.num_attention_heads * _QK(s), s.q_lora),
               "q_lora", transform=_Q_ROWS),
    TensorSpec("blk.{bid}.attn_kv_a_mqa.weight", _A + "kv_a_proj_with_mqa.weight", lambda s: (s.kv_lora + s.dr, s.E),
               transform=_rope_rows(lambda s: s.kv_lora + s.dr, lambda s: s.kv_lora)),
    norm("blk.{bid}.attn_kv_a_norm.weight", _A + "kv_a_layernorm.weight", dim=lambda s: (s.kv_lora,)),
    TensorSpec("blk.{bid}.attn_k_b.weight", _A + "kv_b_proj.weight", lambda s: (s.num_attention_heads, s.kv_lora, s.dn),
               hf_shape=_KV_B_SOURCE, transform=lambda s: partial(kv_b_keys, nh=s.num_attention_heads, dn=s.dn, dv=s.dv)),
    TensorSpec("blk.{bid}.attn_v_b.weight", _A + "kv_b_proj.weight", lambda s: (s.num_attention_heads, s.dv, s.kv_lora),
               hf_shape=_KV_B_SOURCE, transform=lambda s: partial(kv_b_values, nh=s.num_attention_heads, dn=s.dn, dv=s.dv)),
    TensorSpec("blk.{bid}.attn_output.weight", _A + "o_proj.weight", lambda s: (s.E, s.num_attention_heads * s.dv)),
)
DEEPSEEK2_TABLE = nextn_moe_table(MLA, "ffn_norm")


@register
class Deepseek2(NextnMoePlugin):
    hf_architectures = ("DeepseekV3ForCausalLM",)
    gguf_arch: ClassVar[str] = names.DEEPSEEK2
    llama_cpp_skips_absent_nextn: ClassVar[bool] = True  # trunk-only without the nextn tensors (inspect)
    hf_reference: ClassVar[dict[str, str]] = {"DeepseekV3ForCausalLM": "DeepseekV3ForCausalLM"}
    family: ClassVar[str] = "deepseek2"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "deepseek-v3"
    lite_by_size: ClassVar[bool] = True  # llama.cpp's V2-Lite rule by layer count (deepseek2 only; not the DSA arches)
    config_defaults: ClassVar[dict] = {  # transformers' DeepseekV3Config (a null q_lora_rank stays null)
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "n_shared_experts": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "rope_interleave": True, "attention_bias": False}

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        tc, hp = self.tc, self.hp

        self.q_lora = tc.integer("q_lora_rank", default=None, min=1)  # null: no q latent (V2-Lite)
        self.kv_lora, self.dn, self.dr, self.dv = (tc.integer(k, min=1) for k in ("kv_lora_rank", "qk_nope_head_dim",
                                                                                   "qk_rope_head_dim", "v_head_dim"))
        if self.dr % 2:
            raise SpecconvError(f"config.json: qk_rope_head_dim ({self.dr}) must be even")
        if tc.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported (llama.cpp's deepseek2 has no "
                                "attention biases)")
        self.rope_interleave = tc.flag("rope_interleave", default=True)
        if self.q_lora is not None and self.lite_by_size and llamacpp_reads_as_lite(hp.num_hidden_layers, hp.vocab):
            raise SpecconvError(f"a deepseek2 model with {hp.num_hidden_layers} layers and vocabulary {hp.vocab} is read by "
                                f"llama.cpp as DeepSeek-V2-Lite, which ignores q_lora_rank (q_a/q_b projections)")

    table: ClassVar[TensorTable] = DEEPSEEK2_TABLE

    def attention_sizes(self) -> dict:
        return dict(q_lora=self.q_lora or 0, kv_lora=self.kv_lora, dn=self.dn, dr=self.dr, dv=self.dv,
                    rope_halves=not self.rope_interleave)

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        hp = self.hp
        w = MetadataWriter(self.gguf_arch)
        self._common_head_kv(w, keep_mtp, 1)  # MLA is written as MQA over the latent
        w.u32(Keys.LLM.VOCAB_SIZE, hp.vocab)
        # 0 = a plain attn_q; llama.cpp needs the key except for its "lite" layer counts
        w.u32(Keys.Attention.Q_LORA_RANK, self.q_lora or 0)
        w.u32(Keys.Attention.KV_LORA_RANK, self.kv_lora)
        w.head_sizes(self.kv_lora + self.dr, self.kv_lora)
        w.u32(Keys.Attention.KEY_LENGTH_MLA, self.dn + self.dr)  # selects llama.cpp's attn_k_b/attn_v_b path
        w.u32(Keys.Attention.VALUE_LENGTH_MLA, self.dv)
        w.u32(Keys.Rope.DIMENSION_COUNT, self.dr)
        if hp.yarn is not None and hp.yarn.mscale_all_dim is not None:
            w.f32(Keys.Rope.SCALING_YARN_LOG_MUL, 0.1 * hp.yarn.mscale_all_dim)  # llama.cpp's legacy encoding
        self._common_moe_kv(w, keep_mtp)
        return w.kv


@register
class Glm4MoeLite(Deepseek2):
    """GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`): DeepSeek-V3's MLA and sigmoid-routed MoE under GLM's
    names and defaults, written as arch `deepseek2` with its nextn layer, as llama.cpp's
    `Glm4MoeLiteModel` converter does (docs/reference/gguf-layout.md §7.5; docs/archs.md "GLM-4.7-Flash").

    What differs from llama.cpp's converter: `expert_gating_func = 2` is always written. The release
    config has no `scoring_func` (only `topk_method: noaux_tc`), so llama.cpp's converter leaves the
    key out and llama.cpp then routes with softmax except at the release's exact size (47/48 layers,
    vocabulary 154880); transformers always routes GLM-4.7-Flash with sigmoid. The leading dense
    count also comes from `mlp_layer_types` (what transformers 5 saves) when `first_k_dense_replace`
    is absent; llama.cpp's converter would write 0 there.
    """

    hf_architectures = ("Glm4MoeLiteForCausalLM",)
    gguf_arch: ClassVar[str] = names.DEEPSEEK2
    hf_reference: ClassVar[dict[str, str]] = {"Glm4MoeLiteForCausalLM": "Glm4MoeLiteForCausalLM"}
    family: ClassVar[str] = "glm4moelite"
    tokenizer_pre: ClassVar[str] = "glm4"
    special_tokens: ClassVar[dict[str, str]] = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>",
                                                "eom": "<|observation|>"}  # as llama.cpp's GLM converters
    config_defaults: ClassVar[dict] = {  # transformers' Glm4MoeLiteConfig
        "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "n_shared_experts": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "q_lora_rank": 768,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
        "rope_interleave": True, "attention_bias": False}

    @classmethod
    def text_fields(cls, config) -> ConfigReader:
        tc = super().text_fields(config)
        types = tc.strings("mlp_layer_types", default=None)
        if types is not None:
            n = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
            lead = next((i for i, t in enumerate(types) if t != "dense"), len(types))
            if len(types) != n or any(t != "sparse" for t in types[lead:]) or not set(types) <= {"dense", "sparse"}:
                raise SpecconvError(f"config.json: mlp_layer_types {types} is not leading 'dense' layers then "
                                    f"'sparse' ones for {n} layers (llama.cpp has one leading_dense_block_count)")
            configured = tc.integer("first_k_dense_replace", default=None)
            if configured is not None and configured != lead:
                raise SpecconvError(f"config.json: first_k_dense_replace={configured} disagrees with "
                                    f"mlp_layer_types ({lead} leading dense layers)")
            tc = tc.with_values({"first_k_dense_replace": lead}, "from mlp_layer_types")
        elif not tc.has("first_k_dense_replace"):
            # transformers' default pattern: dense, then sparse
            tc = tc.with_values({"first_k_dense_replace": 1}, "transformers' default")
        factor = tc.with_rope().number("partial_rotary_factor", default=1.0)
        if factor != 1.0:
            raise SpecconvError(f"config.json: partial_rotary_factor={factor} is not supported (llama.cpp's deepseek2 "
                                f"ropes all qk_rope_head_dim dims)")
        return tc
