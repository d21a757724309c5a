"""A DFlash / DFlash2 drafter's hyperparameters (docs/dflash.md): one dataclass under the names of
its config.json (a Qwen3 config plus `dflash_config`), built from it and the target's config by the
plugin (archs/dflash.py, `from_config`) and from GGUF metadata by the graph (runtime/graphs/dflash.py,
`from_kv`); the DFlash table's shapes read it. A quantity the file names otherwise keeps the
config's name and its GGUF key beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from . import names
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import FamilyHParams, HParamsReader
from .tensor_table import AttentionWidths

CONV_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # DFlash2's dflash_config


@dataclass(kw_only=True)
class DFlashHParams(AttentionWidths, FamilyHParams):
    arch: str = names.DFLASH
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # head_dim · partial_rotary_factor (GGUF rope.dimension_count)
    intermediate_size: int
    rope_theta: float | None = None  # None: not stated (llama.cpp's 10000 applies)
    rms_norm_eps: float = 1e-6
    states_head_dim: bool = False  # head_dim stated (config.json's head_dim; GGUF attention.key_length)
    states_rotary_dim: bool = False  # partial_rotary_factor stated (GGUF rope.dimension_count)
    block_size: int = 16  # the anchor and block_size - 1 masks
    target_layers: list[int] = field(default_factory=list)  # target layer INPUTS (llama.cpp's convention)
    mask_token_id: int = 0  # GGUF tokenizer.ggml.mask_token_id
    causal: bool | None = None  # is_causal / dflash_config.causal (GGUF attention.causal); None: not stated
    target_mrope: bool = False  # the target ropes by M-RoPE sections: the draft on the temporal one only
    attention_value_scale: float | None = None  # GGUF attention.value_scale
    sliding_window: int = 0  # of the layers marked in sliding_window_pattern (0: none)
    sliding_window_pattern: list[bool] = field(default_factory=list)
    # DFlash2: dynamic convolutions (kernel taps, channels per group) and the candidate selector
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # applied (with soft-capping) only before DFlash2's selector, as llama.cpp
    output_multiplier: float | None = None  # GGUF logit_scale
    final_logit_softcapping: float | None = None  # None: no capping
    input_embedding_scale: float | None = None  # GGUF embedding_scale

    @property
    def v2(self) -> bool:
        return self.selector_top_k > 0

    @property
    def input_width(self) -> int:
        """Width of one context row: the k target layers' hidden states, concatenated."""
        return len(self.target_layers) * self.hidden_size

    @property
    def conv_proj(self) -> int:
        """Rows of DFlash2's kernel projection: both sides, every tap, one coefficient per channel group."""
        return 2 * self.conv_kernel_size * (self.hidden_size // self.conv_group_size)

    def conv_sizes(self) -> dict[str, int]:
        """DFlash2's convolution and selector sizes by their dflash_config (and GGUF) names."""
        return {"conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
                "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k}

    @property
    def rope_freq_base(self) -> float:
        return 10000.0 if self.rope_theta is None else self.rope_theta

    @classmethod
    def from_config(cls, config: Mapping[str, Any], target_config: Mapping[str, Any],
                    target_layers: Sequence[int] | None = None) -> "DFlashHParams":
        """From the drafter's config.json and its target's; `target_layers`: --target-layers (layer
        inputs), else the config's target_layer_ids (layer outputs) + 1."""
        cfg = ConfigReader(config)
        dcfg = cfg.section("dflash_config")
        v2 = "DFlash2DraftModel" in cfg.strings("architectures", default=[]) or dcfg.has("conv_kernel_size")
        target = ConfigReader(target_config, file="the target's config.json").text_model()
        hidden, layer_count = cfg.integer("hidden_size", min=1), cfg.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        heads, n_kv, head_dim = cfg.attention_heads()
        ffn = cfg.integer("intermediate_size", min=1)
        vocab, target_layer_count = target.integer("vocab_size", min=1), target.integer("num_hidden_layers", min=1,
                                                                                         max=MAX_LAYERS)
        target_h = target.integer("hidden_size", min=1)
        if target_h != hidden:
            raise SpecconvError(f"the DFlash drafter's hidden size {hidden} differs from the target's "
                                f"{target_h}: wrong --target (fc reads k target rows of its own width)")
        own_vocab = cfg.integer("vocab_size", default=None)
        if own_vocab is not None and own_vocab != vocab:
            raise SpecconvError(f"the DFlash drafter was trained for a vocabulary of {own_vocab} tokens, the "
                                f"target has {vocab}: wrong --target")
        if cfg.string("hidden_act", default="silu") != "silu" or cfg.flag("attention_bias", default=False):
            raise SpecconvError("this DFlash drafter uses another activation than silu or attention biases, which "
                                "llama.cpp's dflash graph does not have")
        conv = {k: dcfg.integer(k, min=1) for k in CONV_KEYS} if v2 else {}
        if v2 and hidden % conv["conv_group_size"]:
            raise SpecconvError(f"DFlash2 hidden size {hidden} is not a multiple of conv_group_size "
                                f"{conv['conv_group_size']}")
        block_size = dcfg.integer("block_size", default=cfg.integer("block_size", default=16))
        if block_size < 2:
            raise SpecconvError(f"DFlash block_size {block_size} must be ≥ 2 (the anchor and one mask)")
        mask = dcfg.integer("mask_token_id", default=None, min=None)
        if mask is None or not 0 <= mask < vocab:
            raise SpecconvError(f"dflash_config.mask_token_id {mask!r} is missing or outside the vocabulary "
                                f"[0, {vocab})")
        layers, _ = target_layers_of(cfg, target_layer_count, target_layers)
        return cls(num_hidden_layers=layer_count, hidden_size=hidden, vocab_size=vocab, num_attention_heads=heads,
                   num_key_value_heads=n_kv, head_dim=head_dim, intermediate_size=ffn, block_size=block_size,
                   mask_token_id=mask, target_layers=layers, **conv, **_rope_and_norms(cfg, target, head_dim),
                   **_attention_options(cfg, layer_count), **_output_transforms(cfg))

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "DFlashHParams":
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        hidden_size, heads, head_dim = r.attention_widths()
        layers = key("target_layers", None, list)
        if not layers:
            raise SpecconvError(f"GGUF metadata lacks {arch}.target_layers (the target layers a DFlash drafter reads)")
        mask = kv.get(names.MASK_TOKEN_ID_KEY)
        if mask is None:
            raise SpecconvError(f"GGUF metadata lacks {names.MASK_TOKEN_ID_KEY} (the DFlash block's mask token)")
        if r.has("hyper_connection_count"):
            raise SpecconvError(f"{arch}.hyper_connection_count: DSpark (DeepSeek-V4 stage) drafters are not "
                                f"supported by specconv's runtime (llama.cpp runs them)")
        num_hidden_layers = key("block_count", type=int)
        window = key("attention.sliding_window", 0, int)
        pattern = [bool(x) for x in key("attention.sliding_window_pattern", [], list)] if window else []
        if window and len(pattern) != num_hidden_layers:
            raise SpecconvError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                                f"{num_hidden_layers} layers")
        sections = key("rope.dimension_sections", None, list)
        rotary_dim = key("rope.dimension_count", head_dim, int)
        if sections is not None and [int(x) for x in sections] != [rotary_dim // 2, 0, 0, 0]:
            raise SpecconvError(f"{arch}.rope.dimension_sections {list(sections)}: only the temporal section "
                                f"[{rotary_dim // 2}, 0, 0, 0] (drafts for M-RoPE targets) is supported")
        conv = {k: key(k, 0, int) for k in CONV_KEYS}
        if conv["selector_top_k"] and not (conv["conv_kernel_size"] > 0 and conv["conv_group_size"] > 0
                                           and hidden_size % conv["conv_group_size"] == 0
                                           and conv["selector_rank"] > 0):
            raise SpecconvError(f"{arch}: DFlash2 file with incomplete conv / selector metadata")
        tokens = kv.get("tokenizer.ggml.tokens")
        return cls(arch=arch, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size, num_attention_heads=heads,
                   num_key_value_heads=key("attention.head_count_kv", heads, int), head_dim=head_dim,
                   rotary_dim=rotary_dim, rope_theta=key("rope.freq_base", None, float),
                   rms_norm_eps=key("attention.layer_norm_rms_epsilon", type=float),
                   intermediate_size=key("feed_forward_length", type=int), block_size=key("block_size", 16, int),
                   target_layers=[int(j) for j in layers], mask_token_id=int(mask),
                   causal=key("attention.causal", None, bool), target_mrope=sections is not None,
                   attention_value_scale=key("attention.value_scale", None, float), sliding_window=window,
                   sliding_window_pattern=pattern, **conv, output_multiplier=key("logit_scale", None, float),
                   final_logit_softcapping=key("final_logit_softcapping", None, float),
                   input_embedding_scale=key("embedding_scale", None, float),
                   vocab_size=len(tokens) if tokens is not None else 0,
                   max_position_embeddings=key("context_length", 0, int),
                   states_head_dim=r.has("attention.key_length"), states_rotary_dim=r.has("rope.dimension_count"),
                   from_file=True)


def target_layers_of(cfg: ConfigReader, target_layer_count: int,
                     override: Sequence[int] | None = None) -> tuple[list[int], str]:
    """(layer inputs of the target (llama.cpp's convention), where they came from): `override`
    (--target-layers), else the config's output ids + 1."""
    if override is not None:
        layers, source = [int(i) for i in override], "--target-layers (layer inputs)"
    else:
        dcfg = cfg.section("dflash_config")
        ids = dcfg.integers("target_layer_ids", default=cfg.integers("target_layer_ids", default=None))
        if not ids:
            raise SpecconvError("the DFlash config has no dflash_config.target_layer_ids; give --target-layers "
                                "(layer inputs)")
        layers, source = [i + 1 for i in ids], f"dflash_config.target_layer_ids {ids} (layer outputs) + 1"
    bad = [j for j in layers if not 0 <= j <= target_layer_count]
    if bad:
        raise SpecconvError(f"target layer input {bad[0]} (from {source}) is outside 0..{target_layer_count}: the "
                            f"target has {target_layer_count} layers; wrong --target?")
    return layers, source


def _rope_and_norms(cfg: ConfigReader, target: ConfigReader, head_dim: int) -> dict[str, Any]:
    rope = cfg.with_rope()
    kind = rope.string("rope_type", default=None) or cfg.section("rope_scaling").string("type", default=None)
    if kind not in (None, "default"):
        raise SpecconvError(f"DFlash rope scaling {kind!r} is not supported (default rope only)")
    partial = rope.number("partial_rotary_factor", default=None)
    target_rope = target.section("rope_parameters")
    if not target_rope.data:
        target_rope = target.section("rope_scaling")
    return dict(rope_theta=rope.number("rope_theta", default=None),
                rms_norm_eps=cfg.number("rms_norm_eps", default=1e-6),
                states_head_dim=cfg.has("head_dim"), states_rotary_dim=partial is not None,
                rotary_dim=head_dim if partial is None else int(head_dim * partial),
                max_position_embeddings=cfg.integer("max_position_embeddings", default=None) or 0,
                target_mrope="mrope_section" in target_rope.data)


def _attention_options(cfg: ConfigReader, layer_count: int) -> dict[str, Any]:
    """Causality, the value scale and the sliding window (written only with a window and its use on)."""
    dcfg = cfg.section("dflash_config")
    is_causal = cfg.flag("is_causal", default=None)
    swa_all = dcfg.flag("use_swa", default=False)
    window = dcfg.integer("swa_window_size", default=None) or cfg.integer("sliding_window", default=None)
    windowed = bool((cfg.flag("use_sliding_window", default=False) or swa_all) and window)
    pattern = ([True] * layer_count if swa_all else
               [t == "sliding_attention" for t in cfg.strings("layer_types", default=None) or []]) if windowed else []
    return dict(causal=is_causal if is_causal is not None else dcfg.flag("causal", default=None),
                attention_value_scale=dcfg.number("attention_value_scale", default=None),
                sliding_window=window if windowed else 0, sliding_window_pattern=pattern)


def _output_transforms(cfg: ConfigReader) -> dict[str, Any]:
    """DFlash2's logit scale, soft-capping (> 0 only) and embedding scale: from dflash_config, else the top."""
    def number(name: str) -> float | None:
        return cfg.section("dflash_config").number(name, default=cfg.number(name, default=None))
    softcap = number("final_logit_softcapping")
    return dict(output_multiplier=number("output_multiplier"),
                final_logit_softcapping=softcap if softcap is not None and softcap > 0 else None,
                input_embedding_scale=number("input_embedding_scale"))
