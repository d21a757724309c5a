"""What a one-pass product launch does once its tiles are stored (imported on first use; needs Triton).

`_last_arrival` tells the last program of a tile (or of the launch) to finish, by an arrival
counter: the semaphore the cut products, the attention splits and the recurrent kernels share. The
norm tails of fused_rows_kernel (_quant_jit) run in that last program: a block's residual add and
the next RMSNorm (`_norm_tail`), or Gemma's sandwich norm joining the stream, its layer output
scale and the next RMSNorm (`_sandwich_tail`), each with norm_kernel's formula (_pointwise_jit), so
a row gets the bits of the separate launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specconv.runtime.kernels_triton._pointwise_jit import (_rounded, blocked_norm_factor, norm_factor, norm_input,
                                                            norm_row, normed, square_sum)


@triton.jit
def _tail(y_ptr, h_ptr, w_ptr, s_ptr, o_ptr, pw_ptr, scale_ptr, counter, tiles, width, stride_y, count, eps,
          ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, SANDWICH: tl.constexpr,
          OUT_SCALE: tl.constexpr, NORM_OUT: tl.constexpr):
    """The product's tail: _sandwich_tail with SANDWICH, else _norm_tail."""
    if SANDWICH:
        _sandwich_tail(y_ptr, h_ptr, pw_ptr, scale_ptr, w_ptr, s_ptr, o_ptr, counter, tiles, width, stride_y, count,
                       eps, ROWS, BLOCK, CHUNKS, OUT_SCALE, NORM_OUT)
    else:
        _norm_tail(y_ptr, h_ptr, w_ptr, s_ptr, o_ptr, counter, tiles, width, stride_y, count, eps, ROWS, BLOCK,
                   CHUNKS)


@triton.jit
def _sandwich_tail(y_ptr, h_ptr, pw_ptr, scale_ptr, w_ptr, s_ptr, o_ptr, counter, tiles, width, stride_y, count, eps,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, OUT_SCALE: tl.constexpr,
                   NORM_OUT: tl.constexpr):
    """Once all `tiles` tiles have stored their part of y (_last_arrival), the last of them: for each
    of the ROWS rows, a sandwich norm's output joining the residual stream, s = h + rms_norm(y) · pw
    (times the float32 value at scale_ptr with OUT_SCALE), and with NORM_OUT the norm that reads it
    next, o = rms_norm(s) · w: the bits of norm_kernel's add_to (out_scale) form on y, then its plain
    form on s. Each row's reductions over CHUNKS blocks of BLOCK values in order, whatever ROWS is:
    y's sum of squares, then s's (s made block by block and stored), then o's blocks with s made
    again (the same bits). y is read from L2 (.cg): other multiprocessors wrote it. The counter is
    zeroed for the next launch."""
    if _last_arrival(counter, tiles):
        scale = 1.0
        if OUT_SCALE:
            scale = tl.load(scale_ptr).to(tl.float32)
        for m in tl.static_range(ROWS):
            y_row = y_ptr + m * stride_y
            h_row = h_ptr + m * width
            first = blocked_norm_factor(y_row, y_row, width, count, eps, s_ptr.dtype.element_ty, True, False, ".cg",
                                        "", BLOCK, CHUNKS)
            total = 0.0
            for c in tl.static_range(CHUNKS):
                cols = c * BLOCK + tl.arange(0, BLOCK)
                s = _sandwich_sum(y_row, h_row, pw_ptr, cols, width, first, scale, s_ptr.dtype.element_ty, OUT_SCALE)
                tl.store(s_ptr + m * width + cols, s.to(s_ptr.dtype.element_ty), mask=cols < width)
                total += square_sum(s)
            if NORM_OUT:
                factor = norm_factor(total, count, eps, True)
                for c in tl.static_range(CHUNKS):
                    cols = c * BLOCK + tl.arange(0, BLOCK)
                    ok = cols < width
                    s = _sandwich_sum(y_row, h_row, pw_ptr, cols, width, first, scale, s_ptr.dtype.element_ty,
                                      OUT_SCALE)
                    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                    o = normed(s, factor, w, 1.0, False, True)
                    tl.store(o_ptr + m * width + cols, o.to(o_ptr.dtype.element_ty), mask=ok)
        tl.store(counter, 0)


