"""Qwen3.5 / 3.6 (dense and MoE) hyperparameters read from config.json, checked once.

Configs come in two shapes: text-only (`Qwen3_5ForCausalLM`, fields at top level) and the VL
releases (`Qwen3_5ForConditionalGeneration`, fields under `text_config`). Rope fields may sit at the
top of the text config (Hub) or inside `rope_parameters` / `rope_scaling` (transformers v5). Both
give the same result here. Defaults are transformers' own class defaults, so a field missing from
config.json means what it means to transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .base import config_field, text_config
from .errors import SpecconvError

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" | "yarn"
    factor: float
    original_context: int | None = None
    ext_factor: float | None = None
    attn_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None


@dataclass(frozen=True)
class Qwen35Hparams:
    moe: bool
    n_layer: int
    hidden: int
    vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ffn: int | None  # dense MLP width (None for MoE)
    layer_types: tuple[str, ...]
    nk: int
    nv: int
    dk: int
    dv: int
    conv_kernel: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    rope_sections: tuple[int, int, int, int]
    rope_scaling: RopeScaling | None
    full_attention_interval: int
    tie_embeddings: bool
    mtp_layers_config: int  # 0 when absent
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0

    @property
    def r(self) -> int:
        """Value heads per key head."""
        return self.nv // self.nk

    @property
    def qk_channels(self) -> int:
        return 2 * self.nk * self.dk

    @property
    def conv_channels(self) -> int:
        return 2 * self.nk * self.dk + self.nv * self.dv

    @property
    def recurrent(self) -> list[bool]:
        return [t == LINEAR for t in self.layer_types]


def _int(cfg: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = cfg.get(name, default)
    if value is None:
        raise SpecconvError(f"config.json lacks '{name}', needed for a Qwen3.5 model")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecconvError(f"config.json: '{name}' must be a non-negative integer, got {value!r}")
    return value


def _positive(cfg: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = _int(cfg, name, default)
    if value == 0:
        raise SpecconvError(f"config.json: '{name}' must be positive, got 0")
    return value


def layer_types_of(tc: Mapping[str, Any], n_layer: int) -> tuple[str, ...]:
    """`layer_types`, or what transformers derives from `full_attention_interval` (default 4)."""
    types = tc.get("layer_types")
    if types is None:
        interval = _positive(tc, "full_attention_interval", 4)
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layer))
    types = tuple(types)
    if len(types) != n_layer:
        raise SpecconvError(f"config.json: layer_types has {len(types)} entries, "
                            f"num_hidden_layers is {n_layer}")
    bad = sorted({t for t in types if t not in (LINEAR, FULL)})
    if bad:
        raise SpecconvError(f"config.json: unknown layer type(s) {', '.join(map(str, bad))} in layer_types "
                            f"(Qwen3.5 knows '{LINEAR}' and '{FULL}')")
    return types


def attention_interval(types: tuple[str, ...], configured: int | None) -> int:
    """The `full_attention_interval` to write: a period p with full(i) == ((i+1) % p == 0) for all i.

    transformers v5 does not save `full_attention_interval`, so the config value (or the default 4)
    can be stale; llama.cpp falls back to it when `recurrent_layers` is missing. Prefer the configured
    value when it matches the layers, else the smallest period that does. When `layer_types` has no
    period at all the key cannot be right; `recurrent_layers` (always written) is what counts then.
    """
    def fits(p: int) -> bool:
        return all((t == FULL) == ((i + 1) % p == 0) for i, t in enumerate(types))

    preferred = configured if configured else 4
    if fits(preferred):
        return preferred
    for p in range(1, len(types) + 2):
        if fits(p):
            return p
    return preferred


def _rope_sections(tc: Mapping[str, Any], rope_dim: int) -> tuple[int, int, int, int]:
    """`mrope_section` padded to 4, or [rot/2, 0, 0, 0]; must add up to rot/2 (llama.cpp asserts)."""
    if rope_dim % 2:
        raise SpecconvError(f"rotary dimension {rope_dim} (head_dim * partial_rotary_factor) is odd")
    section = config_field(tc, "mrope_section")
    if section is None:
        return (rope_dim // 2, 0, 0, 0)
    section = [int(s) for s in section]
    if len(section) > 4:
        raise SpecconvError(f"config.json: mrope_section {section} has more than 4 entries")
    padded = tuple(section + [0] * (4 - len(section)))
    if sum(padded) != rope_dim // 2:
        raise SpecconvError(f"config.json: mrope_section {section} sums to {sum(padded)}, but the rotary "
                            f"dimension {rope_dim} needs sections summing to {rope_dim // 2}")
    return padded  # type: ignore[return-value]


def _rope_scaling(tc: Mapping[str, Any]) -> RopeScaling | None:
    kind = config_field(tc, "rope_type")
    if kind is None and isinstance(tc.get("rope_scaling"), Mapping):
        kind = tc["rope_scaling"].get("type")  # pre-v5 spelling
    if kind in (None, "default", "mrope"):
        return None
    factor = config_field(tc, "factor")
    if kind not in ("linear", "yarn") or factor is None:
        raise SpecconvError(f"config.json: rope scaling type {kind!r} is not supported for Qwen3.5 "
                            f"(supported: default, linear, yarn with a factor)")
    if kind == "linear":
        return RopeScaling("linear", float(factor))
    orig = config_field(tc, "original_max_position_embeddings")
    if orig is None:
        raise SpecconvError("config.json: yarn rope scaling needs 'original_max_position_embeddings'")

    def opt(name: str, alt: str | None = None) -> float | None:
        v = config_field(tc, name)
        if v is None and alt:
            v = config_field(tc, alt)
        return None if v is None else float(v)

    return RopeScaling("yarn", float(factor), int(orig), opt("extrapolation_factor"),
                       opt("attention_factor", "attn_factor"), opt("beta_fast"), opt("beta_slow"))


def parse_hparams(config: Mapping[str, Any], moe: bool) -> Qwen35Hparams:
    tc = text_config(config)
    n_layer = _positive(tc, "num_hidden_layers")
    hidden = _positive(tc, "hidden_size")
    n_head = _positive(tc, "num_attention_heads")
    head_dim = _positive(tc, "head_dim", hidden // n_head)
    nk = _positive(tc, "linear_num_key_heads", 16)
    nv = _positive(tc, "linear_num_value_heads", 32)
    dk = _positive(tc, "linear_key_head_dim", 128)
    dv = _positive(tc, "linear_value_head_dim", 128)
    if dk != dv:
        raise SpecconvError(f"config.json: linear_key_head_dim ({dk}) != linear_value_head_dim ({dv}); "
                            f"llama.cpp's qwen35 loader uses one ssm.state_size for both")
    if nv % nk:
        raise SpecconvError(f"config.json: linear_num_value_heads ({nv}) is not a multiple of "
                            f"linear_num_key_heads ({nk})")

    # llama.cpp's qwen35 graphs have no attention biases and hard-code SiLU.
    if tc.get("attention_bias"):
        raise SpecconvError("config.json: attention_bias=true is not supported (llama.cpp's qwen35 has no "
                            "attention biases)")
    if tc.get("hidden_act", "silu") != "silu":
        raise SpecconvError(f"config.json: hidden_act {tc['hidden_act']!r} is not supported (qwen35 uses silu)")

    factor = float(config_field(tc, "partial_rotary_factor", 0.25))
    rope_dim = int(head_dim * factor)
    types = layer_types_of(tc, n_layer)
    configured_interval = tc.get("full_attention_interval")

    # The wrapper's own flag governs tying in transformers (model.config is the outer config).
    tie = config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))
    mtp_cfg = tc.get("mtp_num_hidden_layers", config.get("mtp_num_hidden_layers")) or 0
    if isinstance(mtp_cfg, bool) or not isinstance(mtp_cfg, int) or mtp_cfg < 0:
        raise SpecconvError(f"config.json: 'mtp_num_hidden_layers' must be a non-negative integer, got {mtp_cfg!r}")
    if tc.get("mtp_use_dedicated_embeddings"):
        raise SpecconvError("config.json: mtp_use_dedicated_embeddings=true is not supported "
                            "(llama.cpp's qwen35 MTP head uses the trunk embedding)")

    extra: dict[str, int] = {}
    if moe:
        extra = dict(n_expert=_positive(tc, "num_experts"), n_expert_used=_positive(tc, "num_experts_per_tok"),
                     expert_ffn=_positive(tc, "moe_intermediate_size"),
                     shared_ffn=_positive(tc, "shared_expert_intermediate_size"))
        if extra["n_expert_used"] > extra["n_expert"]:
            raise SpecconvError(f"config.json: num_experts_per_tok ({extra['n_expert_used']}) exceeds "
                                f"num_experts ({extra['n_expert']})")

    return Qwen35Hparams(
        moe=moe, n_layer=n_layer, hidden=hidden, vocab=_positive(tc, "vocab_size"), n_head=n_head,
        n_head_kv=_positive(tc, "num_key_value_heads", n_head), head_dim=head_dim,
        ffn=None if moe else _positive(tc, "intermediate_size"), layer_types=types,
        nk=nk, nv=nv, dk=dk, dv=dv, conv_kernel=_positive(tc, "linear_conv_kernel_dim", 4),
        context_length=_positive(tc, "max_position_embeddings", 32768),
        rms_eps=float(tc.get("rms_norm_eps") or 1e-6),
        rope_theta=float(config_field(tc, "rope_theta", 10000.0)),
        rope_dim=rope_dim, rope_sections=_rope_sections(tc, rope_dim), rope_scaling=_rope_scaling(tc),
        full_attention_interval=attention_interval(types, configured_interval),
        tie_embeddings=bool(tie), mtp_layers_config=mtp_cfg, **extra,
    )
