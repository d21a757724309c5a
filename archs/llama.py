"""Plain LLaMA-style dense models (`LlamaForCausalLM`, GGUF arch `llama`), and the q/k pair
permutation that LLaMA-family GGUF files (and EAGLE-3 heads) share.

HF stores q/k rows in rotate-half order (rope pairs (i, i + hd/2)); llama.cpp's `llama` and
`eagle3` graphs use NORM rope on adjacent pairs (2i, 2i+1). The converter therefore reorders the
rows of every head so that new row 2i is old row i and new row 2i+1 is old row i + hd/2
(docs/reference/gguf-layout.md §7.8); the attention scores are unchanged, because q and k get the same order.
Supported here: what a LLaMA-3-style target needs (GQA, SwiGLU, untied or tied head, default or
`llama3` rope scaling through `rope_freqs.weight`), with a byte-level BPE tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, Mapping

import numpy as np
from gguf import Keys

from . import names, plugin_class_for_family, register
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import FamilyHParams, HParamsReader
from .metadata import MetadataWriter
from .plan_tools import RolePlan
from .tensor_table import AttentionWidths, Hook, TensorSpec, TensorTable, swiglu_specs

ROPE_FREQS = "rope_freqs.weight"


def pair_permute(t: np.ndarray, num_attention_heads: int) -> np.ndarray:
    """Rows of each head from rotate-half order to adjacent pairs: [n_head, 2, hd/2] -> [n_head, hd/2, 2]."""
    rows = t.shape[0]
    if rows % (2 * num_attention_heads):
        raise SpecconvError(f"cannot pair-permute {rows} rows over {num_attention_heads} heads (head_dim must be even)")
    return np.ascontiguousarray(t.reshape(num_attention_heads, 2, rows // num_attention_heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape))


def pair_unpermute(t: np.ndarray, num_attention_heads: int) -> np.ndarray:
    """Inverse of `pair_permute` (GGUF -> HF order), for tests and readers."""
    rows = t.shape[0]
    return np.ascontiguousarray(t.reshape(num_attention_heads, rows // num_attention_heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape))


@tf.layout_only
def _permuted(ts: list[np.ndarray], num_attention_heads: int) -> np.ndarray:
    return pair_permute(ts[0], num_attention_heads)


def llama3_rope_factors(cfg: ConfigReader, head_dim: int) -> list[float] | None:
    """Per-frequency divisors of θ for `rope_type: llama3` (None for unscaled rope)."""
    scaling = cfg.section("rope_scaling")
    if not scaling.data:
        scaling = cfg.section("rope_parameters")
    kind = scaling.string("rope_type", "type", default="default").lower()
    if kind == "default":
        return None
    if kind != "llama3":
        raise SpecconvError(f"rope scaling type {kind!r} is not supported for LLaMA-style models (default, llama3)")
    base = cfg.with_rope().number("rope_theta", default=10000.0)
    factor = scaling.number("factor", default=8.0)
    low, high = scaling.number("low_freq_factor", default=1.0), scaling.number("high_freq_factor", default=4.0)
    old_ctx = scaling.number("original_max_position_embeddings", default=8192.0)
    # float32 arithmetic step by step as llama.cpp's converter does it with torch scalars (a Python
    # number is rounded to float32 first; `number / x` is reciprocal(x) * number), so every basic
    # operation gives the same bits; only the power is computed in float64 and rounded once.
    f32 = np.float32
    one = f32(1)
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / f32(head_dim)
    powers = np.power(np.float64(f32(base)), exponents.astype(np.float64)).astype(np.float32)
    out = []
    for power in powers:
        freq = one / power
        wavelen = (one / freq) * f32(2 * math.pi)
        if wavelen < f32(old_ctx / high):
            out.append(1.0)
        elif wavelen > f32(old_ctx / low):
            out.append(factor)
        else:
            smooth = ((one / wavelen) * f32(old_ctx) - f32(low)) / f32(high - low)
            out.append(float(one / ((one - smooth) / f32(factor) + smooth)))
    return out


@dataclass(kw_only=True)
class LlamaHParams(AttentionWidths, FamilyHParams):
    """A LLaMA model's hyperparameters under transformers' LlamaConfig names: the plugin's from
    config.json (`from_config`), the graph's from GGUF metadata (`from_kv`, runtime/graphs/llama.py);
    the LLaMA table's shapes read them. EAGLE-3 heads extend them (archs/eagle3.py)."""

    arch: str = "llama"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # rope width: rope_freqs holds rotary_dim / 2 factors
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    states_head_dim: bool = False  # head_dim stated (config.json's head_dim; GGUF attention.key_length)
    tie_word_embeddings: bool = False  # config.json only: a file says it by having no output.weight

    @property
    def attention_input_width(self) -> int:
        """Width of the rows q/k/v read (EAGLE-3's: 2·hidden_size, [embedding ; fused features])."""
        return self.hidden_size

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "LlamaHParams":
        cfg = ConfigReader(config)
        heads, n_kv, hd = cfg.attention_heads()
        hidden_size, ffn = cfg.integer("hidden_size", min=1), cfg.integer("intermediate_size", min=1)
        return cls(num_hidden_layers=cfg.integer("num_hidden_layers", min=1, max=MAX_LAYERS), hidden_size=hidden_size,
                   intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=n_kv, head_dim=hd,
                   rotary_dim=hd, tie_word_embeddings=cfg.flag("tie_word_embeddings", default=False),
                   **llama_layer_config(cfg))

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "LlamaHParams":
        r = HParamsReader(kv)
        key = r.key
        hidden_size, num_attention_heads, head_dim = r.attention_widths()
        return cls(arch=r.arch, num_hidden_layers=key("block_count", type=int), hidden_size=hidden_size,
                   num_attention_heads=num_attention_heads,
                   num_key_value_heads=key("attention.head_count_kv", num_attention_heads, int), head_dim=head_dim,
                   rotary_dim=key("rope.dimension_count", head_dim, int),
                   rope_theta=key("rope.freq_base", 10000.0, float),
                   rms_norm_eps=key("attention.layer_norm_rms_epsilon", type=float),
                   intermediate_size=key("feed_forward_length", 0, int),
                   vocab_size=r.vocab_size(),
                   max_position_embeddings=key("context_length", 0, int),
                   states_head_dim=r.has("attention.key_length"), from_file=True)


