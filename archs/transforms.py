"""Weight transforms shared by plugins: pure functions of float32 tensors.

Plans bind their parameters with `functools.partial`, so every transform takes the list of source
tensors (in `TensorPlan.sources` order) as its only positional argument and stays picklable.
"""

from __future__ import annotations

import torch


def identity(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def plus_one(ts: list[torch.Tensor]) -> torch.Tensor:
    """Fold the `(1 + w)` of a zero-centred RMSNorm into a plain weight (llama.cpp multiplies by w)."""
    return ts[0] + 1.0


def reshape(ts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    return ts[0].reshape(shape)


def stack(ts: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert matrices -> one [E, ...] tensor, in source order (= expert order)."""
    return torch.stack(ts, dim=0)


def slice_axis(ts: list[torch.Tensor], dim: int, start: int, stop: int) -> torch.Tensor:
    return ts[0].narrow(dim, start, stop - start).contiguous()


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
