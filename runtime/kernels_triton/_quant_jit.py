"""Triton kernels over GGUF-packed weight rows (imported on first use; needs Triton).

A weight is a uint8 matrix [n_out, row bytes] (runtime/stored.py `StoredWeight.raw`). Every kernel
walks a row in steps of 32 consecutive values: one Q8_0 block, one 32-value sub-block of a Q4_K /
Q5_K super-block, two 16-value sub-blocks of a Q6_K one, or 32 BF16 / F16 values. `_decode` turns
step `s` of block `blk` of BLOCK_N rows into float32 [BLOCK_N, 32], with the formulas and the order
of float32 operations of runtime/dequant.py (bit-identical where the compiler does not contract a
product and a difference into one FMA: the dequantizing launch asks it not to). Multi-byte fields are
read a byte at a time, so no block needs any alignment. Only addresses computed from the program's
indices are read (no address comes from a loaded value), which Triton's CPU interpreter runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ggml type numbers (gguf.GGMLQuantizationType), as compile-time constants
F16 = tl.constexpr(1)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)
BF16 = tl.constexpr(30)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian f16 at `ptr` (any alignment), widened exactly to float32."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(ptr, s: tl.constexpr, mask):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block s from the 12 bytes at `ptr`. Sub-blocks
    0-3 take the low 6 bits of bytes s and s+4; 4-7 a nibble of byte s+4 and the top 2 bits of
    bytes s-4 (scale) and s (min)."""
    if s < 4:
        scale = _byte(ptr + s, mask) & 63
        low_min = _byte(ptr + s + 4, mask) & 63
    else:
        packed = _byte(ptr + s + 4, mask)
        scale = (packed & 15) | ((_byte(ptr + s - 4, mask) >> 6) << 4)
        low_min = (packed >> 4) | ((_byte(ptr + s, mask) >> 6) << 4)
    return scale, low_min


@triton.jit
def _decode(rows, blk, s: tl.constexpr, i, row_ok, col_ok, QTYPE: tl.constexpr, BYTES: tl.constexpr):
    """float32 [BLOCK_N, 32]: values 32 s + i of block `blk` (BYTES long) of the rows starting at
    `rows` [BLOCK_N] (uint8 pointers). `col_ok` [32] masks the tail of a 16-bit-float row."""
    ok = row_ok[:, None] & col_ok[None, :]
    if QTYPE == Q8_0:  # 34 B: f16 d, 32 int8 q; x = d * q
        base = rows + blk * BYTES
        q = tl.load(base[:, None] + 2 + i[None, :], mask=ok, other=0).to(tl.int8, bitcast=True)
        return q.to(tl.float32) * _f16(base, row_ok)[:, None]
    elif QTYPE == Q4_K or QTYPE == Q5_K:  # x = (d * scale) * q - (dmin * min)
        base = rows + blk * BYTES
        scale, low_min = _k_scale_min(base + 4, s, row_ok)
        step = _f16(base, row_ok) * scale.to(tl.float32)
        offset = _f16(base + 2, row_ok) * low_min.to(tl.float32)
        # the last 128 bytes: sub-blocks 2g and 2g+1 are the low and high nibbles of bytes 32g..32g+31
        q = (_byte(base[:, None] + BYTES - 128 + 32 * (s // 2) + i[None, :], ok) >> (4 * (s % 2))) & 15
        if QTYPE == Q5_K:  # fifth bit of value 32 s + i: bit s of byte 16 + i
            q = q | (((_byte(base[:, None] + 16 + i[None, :], ok) >> s) & 1) << 4)
        return q.to(tl.float32) * step[:, None] - offset[:, None]
    elif QTYPE == Q6_K:  # 210 B: 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, f16 d
        base = rows + blk * BYTES
        half = s // 4  # values 128 h + r: low nibble r // 64 of byte 64 h + r % 64,
        r = s % 4      # 2-bit field r // 32 of byte 128 + 32 h + r % 32
        low = (_byte(base[:, None] + 64 * half + 32 * (r % 2) + i[None, :], ok) >> (4 * (r // 2))) & 15
        high = (_byte(base[:, None] + 128 + 32 * half + i[None, :], ok) >> (2 * r)) & 3
        scale = tl.load(base[:, None] + 192 + 2 * s + i[None, :] // 16, mask=ok, other=0)
        step = _f16(base + 208, row_ok)[:, None] * scale.to(tl.int8, bitcast=True).to(tl.float32)
        return ((low | (high << 4)) - 32).to(tl.float32) * step
    elif QTYPE == BF16:  # the top half of a float32
        at = rows[:, None] + blk * BYTES + 2 * i[None, :]
        bits = tl.load(at, mask=ok, other=0).to(tl.uint32) | (tl.load(at + 1, mask=ok, other=0).to(tl.uint32) << 8)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:  # F16
        return _f16(rows[:, None] + blk * BYTES + 2 * i[None, :], ok)


@triton.jit
def fused_rows_kernel(x_ptr, w_ptr, y_ptr, n_out, n_in, n_blocks, stride_x, stride_w, stride_y,
                      QTYPE: tl.constexpr, VALUES: tl.constexpr, BYTES: tl.constexpr, ROWS: tl.constexpr,
                      ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[m, n] = Σ_k x[m, k] W[n, k] for ROWS activation rows: each step of BLOCK_N weight rows is
    decoded once and multiplied with every activation row. Row m's sum is the same sequence of
    float32 operations whatever ROWS is (one reduction of the same [BLOCK_N, 32] tile per step,
    added to its own accumulator), so a row's output does not depend on the batch it is in."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = n < n_out
    rows = w_ptr + n.to(tl.int64) * stride_w
    i = tl.arange(0, 32)
    m_index = tl.arange(0, ROWS_P2)
    acc = tl.zeros([ROWS_P2, BLOCK_N], dtype=tl.float32)
    for blk in range(n_blocks):
        for s in tl.static_range(VALUES // 32):
            k = blk * VALUES + 32 * s + i
            col_ok = k < n_in
            w = _decode(rows, blk, s, i, row_ok, col_ok, QTYPE, BYTES)
            for m in tl.static_range(ROWS):
                x = tl.load(x_ptr + m * stride_x + k, mask=col_ok, other=0).to(tl.float32)
                part = tl.sum(w * x[None, :], axis=1)
                acc += tl.where(m_index[:, None] == m, part[None, :], 0.0)
    out = y_ptr + m_index[:, None] * stride_y + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(m_index[:, None] < ROWS) & row_ok[None, :])


@triton.jit
def dequantize_kernel(w_ptr, out_ptr, n_rows, n_in, stride_w, stride_out,
                      QTYPE: tl.constexpr, VALUES: tl.constexpr, BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n, k] = W[n, k] in out's dtype: one program per BLOCK_N rows and one block."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1)
    row_ok = n < n_rows
    rows = w_ptr + n.to(tl.int64) * stride_w
    dst = out_ptr + n.to(tl.int64)[:, None] * stride_out
    i = tl.arange(0, 32)
    for s in tl.static_range(VALUES // 32):
        k = blk * VALUES + 32 * s + i
        col_ok = k < n_in
        w = _decode(rows, blk, s, i, row_ok, col_ok, QTYPE, BYTES)
        tl.store(dst + k[None, :], w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
