"""The shape each graph expects of each tensor, from its hparams (ggml order, ne0 first, as GGUF
stores it and llama.cpp's `create_tensor` checks it), and the per-family consistency checks.

A dimension given as a string is a size the file chooses (the vocabulary "V", the EAGLE-3 draft
vocabulary "Vd", Gemma's per-layer vocabulary "Vp"): the first tensor that has it binds it and
every other must agree. Trailing dimensions count: the graphs index by them (a shape may list the
alternatives a graph accepts).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from specconv.archs.errors import SpecconvError

Shapes = dict[str, tuple]
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _common(hp, E: int) -> Shapes:
    return {"token_embd.weight": (E, "V"), "output.weight": (E, "V"), "output_norm.weight": (E,)}


def _nextn(E: int, n: int) -> Shapes:
    p = f"blk.{n}.nextn."
    return {p + "eh_proj.weight": (2 * E, E), p + "enorm.weight": (E,), p + "hnorm.weight": (E,),
            p + "shared_head_norm.weight": (E,), p + "embed_tokens.weight": (E, "V"),
            p + "shared_head_head.weight": (E, "V")}


# The families not yet on a tensor table; the others' graphs declare `expected_shapes`, derived from
# their table (archs/tensor_table.py).
EXPECTED: dict[str, Callable[[Any], Shapes]] = {}


def expected_shapes(hp, graph) -> Shapes:
    """From the graph's tensor table when it declares one (runtime/graphs/contract.py), else EXPECTED."""
    return graph.expected_shapes(hp) if graph.expected_shapes is not None else EXPECTED[hp.arch](hp)


# ---- per-family consistency --------------------------------------------------------------------

def check_arch_hparams(hp, kv: Mapping[str, Any]) -> None:
    a = hp.arch
    block_count = hp.n_layer + getattr(hp, "n_nextn", 0)
    for key in ("attention.recurrent_layers", "attention.sliding_window_pattern"):
        v = kv.get(f"{a}.{key}")
        if isinstance(v, list) and len(v) != block_count:
            raise SpecconvError(f"{a}.{key} has {len(v)} entries for block_count {block_count}")
    if a in _families.ARCH_HPARAMS:
        _families.ARCH_HPARAMS[a](hp)


CHECK_VALUES: dict[str, Callable[..., None]] = {}


# the families added later (hy_v3, step35, mimo2, glm-dsa / deepseek32, dflash); imported last, as it
# builds on the helpers above
from specconv.runtime import shapes_families as _families  # noqa: E402

EXPECTED.update(_families.EXPECTED)
CHECK_VALUES.update(_families.CHECK_VALUES)
