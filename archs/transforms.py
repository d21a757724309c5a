"""Weight transforms shared by plugins: pure functions of numpy arrays (torch order, C layout).

Plans bind their parameters with `functools.partial`, so every transform takes the list of source
tensors (in `TensorPlan.sources` order) as its only positional argument and stays picklable.

A transform marked `@layout_only` only moves values (reshape, reorder, slice): it is exact in any
dtype, so the conversion engine runs it on the checkpoint's own dtype (half the bytes of float32,
and no copy at all for views; BF16 arrives as uint16 bit patterns). `@concatenates` further says the output is its inputs one after the
other, which lets the engine stream them without building the result. Unmarked transforms compute
values and always get float32 inputs.

The converter never imports torch (it costs seconds of start-up): values computed with a
transcendental function (`exp`, `pow`) are evaluated in float64 and rounded once to float32, i.e.
correctly rounded (docs/convert.md, "Computed values").
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np


def layout_only(fn: Callable) -> Callable:
    fn.layout_only = True
    return fn


def concatenates(fn: Callable) -> Callable:
    fn.layout_only = fn.concatenates = True
    return fn


def _marked(transform: Callable, mark: str) -> bool:
    while isinstance(transform, partial):
        transform = transform.func
    return bool(getattr(transform, mark, False))


def is_layout_only(transform: Callable) -> bool:
    return _marked(transform, "layout_only")


def is_concatenation(transform: Callable) -> bool:
    return _marked(transform, "concatenates")


@layout_only
def identity(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0]


def plus_one(ts: list[np.ndarray]) -> np.ndarray:
    """Fold the `(1 + w)` of a zero-centred RMSNorm into a plain weight (llama.cpp multiplies by w)."""
    return ts[0] + np.float32(1.0)


def constant(ts: list[np.ndarray], values: tuple[float, ...]) -> np.ndarray:
    """A generated float32 tensor (e.g. rope frequency factors); the source only anchors its place."""
    return np.array(values, dtype=np.float32)


@layout_only
def reshape(ts: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    return ts[0].reshape(shape)


@concatenates
def stack(ts: list[np.ndarray]) -> np.ndarray:
    """Per-expert matrices -> one [E, ...] tensor, in source order (= expert order)."""
    return np.stack(ts, axis=0)


@layout_only
def slice_axis(ts: list[np.ndarray], dim: int, start: int, stop: int) -> np.ndarray:
    """A view (no copy): the engine streams it as the contiguous blocks it is made of."""
    return ts[0][(slice(None),) * (dim % ts[0].ndim) + (slice(start, stop),)]


def retile_v_heads(t: np.ndarray, dim: int, nk: int, r: int, block: int) -> np.ndarray:
    """Reorder value heads along `dim` from HF's grouped order to llama.cpp's tiled order.

    HF groups the r value heads of each key head together (head h = g·r + j uses key head g);
    ggml broadcasts by tiling, so GGUF head n must use key head n mod nk. Viewing the axis as
    [nk, r, block] and swapping the first two axes gives exactly that: GGUF head n = j·nk + g holds
    HF head g·r + j.
    """
    if r == 1:
        return t
    dim = dim % t.ndim
    size = t.shape[dim]
    if size != nk * r * block:
        raise ValueError(f"axis {dim} has {size} entries, expected {nk}*{r}*{block}")
    shape = list(t.shape)
    grouped = t.reshape(shape[:dim] + [nk, r, block] + shape[dim + 1:])
    return np.ascontiguousarray(grouped.swapaxes(dim, dim + 1).reshape(shape))


def retile_tail(t: np.ndarray, dim: int, start: int, nk: int, r: int, block: int) -> np.ndarray:
    """Re-tile only the entries from `start` on along `dim` (the V part of a fused q|k|v axis)."""
    if r == 1:
        return t
    dim = dim % t.ndim
    lead = (slice(None),) * dim
    head, tail = t[lead + (slice(0, start),)], t[lead + (slice(start, None),)]
    return np.concatenate([head, retile_v_heads(tail, dim, nk, r, block)], axis=dim)


def exp(values: np.ndarray) -> np.ndarray:
    """float32 exp(values), correctly rounded (computed in float64, rounded once)."""
    return np.exp(values.astype(np.float64)).astype(np.float32)
