"""Loader for the optional native Q8_0 encoder (convert/_native.c).

The extension is optional: `pip install -e .` compiles it when a C compiler is present, and the
converter falls back to its pure-numpy Q8_0 kernel (same bytes, slower) when it is not built or
cannot be imported. `SPECCONV_NO_NATIVE=1` forces that fallback, so tests can exercise both paths.
"""

from __future__ import annotations

import os
from typing import Callable


def q8_0_native() -> Callable | None:
    """The extension's `q8_0(src, dst, bf16) -> bool`, or None when disabled or not built."""
    if os.environ.get("SPECCONV_NO_NATIVE") == "1":
        return None
    try:
        from specconv.convert import _native
    except ImportError:
        return None
    return _native.q8_0
