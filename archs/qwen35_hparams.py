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

from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .rope_scaling import RopeScaling, rope_scaling_of

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class Qwen35Hparams:
    moe: bool
    num_hidden_layers: int
    hidden: int
    vocab: int
    num_attention_heads: int
    num_key_value_heads: int
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
    num_experts: int = 0
    num_experts_per_tok: int = 0
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


def layer_types_of(tc: ConfigReader, num_hidden_layers: int) -> tuple[str, ...]:
    """`layer_types`, or what transformers derives from `full_attention_interval` (default 4)."""
    types = tc.strings("layer_types", default=None)
    if types is None:
        interval = tc.integer("full_attention_interval", default=4, min=1)
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_hidden_layers))
    types = tuple(types)
    if len(types) != num_hidden_layers:
        raise tc.error("layer_types", f"has {len(types)} entries, num_hidden_layers is {num_hidden_layers}")
    bad = sorted({t for t in types if t not in (LINEAR, FULL)})
    if bad:
        raise tc.error("layer_types", f"holds unknown layer type(s) {', '.join(bad)} "
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


def _rope_sections(tc: ConfigReader, rope_dim: int) -> tuple[int, int, int, int]:
    """`mrope_section` padded to 4, or [rot/2, 0, 0, 0]; must add up to rot/2 (llama.cpp asserts)."""
    if rope_dim % 2:
        raise SpecconvError(f"rotary dimension {rope_dim} (head_dim * partial_rotary_factor) is odd")
    section = tc.with_rope().integers("mrope_section", default=None)
    if section is None:
        return (rope_dim // 2, 0, 0, 0)
    if len(section) > 4:
        raise SpecconvError(f"config.json: mrope_section {section} has more than 4 entries")
    padded = tuple(section + [0] * (4 - len(section)))
    if sum(padded) != rope_dim // 2:
        raise SpecconvError(f"config.json: mrope_section {section} sums to {sum(padded)}, but the rotary "
                            f"dimension {rope_dim} needs sections summing to {rope_dim // 2}")
    return padded  # type: ignore[return-value]


def parse_hparams(config: Mapping[str, Any], moe: bool) -> Qwen35Hparams:
    cfg = ConfigReader(config)
    tc = cfg.text_model()
    num_hidden_layers = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
    hidden = tc.integer("hidden_size", min=1)
    num_attention_heads = tc.integer("num_attention_heads", min=1)
    head_dim = tc.integer("head_dim", default=hidden // num_attention_heads, min=1)
    nk = tc.integer("linear_num_key_heads", default=16, min=1)
    nv = tc.integer("linear_num_value_heads", default=32, min=1)
    dk = tc.integer("linear_key_head_dim", default=128, min=1)
    dv = tc.integer("linear_value_head_dim", default=128, min=1)
    if dk != dv:
        raise SpecconvError(f"config.json: linear_key_head_dim ({dk}) != linear_value_head_dim ({dv}); "
                            f"llama.cpp's qwen35 loader uses one ssm.state_size for both")
    if nv % nk:
        raise SpecconvError(f"config.json: linear_num_value_heads ({nv}) is not a multiple of "
                            f"linear_num_key_heads ({nk})")

    # llama.cpp's qwen35 graphs have no attention biases and hard-code SiLU.
    if tc.flag("attention_bias", default=False):
        raise SpecconvError("config.json: attention_bias=true is not supported (llama.cpp's qwen35 has no "
                            "attention biases)")
    act = tc.string("hidden_act", default="silu")
    if act != "silu":
        raise SpecconvError(f"config.json: hidden_act {act!r} is not supported (qwen35 uses silu)")

    factor = tc.with_rope().number("partial_rotary_factor", default=0.25)
    if not 0 < factor <= 1:
        raise SpecconvError(f"config.json: partial_rotary_factor {factor} is not in (0, 1]")
    rope_dim = int(head_dim * factor)
    types = layer_types_of(tc, num_hidden_layers)
    configured_interval = tc.integer("full_attention_interval", default=None)

    # The wrapper's own flag governs tying in transformers (model.config is the outer config).
    tie = cfg.flag("tie_word_embeddings", default=tc.flag("tie_word_embeddings", default=False))
    mtp_cfg = tc.integer("mtp_num_hidden_layers", default=cfg.integer("mtp_num_hidden_layers", default=0))
    if tc.flag("mtp_use_dedicated_embeddings", default=False):
        raise SpecconvError("config.json: mtp_use_dedicated_embeddings=true is not supported "
                            "(llama.cpp's qwen35 MTP head uses the trunk embedding)")

    extra: dict[str, int] = {}
    if moe:
        extra = dict(num_experts=tc.integer("num_experts", min=1), num_experts_per_tok=tc.integer("num_experts_per_tok", min=1),
                     expert_ffn=tc.integer("moe_intermediate_size", min=1),
                     shared_ffn=tc.integer("shared_expert_intermediate_size", min=1))
        if extra["num_experts_per_tok"] > extra["num_experts"]:
            raise SpecconvError(f"config.json: num_experts_per_tok ({extra['num_experts_per_tok']}) exceeds "
                                f"num_experts ({extra['num_experts']})")

    return Qwen35Hparams(
        moe=moe, num_hidden_layers=num_hidden_layers, hidden=hidden, vocab=tc.integer("vocab_size", min=1), num_attention_heads=num_attention_heads,
        num_key_value_heads=tc.integer("num_key_value_heads", default=num_attention_heads, min=1), head_dim=head_dim,
        ffn=None if moe else tc.integer("intermediate_size", min=1), layer_types=types,
        nk=nk, nv=nv, dk=dk, dv=dv, conv_kernel=tc.integer("linear_conv_kernel_dim", default=4, min=1),
        context_length=tc.integer("max_position_embeddings", default=32768, min=1),
        rms_eps=tc.number("rms_norm_eps", default=1e-6) or 1e-6,
        rope_theta=tc.with_rope().number("rope_theta", default=10000.0),
        rope_dim=rope_dim, rope_sections=_rope_sections(tc, rope_dim),
        rope_scaling=rope_scaling_of(tc, "Qwen3.5", unscaled=("default", "mrope")),
        full_attention_interval=attention_interval(types, configured_interval),
        tie_embeddings=tie, mtp_layers_config=mtp_cfg, **extra,
    )
