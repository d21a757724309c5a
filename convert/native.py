"""Loaders for the optional native encoders: Q8_0 (convert/_native.c) and K-quants (convert/_kquants.c).

The extension is optional: `pip install -e .` compiles it when a C compiler is present, and the
converter falls back to its pure-numpy kernels (same bytes, slower) when it is not built or
cannot be imported. `SPECCONV_NO_NATIVE=1` forces that fallback, so tests can exercise both paths.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable


def _extension(name: str):
    """The built extension module specconv.convert.<name>, or None when disabled or not built."""
    if os.environ.get("SPECCONV_NO_NATIVE") == "1":
        return None
    try:
        return importlib.import_module(f"specconv.convert.{name}")
    except ImportError:
        return None


def q8_0_native() -> Callable | None:
    """The extension's `q8_0(src, dst, bf16) -> bool`, or None when disabled or not built."""
    module = _extension("_native")
    return None if module is None else module.q8_0


def kquants_native() -> Callable | None:
    """The K-quant extension's `encode(ggml_type, src, dst, bf16) -> bool`, or None when disabled or not built."""
    module = _extension("_kquants")
    return None if module is None else module.encode


def kquants_weighted_native() -> Callable | None:
    """The K-quant extension's `encode_weighted(...)` (importance-weighted, convert/kq_weighted.h), or None."""
    module = _extension("_kquants")
    return None if module is None else module.encode_weighted
