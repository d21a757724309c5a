"""Triton kernels over GGUF-packed weight rows (imported on first use; needs Triton).

A weight is a uint8 matrix [n_out, row bytes] (runtime/stored.py `StoredWeight.raw`). Every kernel
walks a row in steps of 32 consecutive values: one Q8_0 block, one 32-value sub-block of a Q4_K /
Q5_K super-block, two 16-value sub-blocks of a Q6_K one, or 32 BF16 / F16 / F32 values. `_decode` turns
step `s` of block `blk` of BLOCK_N rows into float32 [BLOCK_N, 32], with the formulas and the order
of float32 operations of runtime/dequant.py (bit-identical where the compiler does not contract a
product and a difference into one FMA: the dequantizing launch asks it not to). Multi-byte fields are
read a byte at a time, so no block needs any alignment. Only addresses computed from the program's
indices are read (no address comes from a loaded value), which Triton's CPU interpreter runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specconv.runtime import rows_first
from specconv.runtime.kernels_triton import matmul
from specconv.runtime.kernels_triton._pointwise_jit import NO_ACTIVATION, _glu
from specconv.runtime.kernels_triton._tail_jit import _last_arrival, _tail

# ggml type numbers (gguf.GGMLQuantizationType), as compile-time constants
F32 = tl.constexpr(0)
F16 = tl.constexpr(1)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)
BF16 = tl.constexpr(30)
Q8_0_ROWS = tl.constexpr(int(rows_first.Q8_0_ROWS))  # a row's [32 int8 q] per block, then its [f16 d] per block
DOT_ROWS = tl.constexpr(matmul.DOT_ROWS)  # activation rows of the tensor-core product (_dot_sums): 1-16 padded
# _dot's operand types (matmul.WIDE)
WIDE_F32, WIDE_BF16, WIDE_F16 = (tl.constexpr(matmul.WIDE[t]) for t in (torch.float32, torch.bfloat16, torch.float16))


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
def _f16_even(ptr, mask):
    """The f16 at an even address `ptr` (a uint8 pointer), widened exactly to float32: one 2-byte load
    (a rows-first row's scales, runtime/rows_first.py: every row starts 16-byte aligned)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


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
def _decode(rows, blk, s: tl.constexpr, i, row_ok, blk_ok, n_in, QTYPE: tl.constexpr, BYTES: tl.constexpr):
    """float32 [BLOCK_N, NB, 32]: values 32 s + i of blocks `blk` [NB] (each BYTES long) of the rows
    starting at `rows` [BLOCK_N] (uint8 pointers). `blk_ok` [NB] masks blocks past the row's end, and
    for 16/32-bit floats values past n_in (a row may end part-way through a 32-value step)."""
    ok2 = row_ok[:, None] & blk_ok[None, :]
    base = rows[:, None] + blk.to(tl.int64)[None, :] * BYTES  # [BLOCK_N, NB]
    at = base[:, :, None] + i[None, None, :]                   # [BLOCK_N, NB, 32]: byte i after each block start
    ok = ok2[:, :, None]
    if QTYPE == Q8_0:  # 34 B: f16 d, 32 int8 q; x = d * q
        q = tl.load(at + 2, mask=ok, other=0).to(tl.int8, bitcast=True)
        return q.to(tl.float32) * _f16(base, ok2)[:, :, None]
    elif QTYPE == Q8_0_ROWS:  # a row's 32-value blocks of q (n_in bytes), then its blocks' d
        values = rows[:, None, None] + (blk.to(tl.int64) * 32)[None, :, None] + i[None, None, :]
        q = tl.load(values, mask=ok, other=0).to(tl.int8, bitcast=True)
        return q.to(tl.float32) * _f16_even(rows[:, None] + n_in + 2 * blk.to(tl.int64)[None, :], ok2)[:, :, None]
    elif QTYPE == Q4_K or QTYPE == Q5_K:  # x = (d * scale) * q - (dmin * min)
        scale, low_min = _k_scale_min(base + 4, s, ok2)
        step = _f16(base, ok2) * scale.to(tl.float32)
        offset = _f16(base + 2, ok2) * low_min.to(tl.float32)
        # the last 128 bytes: sub-blocks 2g and 2g+1 are the low and high nibbles of bytes 32g..32g+31
        q = (_byte(at + BYTES - 128 + 32 * (s // 2), ok) >> (4 * (s % 2))) & 15
        if QTYPE == Q5_K:  # fifth bit of value 32 s + i: bit s of byte 16 + i
            q = q | (((_byte(at + 16, ok) >> s) & 1) << 4)
        return q.to(tl.float32) * step[:, :, None] - offset[:, :, None]
    elif QTYPE == Q6_K:  # 210 B: 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, f16 d
        half = s // 4  # values 128 h + r: low nibble r // 64 of byte 64 h + r % 64,
        r = s % 4      # 2-bit field r // 32 of byte 128 + 32 h + r % 32
        low = (_byte(at + 64 * half + 32 * (r % 2), ok) >> (4 * (r // 2))) & 15
        high = (_byte(at + 128 + 32 * half, ok) >> (2 * r)) & 3
        scale = tl.load(base[:, :, None] + 192 + 2 * s + i[None, None, :] // 16, mask=ok, other=0)
        step = _f16(base + 208, ok2)[:, :, None] * scale.to(tl.int8, bitcast=True).to(tl.float32)
        return ((low | (high << 4)) - 32).to(tl.float32) * step
    else:  # BF16 / F16 / F32: 32 values of BYTES // 32 bytes per step
        ok = ok & (blk[None, :, None] * 32 + i[None, None, :] < n_in)
        at = base[:, :, None] + (BYTES // 32) * i[None, None, :]
        if QTYPE == F32:  # the four little-endian bytes of a float32
            bits = _byte(at, ok).to(tl.uint32) | (_byte(at + 1, ok).to(tl.uint32) << 8)
            bits = bits | (_byte(at + 2, ok).to(tl.uint32) << 16) | (_byte(at + 3, ok).to(tl.uint32) << 24)
            return bits.to(tl.float32, bitcast=True)
        if QTYPE == BF16:  # the top half of a float32
            bits = _byte(at, ok).to(tl.uint32) | (_byte(at + 1, ok).to(tl.uint32) << 8)
            return (bits << 16).to(tl.float32, bitcast=True)
        return _f16(at, ok)


@triton.jit
def _widened(v):
    """float32 of loaded activation values: a bfloat16 is the top half of its float32 (one shift or mask
    of the packed pair, where the compiler's widening extracts each half first), else a cast."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _input(x_ptr, u_ptr, at_x, at_u, ok, ACT: tl.constexpr):
    """float32 values of the activation rows at element offsets at_x: x itself, or with a GLU
    activation ACT the values act(x) · u (u at offsets at_u) that _pointwise_jit.glu_kernel writes in
    x's dtype, computed here instead of read back (masked values are 0: act(0) · 0; `ok` None: every
    offset inside the rows, read unmasked)."""
    if ok is None:
        x = _widened(tl.load(x_ptr + at_x))
    else:
        x = _widened(tl.load(x_ptr + at_x, mask=ok, other=0))
    if ACT != NO_ACTIVATION:
        if ok is None:
            u = _widened(tl.load(u_ptr + at_u))
        else:
            u = _widened(tl.load(u_ptr + at_u, mask=ok, other=0))
        x = _glu(x, u, ACT, x_ptr.dtype.element_ty)
    return x


@triton.jit
def _k_weights(base, s: tl.constexpr, low, high, ok, QTYPE: tl.constexpr):
    """float32 [BLOCK_N, NB, 2, 16]: values 32 s + v of the K-quant blocks at `base` [BLOCK_N, NB, 1, 1],
    for the product, from the uint8 bytes `low` (the 32 quant bytes of step s: Q4_K / Q5_K's
    nibbles, Q6_K's low nibbles) and `high` (Q5_K's fifth bits, Q6_K's 2-bit fields). A Q4_K / Q5_K
    high nibble stays in place (16 q, the fifth bit 256) and its step is divided by 16: a power of
    two, exact, and the FMA rounds the same exact value once. Q6_K's (q - 32) · step is
    q · step - 32 · step in one FMA, likewise. The scales and mins are decoded per (row, block)."""
    if QTYPE == Q6_K:
        r = s % 4
        if r < 2:  # low nibbles of ql; 2-bit field r of qh in bits 4-5
            q = (low & 15) | ((high << (4 - 2 * r)) & 48)
        else:
            q = (low >> 4) | ((high >> (2 * r - 4)) & 48)
        scale = tl.load(base + 192 + 2 * s + tl.arange(0, 2)[None, None, :, None], mask=ok).to(tl.int8, bitcast=True)
        step = _f16(base + 208, ok) * scale.to(tl.float32)
        return q.to(tl.int32).to(tl.float32) * step - 32.0 * step
    scale, low_min = _k_scale_min(base + 4, s, ok)
    step = _f16(base, ok) * scale.to(tl.float32)
    offset = _f16(base + 2, ok) * low_min.to(tl.float32)
    place = 4 + 4 * (s % 2)  # a low nibble as it is, a high one in place (16 q)
    q = low.to(tl.int32) & (15 << (4 * (s % 2)))
    if QTYPE == Q5_K:  # the fifth bit of value 32 s + v: bit s of byte 16 + v, moved to bit `place`
        if s <= place:
            q = q | ((high.to(tl.int32) << (place - s)) & (1 << place))
        else:
            q = q | ((high.to(tl.int32) >> (s - place)) & (1 << place))
    if s % 2 == 0:
        return q.to(tl.float32) * step - offset
    return q.to(tl.float32) * (step * 0.0625) - offset


@triton.jit
def _eighths(t):
    """The 8 tensors t[..., a, b, c] (a, b, c in 0..1) of t [..., 2, 2, 2], in a fixed order."""
    a0, a1 = tl.split(t)
    b0, b1 = tl.split(a0)
    b2, b3 = tl.split(a1)
    c0, c1 = tl.split(b0)
    c2, c3 = tl.split(b1)
    c4, c5 = tl.split(b2)
    c6, c7 = tl.split(b3)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _k_step(x_ptr, u_ptr, rows, row_ok, b0, last, n_in, stride_x, stride_u, sums, QTYPE: tl.constexpr,
            BYTES: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, ACT: tl.constexpr, MASKED: tl.constexpr):
    """`sums` after the NB K-quant blocks from b0 (_k_sums); with MASKED, blocks from `last` on are
    left out (a piece's last, partial step), else all NB are inside it."""
    blk = b0 + tl.arange(0, NB)
    v = 16 * tl.arange(0, 2)[:, None] + tl.arange(0, 16)[None, :]  # [2, 16]: value v of a 32-value step
    base = rows[:, None, None, None] + (blk.to(tl.int64) * BYTES)[None, :, None, None]
    at = base + v[None, None, :, :]
    ok = row_ok[:, None, None, None]
    k = tl.arange(0, NB)[:, None, None] * 256 + v[None, :, :]  # [NB, 2, 16]: offsets from block b0's first value
    k_ok = None
    if MASKED:
        ok = ok & (blk < last)[None, :, None, None]
        k_ok = (blk < last)[:, None, None] & (b0 * 256 + k < n_in)
    for s in tl.static_range(8):  # a run of bytes read by two steps is loaded once (the compiler merges the loads)
        if QTYPE == Q6_K:  # low nibbles of steps 4h + r, r = 0, 1 (high nibbles: r = 2, 3); 2-bit fields
            low = tl.load(at + 64 * (s // 4) + 32 * (s % 2), mask=ok, other=0)
            high = tl.load(at + 128 + 32 * (s // 4), mask=ok, other=0)
        else:  # the 32 bytes of steps 2g (low nibbles) and 2g + 1 (high); Q5_K's fifth bits
            low = tl.load(at + BYTES - 128 + 32 * (s // 2), mask=ok, other=0)
            high = tl.load(at + 16, mask=ok, other=0) if QTYPE == Q5_K else low
        w = _k_weights(base, s, low, high, ok, QTYPE)
        if QTYPE != Q6_K:
            ws = _eighths(tl.reshape(w, [w.shape[0], NB, 2, 2, 2, 2, 2]))
        updated = ()
        for m in tl.static_range(ROWS):
            x = _input(x_ptr + (m * stride_x + b0 * 256), u_ptr + (m * stride_u + b0 * 256), 32 * s + k, 32 * s + k,
                       k_ok, ACT)
            if QTYPE == Q6_K:
                updated = updated + (sums[m] + w * x[None, :, :, :],)
            else:
                xs = _eighths(tl.reshape(x, [NB, 2, 2, 2, 2, 2]))
                total = sums[m]
                for e in tl.static_range(8):
                    total = total + ws[e] * xs[e][None, :, :, :]
                updated = updated + (total,)
        sums = updated
    return sums


@triton.jit
def _k_sums(x_ptr, u_ptr, rows, row_ok, n_in, first, last, stride_x, stride_u, QTYPE: tl.constexpr,
            BYTES: tl.constexpr, ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
            ACT: tl.constexpr):
    """_tile_sums of a K-quant (Q4_K, Q5_K, Q6_K) matrix: each 32-value step a [BLOCK_N, NB, 2, 16] tile
    (two 16-value halves: a Q6_K scale's span), the bytes each step needs loaded once per block and
    shared by the steps that read them; whole steps in the loop without masks on the activations,
    the piece's last partial step after it. Q4_K / Q5_K rows keep one float32 per lane: the 8
    consecutive values a lane holds (NB = 2: its tile is 8 values wide) are added to it one by one
    in a fixed order (_eighths), so 16 rows fit in registers."""
    if QTYPE == Q6_K:
        sums = (tl.zeros([BLOCK_N, NB, 2, 16], dtype=tl.float32),) * ROWS
    else:
        sums = (tl.zeros([BLOCK_N, NB, 2, 2], dtype=tl.float32),) * ROWS
    whole = last - (last - first) % NB
    for b0 in range(first, whole, NB):
        sums = _k_step(x_ptr, u_ptr, rows, row_ok, b0, last, n_in, stride_x, stride_u, sums, QTYPE, BYTES, ROWS, NB,
                       ACT, False)
    if NB > 1:
        if whole < last:
            sums = _k_step(x_ptr, u_ptr, rows, row_ok, whole, last, n_in, stride_x, stride_u, sums, QTYPE, BYTES,
                           ROWS, NB, ACT, True)
    m_index = tl.arange(0, ROWS_P2)
    acc = tl.zeros([ROWS_P2, BLOCK_N], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        total = tl.sum(tl.sum(tl.sum(sums[m], axis=3), axis=2), axis=1)
        acc = tl.where(m_index[:, None] == m, total[None, :], acc)
    return acc


@triton.jit
def _dot(x, q, WIDE: tl.constexpr):
    """float32 [DOT_ROWS, n] = x [DOT_ROWS, k] (float32 values exact in the operand type) @ q [k, n] (small
    integers, exact in it) on tensor cores, the operands in bfloat16 (WIDE = WIDE_BF16) or float16
    (WIDE_F16); WIDE_F32 (the interpreter, which has no bfloat16 arithmetic) multiplies in IEEE float32."""
    if WIDE == WIDE_BF16:
        return tl.dot(x.to(tl.bfloat16), q.to(tl.bfloat16), out_dtype=tl.float32)
    if WIDE == WIDE_F16:
        return tl.dot(x.to(tl.float16), q.to(tl.float16), out_dtype=tl.float32)
    return tl.dot(x, q.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _dot_sums(x_ptr, rows, row_ok, n_in, first, last, stride_x, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
              NB: tl.constexpr, WIDE: tl.constexpr):
    """float32 [DOT_ROWS, BLOCK_N]: _tile_sums of a Q8_0_ROWS matrix on tensor cores, NB 32-value blocks a
    step, 16-bit rows multiplied in the operand type WIDE (_dot; a GLU's rows arrive computed: the
    wrapper runs glu first). The activation rows are padded to DOT_ROWS (rows past ROWS read as 0),
    so one row and sixteen run the same operations and each row's sums do not depend on the batch.
    Per block: its int8 values widened exactly to the operand type, multiplied with the rows by
    tl.dot into float32 (exact products of 16-bit values), scaled by the block's f16 scale and added
    to the sums in one FMA. The values are read 16 bytes at a time: every block's values start
    16-byte aligned (runtime/rows_first.py)."""
    m = tl.arange(0, DOT_ROWS)
    m_ok = m < ROWS
    i = tl.arange(0, 32)
    acc = tl.zeros([DOT_ROWS, BLOCK_N], dtype=tl.float32)
    for b0 in range(first, last, NB):
        for s in tl.static_range(NB):
            b = b0 + s
            k = b * 32 + i
            k_ok = k < last * 32  # the whole block inside the piece, or none of it
            at = m[:, None] * stride_x + k[None, :]
            x = _input(x_ptr, x_ptr, at, at, m_ok[:, None] & k_ok[None, :], NO_ACTIVATION)
            q = tl.load(rows[None, :] + k[:, None], mask=row_ok[None, :] & k_ok[:, None], other=0)
            d = _f16_even(rows + n_in + 2 * b, row_ok & (tl.full([BLOCK_N], 0, tl.int32) + b < last))
            acc += _dot(x, q.to(tl.int8, bitcast=True), WIDE) * d[None, :]
    return acc


@triton.jit
def _tile_sums(x_ptr, u_ptr, rows, row_ok, n_in, first, last, stride_x, stride_u, QTYPE: tl.constexpr,
               VALUES: tl.constexpr, BYTES: tl.constexpr, ROWS: tl.constexpr, ROWS_P2: tl.constexpr,
               BLOCK_N: tl.constexpr, NB: tl.constexpr, ACT: tl.constexpr):
    """float32 [ROWS_P2, BLOCK_N]: Σ_k x[m, k] W[n, k] over blocks first..last-1 of the BLOCK_N weight
    rows starting at `rows`, NB blocks per step: each step's tile decoded once and multiplied with
    every activation row. Row m's products are added value by value into its own float32 tile
    (sums[m], one per row: a tuple), whose values are summed once after the loop, so the loop has
    no cross-lane reduction and row m's operations are the same whatever ROWS is. Every one-pass
    product (one matrix, experts by index, a group of matrices) runs this, so a matrix's sums are
    the same operations in each. With a GLU activation ACT, x[m, k] is act(gate) · up of rows m of
    x (the gate) and u (_input). K-quants take _k_sums (the same contract)."""
    if QTYPE == Q4_K or QTYPE == Q5_K or QTYPE == Q6_K:
        return _k_sums(x_ptr, u_ptr, rows, row_ok, n_in, first, last, stride_x, stride_u, QTYPE, BYTES, ROWS, ROWS_P2,
                       BLOCK_N, NB, ACT)
    i = tl.arange(0, 32)
    j = tl.arange(0, NB)
    sums = (tl.zeros([BLOCK_N, NB, 32], dtype=tl.float32),) * ROWS
    for b0 in range(first, last, NB):
        blk = b0 + j
        blk_ok = blk < last
        for s in tl.static_range(VALUES // 32):
            w = _decode(rows, blk, s, i, row_ok, blk_ok, n_in, QTYPE, BYTES)
            k = blk[:, None] * VALUES + 32 * s + i[None, :]  # [NB, 32]
            k_ok = blk_ok[:, None] & (k < n_in)
            updated = ()
            for m in tl.static_range(ROWS):
                x = _input(x_ptr, u_ptr, m * stride_x + k, m * stride_u + k, k_ok, ACT)
                updated = updated + (sums[m] + w * x[None, :, :],)
            sums = updated
    m_index = tl.arange(0, ROWS_P2)
    acc = tl.zeros([ROWS_P2, BLOCK_N], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        total = tl.sum(tl.sum(sums[m], axis=2), axis=1)
        acc = tl.where(m_index[:, None] == m, total[None, :], acc)
    return acc


@triton.jit(do_not_specialize=["n_blocks", "blocks_per_split", "total_rows"])
def fused_rows_kernel(x_ptr, u_ptr, w_ptr, w2_ptr, y_ptr, part_ptr, count_ptr, sel_ptr, h_ptr, nw_ptr, s_ptr, o_ptr,
                      pw_ptr, scale_ptr, n_out, n_in, n_blocks, blocks_per_split, total_rows,
                      stride_x, stride_u, stride_w, stride_e, stride_y, count, eps,
                      QTYPE: tl.constexpr, VALUES: tl.constexpr, BYTES: tl.constexpr, ROWS: tl.constexpr,
                      ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, PARTIAL: tl.constexpr,
                      LAST_ADDS: tl.constexpr, PAIRS: tl.constexpr, FANOUT: tl.constexpr,
                      MATRICES: tl.constexpr, ACT: tl.constexpr, TAIL: tl.constexpr, NORM_BLOCK: tl.constexpr,
                      NORM_CHUNKS: tl.constexpr, SANDWICH: tl.constexpr, OUT_SCALE: tl.constexpr,
                      NORM_OUT: tl.constexpr, DOT: tl.constexpr, WIDE: tl.constexpr):
    """y[m, n] = Σ_k x[m, k] W[n, k] for ROWS activation rows (with a GLU activation ACT, x[m, k] =
    act(gate) · up of the rows of x and u: _tile_sums). Program (p, q, r) takes BLOCK_N weight rows
    and the q-th run of `blocks_per_split` blocks of them (_tile_sums); with PARTIAL its float32 sums
    go to part[q], else straight into y. The pieces are added over q in order, rounded once into y:
    with LAST_ADDS by the last program of the tile to finish (_last_arrival, one int32 counter per
    tile (p, r) at count_ptr, zero before and after the launch), else by sum_parts_kernel. Row m's
    result is the same sequence of float32 operations whatever ROWS is (the split depends on W's
    shape only), so a row's output does not depend on the batch it is in. With DOT (a Q8_0_ROWS
    matrix, 16-bit rows, not PAIRS, no ACT) the sums are _dot_sums' (ROWS_P2 = DOT_ROWS, WIDE the
    operand type: _dot). With PAIRS (ROWS = 1), program r multiplies activation row r by expert
    sel[r] of a 3-D expert tensor (experts stride_e bytes apart): routed experts by index, on the
    device, each pair the same operations as a one-row product by that expert; pair r reads
    activation row r // FANOUT (a row's k pairs share it). With MATRICES = 2 (PAIRS) the total_rows
    outputs are the pairs by the experts of W (first half) and of W2 (second half, the same shape and
    layout): two expert products of the same pairs, one launch.

    With TAIL (not PAIRS; every tile's output stored in y by the launch: a cut tile's by its last
    piece), the launch ends with a residual add and RMSNorm of y's ROWS rows (_tail_jit._norm_tail):
    s = h + y into s, its norm by the weight at nw into o, done by the last tile to finish (one more
    counter at count_ptr, after the tiles' own). With SANDWICH too, y is normed (by the weight at pw) before
    it is added, the sum times the float32 value at scale_ptr with OUT_SCALE, and o written only
    with NORM_OUT (_tail_jit._sandwich_tail)."""
    r = tl.program_id(2)
    pair = r
    w_base = w_ptr
    if MATRICES == 2:
        if r >= total_rows // 2:
            w_base = w2_ptr
            pair = r - total_rows // 2
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = n < n_out
    rows = w_base + n.to(tl.int64) * stride_w
    if PAIRS:
        rows += tl.load(sel_ptr + pair).to(tl.int64) * stride_e
    x_ptr += (pair // FANOUT).to(tl.int64) * stride_x
    u_ptr += (pair // FANOUT).to(tl.int64) * stride_u
    first = tl.program_id(1) * blocks_per_split
    last = tl.minimum(first + blocks_per_split, n_blocks)
    if DOT:  # ROWS_P2 is DOT_ROWS; no GLU (ACT): the wrapper hands over its rows
        acc = _dot_sums(x_ptr, rows, row_ok, n_in, first, last, stride_x, ROWS, BLOCK_N, NB, WIDE)
    else:
        acc = _tile_sums(x_ptr, u_ptr, rows, row_ok, n_in, first, last, stride_x, stride_u, QTYPE, VALUES, BYTES,
                         ROWS, ROWS_P2, BLOCK_N, NB, ACT)
    m_index = tl.arange(0, ROWS_P2)
    keep = (m_index[:, None] < ROWS) & row_ok[None, :]
    out_row = (r + m_index).to(tl.int64)[:, None]
    if PARTIAL:
        in_part = out_row * n_out + n[None, :]  # this tile's values in each part [total_rows, n_out]
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * total_rows * n_out + in_part, acc, mask=keep)
        if LAST_ADDS:
            counter = count_ptr + r * tl.num_programs(0) + tl.program_id(0)
            splits = tl.num_programs(1)
            if _last_arrival(counter, splits):
                total = _parts_sum(part_ptr, in_part, keep, total_rows * n_out, splits)
                tl.store(y_ptr + out_row * stride_y + n[None, :], total.to(y_ptr.dtype.element_ty), mask=keep)
                tl.store(counter, 0)  # every other piece has counted: zero again for the next launch
                if TAIL:
                    _tail(y_ptr, h_ptr, nw_ptr, s_ptr, o_ptr, pw_ptr, scale_ptr, count_ptr + tl.num_programs(0),
                          tl.num_programs(0), n_out, stride_y, count, eps, ROWS, NORM_BLOCK, NORM_CHUNKS, SANDWICH,
                          OUT_SCALE, NORM_OUT)
    else:
        out = y_ptr + out_row * stride_y + n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=keep)
        if TAIL:
            _tail(y_ptr, h_ptr, nw_ptr, s_ptr, o_ptr, pw_ptr, scale_ptr, count_ptr + tl.num_programs(0),
                  tl.num_programs(0), n_out, stride_y, count, eps, ROWS, NORM_BLOCK, NORM_CHUNKS, SANDWICH, OUT_SCALE,
                  NORM_OUT)


@triton.jit
def _parts_sum(part_ptr, idx, ok, count, splits):
    """float32 like idx: part[0, idx] + part[1, idx] + ... in that order (parts `count` values apart),
    the same operations whoever adds them (sum_parts_kernel, the last piece's program), so the bits
    do not depend on which piece finished last. Read from L2 (.cg): other multiprocessors wrote them."""
    acc = tl.zeros(idx.shape, dtype=tl.float32)
    for q in range(splits):
        acc += tl.load(part_ptr + q * count + idx, mask=ok, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def sum_parts_kernel(part_ptr, y_ptr, rows, n_out, splits, stride_y, BLOCK: tl.constexpr):
    """y[m, n] = part[0, m, n] + part[1, m, n] + ... in that order (float32), rounded once into y: the
    second launch of a cut product when no tile counters are at hand (fused_rows_kernel LAST_ADDS)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < rows * n_out
    acc = _parts_sum(part_ptr, idx, ok, rows * n_out, splits)
    m = idx // n_out
    tl.store(y_ptr + m * stride_y + idx - m * n_out, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def dequantize_kernel(w_ptr, out_ptr, n_rows, n_in, n_blocks, stride_w, stride_out,
                      QTYPE: tl.constexpr, VALUES: tl.constexpr, BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                      NB: tl.constexpr):
    """out[n, k] = W[n, k] in out's dtype: one program per BLOCK_N rows and NB blocks."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    row_ok = n < n_rows
    blk_ok = blk < n_blocks
    rows = w_ptr + n.to(tl.int64) * stride_w
    dst = out_ptr + n.to(tl.int64)[:, None, None] * stride_out
    i = tl.arange(0, 32)
    for s in tl.static_range(VALUES // 32):
        w = _decode(rows, blk, s, i, row_ok, blk_ok, n_in, QTYPE, BYTES)
        k = blk[None, :, None] * VALUES + 32 * s + i[None, None, :]
        ok = row_ok[:, None, None] & blk_ok[None, :, None] & (k < n_in)
        tl.store(dst + k, w.to(out_ptr.dtype.element_ty), mask=ok)
