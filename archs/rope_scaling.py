"""Rope scaling from config.json (linear or YaRN), read the same way for every family that has it.

The type sits in `rope_type` (top level, `rope_parameters` or `rope_scaling`, transformers v5) or
the pre-v5 `rope_scaling.type`; its fields beside it. archs/metadata.py writes it to GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config_reader import ConfigReader
from .errors import SpecconvError


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling as written to GGUF (rope.scaling.*); None fields are not written."""
    kind: str  # "linear" | "yarn"
    factor: float
    original_context: int | None = None  # yarn only, from here on
    ext_factor: float | None = None
    attn_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale_all_dim: float | None = None  # DeepSeek's; written by that family (a legacy encoding)


def rope_scaling_of(tc: ConfigReader, family: str, kinds: tuple[str, ...] = ("linear", "yarn"),
                    unscaled: tuple[str, ...] = ("default",), mscale: bool = False) -> RopeScaling | None:
    """The text config `tc`'s rope scaling of one of `kinds`, None for a type in `unscaled` or none;
    `mscale`: also DeepSeek's `mscale_all_dim`."""
    rope = tc.with_rope()
    kind = rope.string("rope_type", default=None)
    if kind is None:
        kind = tc.section("rope_scaling").string("type", default=None)  # pre-v5 spelling
    if kind is None or kind in unscaled:
        return None
    factor = rope.number("factor", default=None)
    if kind not in kinds or factor is None:
        raise SpecconvError(f"config.json: rope scaling type {kind!r} is not supported for {family} "
                            f"(supported: {', '.join(unscaled)}; {', '.join(kinds)} with a factor)")
    if kind == "linear":
        return RopeScaling("linear", factor)
    orig = rope.integer("original_max_position_embeddings", default=None)
    if orig is None:
        raise SpecconvError("config.json: yarn rope scaling needs 'original_max_position_embeddings'")
    return RopeScaling("yarn", factor, orig, rope.number("extrapolation_factor", default=None),
                       rope.number("attention_factor", "attn_factor", default=None),
                       rope.number("beta_fast", default=None), rope.number("beta_slow", default=None),
                       rope.number("mscale_all_dim", default=None) if mscale else None)
