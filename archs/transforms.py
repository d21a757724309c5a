"""Weight transforms shared by plugins: pure functions of float32 tensors.

Plans bind their parameters with `functools.partial`, so every transform takes the list of source
tensors (in `TensorPlan.sources` order) as its only positional argument and stays picklable.

A transform marked `@layout_only` only moves values (reshape, reorder, slice): it is exact in any
dtype, so the conversion engine runs it on the checkpoint's own dtype (half the bytes of float32,
and no copy at all for views). `@concatenates` further says the output is its inputs one after the
other, which lets the engine stream them without building the result. Unmarked transforms compute
values and always get float32 inputs.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch


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
def identity(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def plus_one(ts: list[torch.Tensor]) -> torch.Tensor:
    """Fold the `(1 + w)` of a zero-centred RMSNorm into a plain weight (llama.cpp multiplies by w)."""
    return ts[0] + 1.0


@layout_only
def reshape(ts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    return ts[0].reshape(shape)


@concatenates
def stack(ts: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert matrices -> one [E, ...] tensor, in source order (= expert order)."""
    return torch.stack(ts, dim=0)


@layout_only
def slice_axis(ts: list[torch.Tensor], dim: int, start: int, stop: int) -> torch.Tensor:
    """A view (no copy): the engine streams it as the contiguous blocks it is made of."""
    return ts[0].narrow(dim, start, stop - start)


def retile_v_heads(t: torch.Tensor, dim: int, nk: int, r: int, block: int) -> torch.Tensor:
    """Reorder value heads along `dim` from HF's grouped order to llama.cpp's tiled order.

    HF groups the r value heads of each key head together (head h = g·r + j uses key head g);
    ggml broadcasts by tiling, so GGUF head n must use key head n mod nk. Viewing the axis as
    [nk, r, block] and swapping the first two axes gives exactly that: GGUF head n = j·nk + g holds
    HF head g·r + j.
    """
    if r == 1:
        return t
    dim = dim % t.dim()
    size = t.shape[dim]
    if size != nk * r * block:
        raise ValueError(f"axis {dim} has {size} entries, expected {nk}*{r}*{block}")
    shape = list(t.shape)
    grouped = t.reshape(shape[:dim] + [nk, r, block] + shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape).contiguous()


def retile_tail(t: torch.Tensor, dim: int, start: int, nk: int, r: int, block: int) -> torch.Tensor:
    """Re-tile only the entries from `start` on along `dim` (the V part of a fused q|k|v axis)."""
    if r == 1:
        return t
    head = t.narrow(dim, 0, start)
    tail = t.narrow(dim, start, t.shape[dim] - start)
    return torch.cat([head, retile_v_heads(tail, dim, nk, r, block)], dim=dim)