def llama_layer_config(cfg: ConfigReader) -> dict[str, Any]:
    """The fields a LLaMA config and an EAGLE-3 head's layer config state alike, with transformers' defaults."""
    return dict(max_position_embeddings=cfg.integer("max_position_embeddings", default=None) or 0,
                rope_theta=cfg.with_rope().number("rope_theta", default=10000.0),
                rms_norm_eps=cfg.number("rms_norm_eps", default=1e-6), states_head_dim=cfg.has("head_dim"),
                vocab_size=cfg.integer("vocab_size", default=0))


def block_tags(s: LlamaHParams, bid: int) -> frozenset[str]:
    return frozenset()  # every block alike


def _norm(gguf: str, hf: str, dim=lambda s: (s.hidden_size,), **kw) -> TensorSpec:
    return TensorSpec(gguf, hf, dim, f32=True, **kw)  # RMSNorm weights, kept F32


_ATTN, _MLP = "{p}self_attn.", "{p}mlp."
# One decoder block (LLaMA's every layer, EAGLE-3's one layer on a 2·hidden_size input).
BLOCK_SPECS = (
    _norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
    TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.attention_input_width),
               transform=lambda s: partial(_permuted, num_attention_heads=s.num_attention_heads)),
    TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.attention_input_width),
               transform=lambda s: partial(_permuted, num_attention_heads=s.num_key_value_heads)),
    TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.kv, s.attention_input_width)),
    TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.hidden_size, s.q)),
    _norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight"),
    *swiglu_specs(_MLP),
)
# llama3 rope scaling's generated factors, written only for such a config (the plugin's hook)
ROPE_FREQS_SPEC = TensorSpec(ROPE_FREQS, None, lambda s: (s.rotary_dim // 2,), optional=True, f32=True,
                             hook="rope_freqs", role=Role.TRUNK)

LLAMA_TABLE = TensorTable((  # every tensor of the trunk file (Role.TRUNK, as llama.cpp has no sidecar for it)
    TensorSpec(names.TOKEN_EMBD, "model.embed_tokens.weight", lambda s: (s.vocab_dim, s.hidden_size),
               role=Role.TRUNK),
    _norm(names.OUTPUT_NORM, "model.norm.weight", role=Role.TRUNK),
    TensorSpec(names.OUTPUT, None, lambda s: (s.vocab_dim, s.hidden_size), optional=True, hook="output_head",
               role=Role.TRUNK),
    ROPE_FREQS_SPEC,
) + BLOCK_SPECS, block_tags)


def add_rope_freqs(plan: RolePlan, cfg: ConfigReader, head_dim: int, anchor: str) -> None:
    """`rope_freqs.weight` for llama3 rope scaling: a generated tensor, placed after `anchor` (a small
    tensor, read but unused: plans need a source to have a place in the checkpoint order)."""
    factors = llama3_rope_factors(cfg, head_dim)
    if factors is not None:
        plan.add(ROPE_FREQS, [anchor], (head_dim // 2,), Role.TRUNK, partial(tf.constant, values=tuple(factors)),
                 f32=True)


def rope_freqs_first(plans: list[TensorPlan]) -> list[TensorPlan]:
    """Generated rope_freqs first, as llama.cpp's converter emits its extra tensors before the checkpoint's."""
    return sorted(plans, key=lambda p: p.name != ROPE_FREQS)


def llama_kv(hp: LlamaHParams) -> list[MetaKV]:
    """The LLaMA key set llama.cpp's converter writes (TextModel + LlamaModel)."""
    w = MetadataWriter(hp.arch)
    w.text_model(hp.num_hidden_layers, hp.max_position_embeddings or None,  # 0: not written
                 hp.hidden_size, hp.intermediate_size, hp.num_attention_heads, hp.num_key_value_heads,
                 rope_theta=hp.rope_theta, rms_norm_eps=hp.rms_norm_eps,
                 key_length=hp.head_dim if hp.states_head_dim else None)
    w.u32(Keys.LLM.VOCAB_SIZE, hp.vocab_size)
    w.u32(Keys.Rope.DIMENSION_COUNT, hp.rotary_dim)
    return w.kv


@register
class Llama(ArchPlugin):
    hf_architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    gguf_arch: ClassVar[str] = "llama"
    hf_reference: ClassVar[dict[str, str]] = {"LlamaForCausalLM": "LlamaForCausalLM"}
    family: ClassVar[str] = "llama"
    tokenizer_model: ClassVar[str] = "gpt2"
    tokenizer_pre: ClassVar[str] = "llama-bpe"

    @classmethod
    def refine(cls, config: Mapping[str, Any]) -> type[ArchPlugin]:
        """Some EAGLE-3 heads say LlamaForCausalLM: one layer and a draft_vocab_size identify them (as upstream)."""
        if "draft_vocab_size" in config and ConfigReader(config).integer("num_hidden_layers", default=0) == 1:
            return plugin_class_for_family("eagle3")
        return cls

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.hp = LlamaHParams.from_config(checkpoint.config)
        self.cfg = ConfigReader(checkpoint.config)  # its rope_scaling: the generated rope_freqs tensor

    @classmethod
    def normalize_name(cls, raw_name: str):
        if raw_name.endswith("rotary_emb.inv_freq"):
            return (None, "rotary inv_freq buffer (recomputed from the config)")
        return raw_name

    table: ClassVar[TensorTable] = LLAMA_TABLE

    def sizes(self) -> LlamaHParams:
        """The hparams the file is written with: its vocabulary is the embedding's rows."""
        return replace(self.hp, vocab_size=self.vocab_size())

    def hooks(self) -> dict[str, Hook]:
        return {"output_head": self._output_head, "rope_freqs": self._rope_freqs}

    def tensor_plan(self) -> list[TensorPlan]:
        return rope_freqs_first(super().tensor_plan())

    def _output_head(self, plan: RolePlan, s: LlamaHParams, bid: None, p: str, role: Role) -> None:
        if plan.has("lm_head.weight") and not s.tie_word_embeddings:
            shape = (s.vocab_size, s.hidden_size)
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", shape)], shape, role)
        else:
            plan.used.add("lm_head.weight")  # tied: a saved head is the embedding again

    def _rope_freqs(self, plan: RolePlan, s: LlamaHParams, bid: None, p: str, role: Role) -> None:
        add_rope_freqs(plan, self.cfg, s.head_dim, "model.norm.weight")

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        return llama_kv(self.sizes())
