"""Gemma 4 hyperparameters, one dataclass for the plugin (config.json) and the graphs (GGUF metadata).

`Gemma4HParams.from_config` reads a Gemma 4 text config in either form (the Hub's `global_head_dim` /
`num_global_key_value_heads`, or transformers 5's `per_layer_config`); `from_kv` reads what the
plugin writes (docs/reference/gguf-layout.md §7.6). Head sizes, KV-head counts and FFN widths are
lists with one entry a block, since sliding and full layers differ; the family's tensor tables
(archs/gemma4.py) read one block's with `block_sizes`. `Gemma4AssistantHParams` is the MTP assistant
(§7.7): every block drafts (num_hidden_layers 0), none owns K/V, and it reads its target's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Mapping

from . import names
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import FamilyHParams, HParamsReader
from .tensor_table import AttentionWidths

SLIDING, FULL = "sliding_attention", "full_attention"
PER_LAYER_VOCAB_FROM_FILE = "Vp"  # rows of a file's per-layer embedding (other converters keep more)
ROPE_FREQS_FROM_FILE = "R"  # rope_freqs entries of a file without full layers, which nothing else reads


@dataclass(kw_only=True)
class Gemma4HParams(AttentionWidths, FamilyHParams):
    """A Gemma 4 text model. Its `q` and `kv` widths (AttentionWidths) are one block's, read from the
    hparams `block_sizes` gives (archs/gemma4.py), whose head_dim is a number, not the list."""

    ARCH: ClassVar[str] = names.GEMMA4
    # per block (FamilyHParams' lists): sliding layers use config's head_dim / num_key_value_heads, full
    # ones global_head_dim / num_global_key_value_heads (or per_layer_config's); `block_sizes` gives one
    num_attention_heads: int
    num_key_value_heads: list[int]
    head_dim: list[int]
    layer_types: list[str]  # SLIDING or FULL, per block
    intermediate_size: list[int]  # per block: doubled on the K/V-sharing layers of use_double_wide_mlp configs
    sliding_head_dim: int  # config's head_dim (GGUF key_length_swa)
    global_head_dim: int  # the full layers' head (GGUF key_length); the sliding one without full layers
    sliding_window: int
    num_kv_shared_layers: int  # the last ones own no K/V: they read the last owner of their type
    hidden_size_per_layer_input: int  # per-layer inputs (PLE) width, 0 without
    rope_theta: float  # full layers (θ further divided by rope_freqs)
    sliding_rope_theta: float
    sliding_rotary_dim: int  # config's head_dim × the sliding layers' partial_rotary_factor (rope.dimension_count_swa)
    rms_norm_eps: float
    final_logit_softcapping: float | None = None
    moe_intermediate_size: int = 0  # 0 without the MoE block (then num_experts is 0 too)
    backbone_hidden_size: int = 0  # the assistant's: its target's hidden size (GGUF embedding_length_out)
    # config.json only (None from a file, which says them with tensors, not metadata):
    partial_rotary_factor: float | None = None  # full layers' rope fraction (a file: the rope_freqs tensor)
    attention_k_eq_v: bool | None = None  # full layers' V is their raw K (a file: no attn_v on those layers)

    @property
    def n_blocks(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    def owns_kv(self, i: int) -> bool:
        """Block i computes its own K/V (not a sharing tail layer, not an assistant block)."""
        return i < self.num_hidden_layers - self.num_kv_shared_layers

    @cached_property
    def store(self) -> dict[bool, int]:
        """Layer type (is_sliding) -> the last K/V-owning trunk layer of that type, whose K/V the sharing
        layers of the type (and the assistant's blocks) read."""
        out = {}
        owners = range(self.num_hidden_layers - self.num_kv_shared_layers)
        for sliding in {self.is_sliding(i) for i in range(self.num_hidden_layers)}:
            found = [i for i in owners if self.is_sliding(i) == sliding]
            if not found:
                raise SpecconvError(f"{self.arch}: K/V-sharing layers of a type no earlier layer produces")
            out[sliding] = found[-1]
        return out

    def kv_layer(self, i: int) -> int:
        """The layer whose K/V layer i attends to (itself, or the store layer of its type)."""
        return i if self.owns_kv(i) else self.store[self.is_sliding(i)]

    @property
    def per_layer_vocab_dim(self) -> int | str:
        """Rows of the per-layer embedding: the vocabulary when converting, the file's own when loading."""
        return PER_LAYER_VOCAB_FROM_FILE if self.from_file else self.vocab_size

    @property
    def rope_freqs_length(self) -> int | str:
        """Entries of rope_freqs: half the full-attention head."""
        if self.from_file and FULL not in self.layer_types:
            return ROPE_FREQS_FROM_FILE
        return self.global_head_dim // 2

    def rope_freq_factors(self) -> tuple[float, ...]:
        """1 for the rotated pairs of a full layer, 1e30 (θ → 0) for the rest (docs/reference/gguf-layout.md §7.6)."""
        half = self.global_head_dim // 2
        rotary_dim = int(self.global_head_dim * self.partial_rotary_factor / 2)
        return (1.0,) * rotary_dim + (1e30,) * (half - rotary_dim)

    # ---- config.json ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Gemma4HParams":
        return cls(arch=cls.ARCH, **_text_config(ConfigReader(config).text_model()))

    # ---- GGUF metadata ----------------------------------------------------------------------------
    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "Gemma4HParams":
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        trunk, nextn = r.block_counts()
        n = trunk + nextn
        swa = [bool(x) for x in key("attention.sliding_window_pattern", type=list)]
        if len(swa) != n:
            raise SpecconvError(f"{arch}.attention.sliding_window_pattern has {len(swa)} entries for {n} blocks")
        hd_full, hd_swa = key("attention.key_length", type=int), key("attention.key_length_swa", type=int)
        r.check_value_length(hd_full)
        r.check_value_length(hd_swa, "_swa")
        tokens = kv.get("tokenizer.ggml.tokens")
        hp = cls(arch=arch, num_hidden_layers=trunk, num_nextn_predict_layers=nextn,
                 hidden_size=key("embedding_length", type=int),
                 vocab_size=len(tokens) if tokens is not None else 0,
                 max_position_embeddings=key("context_length", 0, int),
                 num_attention_heads=key("attention.head_count", type=int),
                 num_key_value_heads=r.per_layer("attention.head_count_kv", n),
                 head_dim=[hd_swa if s else hd_full for s in swa], layer_types=[SLIDING if s else FULL for s in swa],
                 intermediate_size=r.per_layer("feed_forward_length", n),
                 sliding_head_dim=hd_swa, global_head_dim=hd_full,
                 sliding_window=key("attention.sliding_window", type=int),
                 num_kv_shared_layers=key("attention.shared_kv_layers", 0, int),
                 hidden_size_per_layer_input=key("embedding_length_per_layer_input", 0, int),
                 rope_theta=key("rope.freq_base", type=float), sliding_rope_theta=key("rope.freq_base_swa", type=float),
                 sliding_rotary_dim=key("rope.dimension_count_swa", hd_swa, int),
                 rms_norm_eps=key("attention.layer_norm_rms_epsilon", type=float),
                 final_logit_softcapping=key("final_logit_softcapping", None, float) or None,
                 num_experts=key("expert_count", 0, int), num_experts_per_tok=key("expert_used_count", 0, int),
                 moe_intermediate_size=key("expert_feed_forward_length", 0, int),
                 backbone_hidden_size=key("embedding_length_out", 0, int), from_file=True)
        if key("rope.dimension_count", hd_full, int) != hd_full:
            raise SpecconvError(f"{arch}.rope.dimension_count must be the full head dim {hd_full} (proportional "
                                f"rope is expressed with rope_freqs)")
        hp.store  # every sharing layer has a store layer: a one-line error on load, not in a forward
        return hp


@dataclass(kw_only=True)
class Gemma4AssistantHParams(Gemma4HParams):
    """The assistant: its config's layers are all draft blocks (num_nextn_predict_layers), every one
    reading the target's K/V, and it takes target-width hidden rows."""

    ARCH: ClassVar[str] = names.GEMMA4_ASSISTANT

    @property
    def input_width(self) -> int:
        return self.backbone_hidden_size

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Gemma4AssistantHParams":
        cfg = ConfigReader(config)
        tc = cfg.text_model()
        text = _text_config(tc)
        backbone = cfg.integer("backbone_hidden_size", default=0)
        if not backbone:
            raise SpecconvError("config.json lacks backbone_hidden_size (the target's hidden size)")
        if backbone == text["hidden_size"]:
            raise SpecconvError("backbone_hidden_size equals the assistant's hidden_size; llama.cpp needs them "
                                "to differ (embedding_length_out carries the backbone width)")
        n = text.pop("num_hidden_layers")
        if text["num_kv_shared_layers"] not in (0, n):
            raise SpecconvError("every assistant layer must read the target's K/V (num_kv_shared_layers = "
                                "num_hidden_layers)")
        if text["hidden_size_per_layer_input"] or text["num_experts"] or tc.flag("use_double_wide_mlp", default=False):
            raise SpecconvError("a Gemma 4 assistant has no per-layer inputs, MoE blocks or double-wide MLPs")
        # the assistant config forces every layer to share (transformers' Gemma4AssistantConfig)
        return cls(arch=cls.ARCH, num_hidden_layers=0, num_nextn_predict_layers=n,
                   **{**text, "num_kv_shared_layers": n}, backbone_hidden_size=backbone)

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "Gemma4AssistantHParams":
        hp = super().from_kv(kv)
        if hp.num_hidden_layers != 0 or hp.num_nextn_predict_layers == 0:
            raise SpecconvError("a gemma4-assistant file needs nextn_predict_layers = block_count")
        if not hp.backbone_hidden_size or hp.backbone_hidden_size == hp.hidden_size:
            raise SpecconvError("a gemma4-assistant file needs embedding_length_out (the target's hidden size)")
        return hp


def _text_config(cfg: ConfigReader) -> dict[str, Any]:
    """The fields of a Gemma 4 text config, from either config form, checked; num_hidden_layers is
    every layer of the config (the assistant's become draft blocks)."""
    H = cfg.integer("hidden_size", min=1)
    F = cfg.integer("intermediate_size")
    N = cfg.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
    num_attention_heads = cfg.integer("num_attention_heads", min=1)
    hd_swa = cfg.integer("head_dim", default=256, min=1) or 256
    nkv_swa = cfg.integer("num_key_value_heads", default=num_attention_heads, min=1)
    types = cfg.strings("layer_types", default=None)
    if not types:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(N)]  # transformers' default 5:1
    if len(types) != N or any(t not in (SLIDING, FULL) for t in types):
        raise SpecconvError(f"config.json layer_types must list {N} of {SLIDING!r} / {FULL!r}")
    k_eq_v = cfg.flag("attention_k_eq_v", default=False)
    per_layer = _per_layer_config(cfg.section("per_layer_config"))
    hd_full = cfg.integer("global_head_dim", default=None, min=1)
    # transformers' gate
    nkv_full = cfg.integer("num_global_key_value_heads", default=None, min=1) if k_eq_v else None
    hd, nkv = [], []
    none = ConfigReader({})
    for i, t in enumerate(types):
        over = per_layer.get(i, none)
        if t == FULL:
            d = over.integer("head_dim", default=None, min=1) or hd_full or (512 if not per_layer else hd_swa)
            kv = over.integer("num_key_value_heads", default=None, min=1) or nkv_full or nkv_swa
        else:
            d = over.integer("head_dim", default=None, min=1) or hd_swa
            kv = over.integer("num_key_value_heads", default=None, min=1) or nkv_swa
        if num_attention_heads % kv:
            raise SpecconvError(f"layer {i}: {num_attention_heads} heads are not a multiple of {kv} KV heads")
        hd.append(d)
        nkv.append(kv)
    full = [i for i, t in enumerate(types) if t == FULL]
    hd_full = hd[full[0]] if full else hd_swa
    nkv_full = nkv[full[0]] if full else nkv_swa
    if any(hd[i] != hd_full for i in full) or any(nkv[i] != nkv_full for i in full):
        raise SpecconvError("full-attention layers with different head dims or KV heads are not supported")
    n_shared = cfg.integer("num_kv_shared_layers", default=0)
    if not 0 <= n_shared <= N:
        raise SpecconvError(f"num_kv_shared_layers {n_shared} is outside 0..{N}")
    P = cfg.integer("hidden_size_per_layer_input", default=0)
    double_wide = cfg.flag("use_double_wide_mlp", default=False)
    moe = dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    if cfg.flag("enable_moe_block", default=False):
        if not cfg.has("num_experts") or not cfg.has("top_k_experts") or \
                not cfg.has("moe_intermediate_size", "expert_intermediate_size"):
            raise SpecconvError("a Gemma 4 MoE config needs num_experts, top_k_experts and moe_intermediate_size")
        moe = dict(num_experts=cfg.integer("num_experts", min=1),
                   num_experts_per_tok=cfg.integer("top_k_experts", min=1),
                   moe_intermediate_size=cfg.integer("moe_intermediate_size", "expert_intermediate_size", min=1))
    rope = cfg.section("rope_parameters")
    full_rope, swa_rope = rope.section(FULL), rope.section(SLIDING)
    if full_rope.data:
        kind = full_rope.string("rope_type", default="default")
        rope_theta = full_rope.number("rope_theta", default=1_000_000.0)
        rope_factor = full_rope.number("partial_rotary_factor", default=1.0)
    else:  # transformers' default: proportional rope over a quarter of the head
        kind, rope_theta, rope_factor = "proportional", 1_000_000.0, 0.25
    if kind not in ("default", "proportional"):
        raise SpecconvError(f"full-attention rope type {kind!r} is not supported")
    rope_theta_swa = swa_rope.number("rope_theta", default=10_000.0)
    rope_factor_swa = swa_rope.number("partial_rotary_factor", default=1.0)
    if cfg.has("attn_logit_softcapping"):
        raise SpecconvError("attn_logit_softcapping is not supported by the gemma4 GGUF layout")
    if cfg.raw("use_bidirectional_attention") == "all":
        raise SpecconvError("use_bidirectional_attention='all' models are not causal language models")
    context_length = cfg.integer("max_position_embeddings", default=131072, min=1) or 131072
    rms_eps = cfg.number("rms_norm_eps", default=1e-6)
    final_softcap = cfg.number("final_logit_softcapping", default=None) or None
    window = cfg.integer("sliding_window", default=512, min=1) or 512
    return dict(
        num_hidden_layers=N, hidden_size=H, vocab_size=cfg.integer("vocab_size", default=262_144, min=1),
        max_position_embeddings=context_length,
        num_attention_heads=num_attention_heads, num_key_value_heads=nkv, head_dim=hd, layer_types=list(types),
        intermediate_size=[F * (2 if double_wide and i >= N - n_shared else 1) for i in range(N)],
        sliding_head_dim=hd_swa, global_head_dim=hd_full,
        sliding_window=window, num_kv_shared_layers=n_shared, hidden_size_per_layer_input=P,
        rope_theta=rope_theta, sliding_rope_theta=rope_theta_swa, sliding_rotary_dim=int(hd_swa * rope_factor_swa),
        rms_norm_eps=rms_eps, final_logit_softcapping=final_softcap,
        partial_rotary_factor=rope_factor, attention_k_eq_v=k_eq_v, **moe)


def _per_layer_config(section: ConfigReader) -> dict[int, ConfigReader]:
    """`per_layer_config` (transformers' form): layer number -> that layer's overrides."""
    out = {}
    for key in section.data:
        try:
            layer = int(key)
        except ValueError:
            raise section.error(key, "is not a layer number") from None
        out[layer] = section.section(key)
    return out
