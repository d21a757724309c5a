"""Rope scaling from config.json (linear or YaRN), read the same way for every family that has it.

The type sits in `rope_type` (top level, `rope_parameters` or `rope_scaling`, transformers v5) or
the pre-v5 `rope_scaling.type`; its fields beside it. archs/metadata.py writes it to GGUF.
"""

from __future__ import annotations

import math
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·mscale·ln(factor) + 1 (1 for factor <= 1), as transformers has it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling_of(tc: ConfigReader, family: str, kinds: tuple[str, ...] = ("linear", "yarn"),
                    unscaled: tuple[str, ...] = ("default",), mscale: bool = False) -> RopeScaling | None:
    """The text config `tc`'s rope scaling of one of `kinds`, None for a type in `unscaled` or none.
    `mscale`: the family writes DeepSeek's `mscale_all_dim` (its graphs and llama.cpp's derive the
    attention factor from it); otherwise a YaRN config with both `mscale` and `mscale_all_dim` and no
    `attention_factor` has its attention factor resolved here as transformers resolves it
    (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)), so the file states it."""
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
    if rope.flag("truncate", default=True) is False:  # transformers' unfloored correction range (gpt-oss)
        raise SpecconvError("config.json: yarn rope scaling with 'truncate': false is not supported "
                            "(the runtime and llama.cpp floor / ceil YaRN's correction range)")
    attn_factor = rope.number("attention_factor", "attn_factor", default=None)
    m, m_all = rope.number("mscale", default=None), rope.number("mscale_all_dim", default=None)
    if attn_factor is None and not mscale and m and m_all:
        attn_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    return RopeScaling("yarn", factor, orig, rope.number("extrapolation_factor", default=None), attn_factor,
                       rope.number("beta_fast", default=None), rope.number("beta_slow", default=None),
                       m_all if mscale else None)
