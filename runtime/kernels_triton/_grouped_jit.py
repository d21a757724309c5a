"""Triton kernels of a grouped product: the same activation rows times up to four packed matrices of one
type and one inner dimension in one launch (imported on first use; needs Triton).

A program id of the flat grid maps to (matrix g, tile of BLOCK_N weight rows, piece along the inner
dimension); matrix g owns the programs from end[g-1] to end[g]. Each program runs the single-matrix
kernel's sums (_quant_jit._tile_sums) over that matrix's own tiling and split plan, so every output
is the sequence of float32 operations a one-matrix launch runs. Per-matrix scalars arrive as four
arguments each (unused slots repeat the first matrix's) and are picked by g.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specconv.runtime.kernels_triton._pointwise_jit import NO_ACTIVATION
from specconv.runtime.kernels_triton._quant_jit import _dot_sums, _parts_sum, _tile_sums
from specconv.runtime.kernels_triton._tail_jit import _last_arrival


@triton.jit
def _pick(g, v0, v1, v2, v3):
    """v_g of four scalars, g in 0..3."""
    return tl.where(g == 0, v0, tl.where(g == 1, v1, tl.where(g == 2, v2, v3)))


@triton.jit
def _matrix(end0, end1, end2):
    """The matrix of this program (the first g with program id < end[g]) and its first program."""
    pid = tl.program_id(0)
    g = (pid >= end0).to(tl.int32) + (pid >= end1).to(tl.int32) + (pid >= end2).to(tl.int32)
    return g, pid - _pick(g, 0, end0, end1, end2)


@triton.jit(do_not_specialize=["n_blocks", "total_rows", "per_split0", "per_split1", "per_split2", "per_split3",
                               "end0", "end1", "end2", "y_at0", "y_at1", "y_at2", "y_at3",
                               "part_at0", "part_at1", "part_at2", "part_at3",
                               "count_at0", "count_at1", "count_at2", "count_at3"])
def grouped_rows_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, y_ptr, part_ptr, count_ptr, n_in, n_blocks, total_rows,
                        stride_x, stride_w0, stride_w1, stride_w2, stride_w3, n_out0, n_out1, n_out2, n_out3,
                        per_split0, per_split1, per_split2, per_split3, end0, end1, end2,
                        y_at0, y_at1, y_at2, y_at3, part_at0, part_at1, part_at2, part_at3,
                        count_at0, count_at1, count_at2, count_at3,
                        QTYPE: tl.constexpr, VALUES: tl.constexpr, BYTES: tl.constexpr, ROWS: tl.constexpr,
                        ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, LAST_ADDS: tl.constexpr,
                        DOT: tl.constexpr, WIDE: tl.constexpr):
    """y_g[m, n] = Σ_k x[m, k] W_g[n, k]: y_g a contiguous [ROWS, n_out_g] block at y + y_at_g. A matrix
    cut into pieces (per_split_g < n_blocks) writes its float32 sums to part + part_at_g, laid out
    [pieces, ROWS, n_out_g] as the single-matrix kernel's; with LAST_ADDS the last piece of a tile to
    finish adds them in order into y_g (the single-matrix kernel's _last_arrival, the tile's counter
    at count + count_at_g + tile), else grouped_sum_kernel does."""
    g, local = _matrix(end0, end1, end2)
    n_out = _pick(g, n_out0, n_out1, n_out2, n_out3)
    per_split = _pick(g, per_split0, per_split1, per_split2, per_split3)
    stride_w = _pick(g, stride_w0, stride_w1, stride_w2, stride_w3)
    splits = (n_blocks + per_split - 1) // per_split
    w_ptr = w0_ptr
    if g == 1:
        w_ptr = w1_ptr
    if g == 2:
        w_ptr = w2_ptr
    if g == 3:
        w_ptr = w3_ptr
    tile = local // splits
    piece = local - tile * splits
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = n < n_out
    rows = w_ptr + n.to(tl.int64) * stride_w
    first = piece * per_split
    last = tl.minimum(first + per_split, n_blocks)
    if DOT:  # the single-matrix kernel's tensor-core sums (ROWS_P2 is DOT_ROWS)
        acc = _dot_sums(x_ptr, rows, row_ok, n_in, first, last, stride_x, ROWS, BLOCK_N, NB, WIDE)
    else:
        acc = _tile_sums(x_ptr, x_ptr, rows, row_ok, n_in, first, last, stride_x, 0, QTYPE, VALUES, BYTES, ROWS,
                         ROWS_P2, BLOCK_N, NB, NO_ACTIVATION)
    m_index = tl.arange(0, ROWS_P2)
    keep = (m_index[:, None] < ROWS) & row_ok[None, :]
    out_row = m_index.to(tl.int64)[:, None]
    y_at = _pick(g, y_at0, y_at1, y_at2, y_at3).to(tl.int64)
    if splits > 1:
        part_at = _pick(g, part_at0, part_at1, part_at2, part_at3).to(tl.int64)
        values = out_row * n_out + n[None, :]  # this tile's values in each part [ROWS, n_out]
        tl.store(part_ptr + part_at + piece.to(tl.int64) * total_rows * n_out + values, acc, mask=keep)
        if LAST_ADDS:
            counter = count_ptr + _pick(g, count_at0, count_at1, count_at2, count_at3) + tile
            if _last_arrival(counter, splits):
                total = _parts_sum(part_ptr + part_at, values, keep, total_rows * n_out, splits)
                tl.store(y_ptr + y_at + values, total.to(y_ptr.dtype.element_ty), mask=keep)
                tl.store(counter, 0)  # every other piece has counted: zero again for the next launch
    else:
        tl.store(y_ptr + y_at + out_row * n_out + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["end0", "end1", "end2", "y_at0", "y_at1", "y_at2", "y_at3",
                               "part_at0", "part_at1", "part_at2", "part_at3"])
def grouped_sum_kernel(part_ptr, y_ptr, count0, count1, count2, count3, splits0, splits1, splits2, splits3,
                       end0, end1, end2, y_at0, y_at1, y_at2, y_at3, part_at0, part_at1, part_at2, part_at3,
                       BLOCK: tl.constexpr):
    """The second pass of up to four cut matrices when no tile counters are at hand (grouped_rows_kernel
    LAST_ADDS): y_g[i] = part_g[0, i] + part_g[1, i] + ... in that order over its count_g = ROWS · n_out_g
    values (sum_parts_kernel's sums), rounded once into y."""
    g, local = _matrix(end0, end1, end2)
    count = _pick(g, count0, count1, count2, count3)
    idx = local * BLOCK + tl.arange(0, BLOCK)
    ok = idx < count
    part_at = _pick(g, part_at0, part_at1, part_at2, part_at3).to(tl.int64)
    acc = _parts_sum(part_ptr + part_at, idx, ok, count, _pick(g, splits0, splits1, splits2, splits3))
    y_at = _pick(g, y_at0, y_at1, y_at2, y_at3).to(tl.int64)
    tl.store(y_ptr + y_at + idx, acc.to(y_ptr.dtype.element_ty), mask=ok)
