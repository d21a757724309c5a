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

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Mapping

import numpy as np
from gguf import Keys

from . import names, register
from . import transforms as tf
from .base import MetaKV
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import HParamsReader
from .metadata import MetadataWriter
from .nextn_moe import NextnMoePlugin, nextn_moe_table, norm
from .nextn_moe_hparams import NextnMoeHParams
from .tensor_table import TensorSpec, TensorTable



def llamacpp_reads_as_lite(num_hidden_layers: int, vocab: int) -> bool:
    """llama.cpp's deepseek2 loader treats these trunk sizes as DeepSeek-V2-Lite and never reads
    q_lora_rank (src/models/deepseek2.cpp `is_lite`)."""
    return num_hidden_layers in (26, 27) or (num_hidden_layers == 48 and vocab == 128256)


@dataclass(kw_only=True)
class Deepseek2HParams(NextnMoeHParams):
    """Multi-head latent attention: queries through a q_lora_rank latent (None: a plain q projection),
    keys and values through one kv_lora_rank latent plus a shared qk_rope_head_dim rope key; a head's
    query is qk_nope_head_dim + qk_rope_head_dim wide, its value v_head_dim."""

    family: ClassVar[str] = "deepseek2"
    gguf_arch: ClassVar[str] = names.DEEPSEEK2
    lite_by_size: ClassVar[bool] = True  # llama.cpp's V2-Lite rule by layer count (deepseek2 only; not the DSA arches)
    config_defaults: ClassVar[dict] = {  # transformers' DeepseekV3Config (a null q_lora_rank stays null)
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "n_shared_experts": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "rope_interleave": True, "attention_bias": False}

    q_lora_rank: int | None = None  # None: a plain attn_q (V2-Lite; GGUF attention.q_lora_rank 0)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # True: the checkpoint ropes adjacent pairs. False: it rotates halves and its rope rows are reordered
    # when converted (module docstring), so a file always holds adjacent-pair rows.
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        """A query head's width: its no-rope and rope parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """One token's cached latent row: the KV latent and the rope key (GGUF attention.key_length)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_tags(self, bid: int) -> set[str]:
        return {"q_lora" if self.q_lora_rank else "q_plain"}

    @classmethod
    def fields_from_config(cls, cfg: ConfigReader, tc: ConfigReader) -> dict[str, Any]:
        f = super().fields_from_config(cfg, tc)
        mla = {k: tc.integer(k, min=1) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        q_lora_rank = tc.integer("q_lora_rank", default=None, min=1)  # null: no q latent (V2-Lite)
        if mla["qk_rope_head_dim"] % 2:
            raise SpecconvError(f"config.json: qk_rope_head_dim ({mla['qk_rope_head_dim']}) must be even")
        if tc.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported (llama.cpp's deepseek2 has no "
                                "attention biases)")
        n, vocab = f["num_hidden_layers"], f["vocab_size"]
        if q_lora_rank is not None and cls.lite_by_size and llamacpp_reads_as_lite(n, vocab):
            raise SpecconvError(f"a deepseek2 model with {n} layers and vocabulary {vocab} is read by "
                                f"llama.cpp as DeepSeek-V2-Lite, which ignores q_lora_rank (q_a/q_b projections)")
        return dict(f, **mla, q_lora_rank=q_lora_rank, rope_interleave=tc.flag("rope_interleave", default=True))

    @classmethod
    def fields_from_kv(cls, r: HParamsReader) -> dict[str, Any]:
        f = super().fields_from_kv(r)
        key = r.key
        if key("attention.key_length_mla", None) is None:
            raise SpecconvError(f"{r.arch} file without attention.key_length_mla (an old unsplit attn_kv_b "
                                "layout); reconvert it")
        dr = key("rope.dimension_count", type=int)
        dn = key("attention.key_length_mla", type=int) - dr
        if dn < 1 or dr % 2:
            raise SpecconvError(f"{r.arch}: attention.key_length_mla {dn + dr} must exceed an even "
                                f"rope.dimension_count {dr}")
        scaling = f["rope_scaling"]
        if scaling is not None and scaling.factor != 1.0 and (f["rope_theta"] <= 1.0 or scaling.factor <= 0):
            raise SpecconvError(f"{r.arch}: YaRN needs rope.freq_base > 1 and rope.scaling.factor > 0")
        return dict(f, q_lora_rank=key("attention.q_lora_rank", 0, int) or None,
                    kv_lora_rank=key("attention.kv_lora_rank", type=int), qk_nope_head_dim=dn, qk_rope_head_dim=dr,
                    v_head_dim=key("attention.value_length_mla", type=int))


@dataclass(kw_only=True)
class Glm4MoeLiteHParams(Deepseek2HParams):
    """GLM-4.7-Flash: DeepSeek-V3's fields under GLM's defaults (transformers' Glm4MoeLiteConfig), the
    leading dense count also from `mlp_layer_types`."""

    family: ClassVar[str] = "glm4moelite"
    config_defaults: ClassVar[dict] = {  # transformers' Glm4MoeLiteConfig
        "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "n_shared_experts": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "q_lora_rank": 768,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
        "rope_interleave": True, "attention_bias": False}

    @classmethod
    def text_config(cls, config: Mapping[str, Any]) -> ConfigReader:
        tc = super().text_config(config)
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
    return lambda s: (partial(reorder_rope_rows, block=block(s), rope_start=start(s), dr=s.qk_rope_head_dim)
                      if not s.rope_interleave else tf.identity)


def _kv_b(split):
    """kv_b_proj's key or value half per head (`split`: kv_b_keys / kv_b_values)."""
    return lambda s: partial(split, nh=s.num_attention_heads, dn=s.qk_nope_head_dim, dv=s.v_head_dim)


_A = "{p}self_attn."
_Q_ROWS = _rope_rows(lambda s: s.qk_head_dim, lambda s: s.qk_nope_head_dim)
_Q_OUT = lambda s: s.num_attention_heads * s.qk_head_dim  # noqa: E731  (the query heads' width)
_KV_B_SOURCE = lambda s: (s.num_attention_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)  # noqa: E731

# MLA, written the way llama.cpp loads it (docs/reference/gguf-layout.md §7.5); the FFN-input norm is ffn_norm
MLA = (
    TensorSpec("blk.{bid}.attn_q.weight", _A + "q_proj.weight", lambda s: (_Q_OUT(s), s.hidden_size), "q_plain",
               transform=_Q_ROWS),
    TensorSpec("blk.{bid}.attn_q_a.weight", _A + "q_a_proj.weight", lambda s: (s.q_lora_rank, s.hidden_size), "q_lora"),
    norm("blk.{bid}.attn_q_a_norm.weight", _A + "q_a_layernorm.weight", "q_lora", lambda s: (s.q_lora_rank,)),
    TensorSpec("blk.{bid}.attn_q_b.weight", _A + "q_b_proj.weight", lambda s: (_Q_OUT(s), s.q_lora_rank), "q_lora",
               transform=_Q_ROWS),
    TensorSpec("blk.{bid}.attn_kv_a_mqa.weight", _A + "kv_a_proj_with_mqa.weight",
               lambda s: (s.latent_width, s.hidden_size),
               transform=_rope_rows(lambda s: s.latent_width, lambda s: s.kv_lora_rank)),
    norm("blk.{bid}.attn_kv_a_norm.weight", _A + "kv_a_layernorm.weight", dim=lambda s: (s.kv_lora_rank,)),
    TensorSpec("blk.{bid}.attn_k_b.weight", _A + "kv_b_proj.weight",
               lambda s: (s.num_attention_heads, s.kv_lora_rank, s.qk_nope_head_dim),
               hf_shape=_KV_B_SOURCE, transform=_kv_b(kv_b_keys)),
    TensorSpec("blk.{bid}.attn_v_b.weight", _A + "kv_b_proj.weight",
               lambda s: (s.num_attention_heads, s.v_head_dim, s.kv_lora_rank),
               hf_shape=_KV_B_SOURCE, transform=_kv_b(kv_b_values)),
    TensorSpec("blk.{bid}.attn_output.weight", _A + "o_proj.weight",
               lambda s: (s.hidden_size, s.num_attention_heads * s.v_head_dim)),
)
DEEPSEEK2_TABLE = nextn_moe_table(MLA, "ffn_norm")


@register
class Deepseek2(NextnMoePlugin):
    hf_architectures = ("DeepseekV3ForCausalLM",)
    gguf_arch: ClassVar[str] = Deepseek2HParams.gguf_arch
    llama_cpp_skips_absent_nextn: ClassVar[bool] = True  # trunk-only without the nextn tensors (inspect)
    hf_reference: ClassVar[dict[str, str]] = {"DeepseekV3ForCausalLM": "DeepseekV3ForCausalLM"}
    HParams = Deepseek2HParams
    family: ClassVar[str] = Deepseek2HParams.family
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "deepseek-v3"
    table: ClassVar[TensorTable] = DEEPSEEK2_TABLE

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        hp = self.hp
        w = MetadataWriter(self.gguf_arch)
        self._common_head_kv(w, keep_mtp, 1)  # MLA is written as MQA over the latent
        w.u32(Keys.LLM.VOCAB_SIZE, hp.vocab_size)
        # 0 = a plain attn_q; llama.cpp needs the key except for its "lite" layer counts
        w.u32(Keys.Attention.Q_LORA_RANK, hp.q_lora_rank or 0)
        w.u32(Keys.Attention.KV_LORA_RANK, hp.kv_lora_rank)
        w.head_sizes(hp.latent_width, hp.kv_lora_rank)
        w.u32(Keys.Attention.KEY_LENGTH_MLA, hp.qk_head_dim)  # selects llama.cpp's attn_k_b/attn_v_b path
        w.u32(Keys.Attention.VALUE_LENGTH_MLA, hp.v_head_dim)
        w.u32(Keys.Rope.DIMENSION_COUNT, hp.qk_rope_head_dim)
        if hp.rope_scaling is not None and hp.rope_scaling.mscale_all_dim is not None:
            w.f32(Keys.Rope.SCALING_YARN_LOG_MUL, 0.1 * hp.rope_scaling.mscale_all_dim)  # llama.cpp's legacy encoding
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
    gguf_arch: ClassVar[str] = Glm4MoeLiteHParams.gguf_arch
    hf_reference: ClassVar[dict[str, str]] = {"Glm4MoeLiteForCausalLM": "Glm4MoeLiteForCausalLM"}
    HParams = Glm4MoeLiteHParams
    family: ClassVar[str] = Glm4MoeLiteHParams.family
    tokenizer_pre: ClassVar[str] = "glm4"
    special_tokens: ClassVar[dict[str, str]] = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>",
                                                "eom": "<|observation|>"}  # as llama.cpp's GLM converters