@triton.jit
def _sandwich_sum(y_row, h_row, pw_ptr, cols, width, factor, scale, SUM_DTYPE: tl.constexpr, OUT_SCALE: tl.constexpr):
    """Values `cols` of h + (y · factor · pw rounded into SUM_DTYPE), rounded, times `scale` with
    OUT_SCALE and rounded again (norm_kernel's _norm_out with ADD_TO); masked lanes 0."""
    ok = cols < width
    y = tl.load(y_row + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    pw = tl.load(pw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_row + cols, mask=ok, other=0.0).to(tl.float32)
    s = _rounded(h + _rounded(normed(y, factor, pw, 1.0, False, True), SUM_DTYPE), SUM_DTYPE)
    if OUT_SCALE:
        s = _rounded(s * scale, SUM_DTYPE)
    return s


@triton.jit
def _norm_tail(y_ptr, h_ptr, w_ptr, s_ptr, o_ptr, counter, tiles, width, stride_y, count, eps, ROWS: tl.constexpr,
               BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Once all `tiles` tiles have stored their part of y (_last_arrival on the launch's counter), the
    last of them: for each of the ROWS rows, s = h + y rounded into s's dtype and o = rms_norm(s) ·
    w (norm_row: norm_kernel's residual form, its bits), s and o contiguous [ROWS, width] like h,
    each row's reduction over blocks of BLOCK values in the same order whatever ROWS is (one block,
    or CHUNKS blocks as norm_kernel's, unrolled); then the counter is zeroed for the next launch. y
    is read from L2 (.cg): other multiprocessors wrote it."""
    if _last_arrival(counter, tiles):
        if CHUNKS > 1:
            for m in tl.static_range(ROWS):
                h_row = h_ptr + m * width
                y_row = y_ptr + m * stride_y
                factor = blocked_norm_factor(h_row, y_row, width, count, eps, s_ptr.dtype.element_ty, True, True, "",
                                             ".cg", BLOCK, CHUNKS)
                for c in tl.static_range(CHUNKS):
                    cols = c * BLOCK + tl.arange(0, BLOCK)
                    ok = cols < width
                    s = norm_input(h_row, y_row, cols, width, s_ptr.dtype.element_ty, True, "", ".cg")
                    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                    tl.store(s_ptr + m * width + cols, s.to(s_ptr.dtype.element_ty), mask=ok)
                    o = normed(s, factor, w, 1.0, False, True)
                    tl.store(o_ptr + m * width + cols, o.to(o_ptr.dtype.element_ty), mask=ok)
        else:
            cols = tl.arange(0, BLOCK)
            ok = cols < width
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            for m in tl.static_range(ROWS):
                y = tl.load(y_ptr + m * stride_y + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                h = tl.load(h_ptr + m * width + cols, mask=ok, other=0.0).to(tl.float32)
                s, o = norm_row(h, y, w, count, eps, 1.0, s_ptr.dtype.element_ty, True, True, False, True)
                tl.store(s_ptr + m * width + cols, s.to(s_ptr.dtype.element_ty), mask=ok)
                tl.store(o_ptr + m * width + cols, o.to(o_ptr.dtype.element_ty), mask=ok)
        tl.store(counter, 0)


@triton.jit
def _last_arrival(counter, splits):
    """Whether this program is the last of its tile's `splits` pieces to have stored its part: all
    the program's threads' stores done (the barrier), one atomic increment of the tile's counter
    that releases them to the GPU and acquires the others' (acq_rel at gpu scope; Triton broadcasts
    the old count from the one thread that made it through shared memory, behind another barrier,
    so every thread reads the parts after the acquire). The semaphore of CUTLASS's serial split-K."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == splits - 1
