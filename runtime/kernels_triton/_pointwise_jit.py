"""Triton kernels around the products: norms, rope, the GLU products (SwiGLU's, GeGLU's) and the
Gated DeltaNet's gates (imported on first use; needs Triton). The wrappers are norm.py, rope.py and
activation.py.

Every kernel computes in float32 and rounds once into the output dtype, with the operations of the
torch reference formula in its order (runtime/backend_torch.py): where the reference rounds an
intermediate into the compute dtype (SwiGLU's silu, a residual sum, a norm before its gate), the
kernel rounds it too. Divisions and square roots are the correctly rounded ones (div_rn, sqrt_rn),
as the CPU computes them; the launches ask the compiler not to contract a product and a sum into
one FMA. A row's reduction is one program's sum over a block whose size depends on the row's width
only, so a row gives the same bits alone or in a batch of any size.

Where a result is held to a few ulps of the reference (the Gated DeltaNet's decay: softplus over
[-60, 40]), e^x and log(1 + x) on a GPU are the CUDA math library's (libdevice: within 2 ulps):
Triton's tl.exp is a hardware approximation whose error grows with |x| (32 ulps of softplus at
|x| = 60, measured on an H200). The interpreter, which has no libdevice, takes numpy's.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from specconv.runtime.kernels_triton import _common, activation

ACCURATE_MATH = tl.constexpr(not _common.interpreting())  # libdevice's e^x and log1p (none in the interpreter)
NEOX = tl.constexpr(0)  # rotate pairs (i, i + d/2)
NORM = tl.constexpr(1)  # rotate pairs (2i, 2i + 1)


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x (float32) rounded into `dtype` and widened back: the value the reference holds there."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _silu(x):
    return tl.div_rn(x, 1.0 + tl.exp(-x))


@triton.jit
def inverse_root(total, eps):
    """(total + eps)^(-1/2) as a norm scales by it: correctly rounded root, then reciprocal."""
    return tl.div_rn(1.0, tl.sqrt_rn(total + eps))


@triton.jit
def square_sum(x):
    """Σ x² of a block of float32 values (masked lanes 0). Each square is an FMA with a zero addend
    (one rounding, the product's value): no launch's FMA contraction can merge it with the sum."""
    return tl.sum(tl.fma(x, x, 0.0), axis=0)


@triton.jit
def norm_factor(total, count, eps, MEAN: tl.constexpr):
    """(total (/ count with MEAN) + eps)^(-1/2): what a norm scales its row by."""
    if MEAN:
        total = tl.div_rn(total, count)
    return inverse_root(total, eps)


@triton.jit
def normed(x, factor, w, scale, HAS_SCALE: tl.constexpr, HAS_W: tl.constexpr):
    """x · factor (· scale) (· w), in that order."""
    y = x * factor
    if HAS_SCALE:
        y = y * scale
    if HAS_W:
        y = y * w
    return y


@triton.jit
def norm_row(x, res, w, count, eps, scale, SUM_DTYPE: tl.constexpr, MEAN: tl.constexpr, HAS_RES: tl.constexpr,
             HAS_SCALE: tl.constexpr, HAS_W: tl.constexpr):
    """(s, y) of one row of float32 values x (masked lanes 0) held in one block: s = x (+ res, rounded
    into SUM_DTYPE), y = s · (Σ s² (/ count with MEAN) + eps)^(-1/2) (· scale) (· w). The one formula
    of norm_kernel and of the product kernel's norm tail (_quant_jit), so both give a row the same
    bits. Rows wider than a block go in blocks (norm_kernel CHUNKS, _tail_jit._norm_tail):
    blocked_norm_factor, then `normed` block by block."""
    if HAS_RES:
        x = _rounded(x + res, SUM_DTYPE)
    return x, normed(x, norm_factor(square_sum(x), count, eps, MEAN), w, scale, HAS_SCALE, HAS_W)


@triton.jit
def norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, z_ptr, h_ptr, s_ptr, y_ptr, inner, width, count, stride_xa,
                stride_xb, stride_ra, stride_rb, stride_za, stride_zb, eps, scale, MEAN: tl.constexpr,
                HAS_W: tl.constexpr, HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SCALE: tl.constexpr,
                ADD_TO: tl.constexpr, OUT_SCALE: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Row r (= a · inner + b) of x [A, inner, width]: s = x (+ res, rounded into sum's dtype and
    written to sum), y = s · (Σ s² (/ width with MEAN) + eps)^(-1/2) (· scale, rounded after the
    norm) (· w) (norm_row), with a gate rounded into x's dtype first and multiplied by silu(z); y,
    sum contiguous [A · inner, width]. `count`: width as a float (the mean's divisor). With ADD_TO,
    y is rounded into y's dtype and added to row r of h (contiguous, y's dtype): a sandwich norm's
    output joining the residual stream; with OUT_SCALE that sum, rounded, times the float32 scalar
    at s_ptr (a layer's output scale). The row is one block of BLOCK values, or CHUNKS > 1 blocks:
    their sums of squares first, added in order, then each block normed (s computed again, the same
    bits). The blocks are unrolled, so that their loads are in flight together."""
    r = tl.program_id(0).to(tl.int64)  # rows times their stride pass 2^31 in a long prompt
    a = r // inner
    b = r % inner
    x_row = x_ptr + a * stride_xa + b * stride_xb
    res_row = res_ptr + a * stride_ra + b * stride_rb
    if CHUNKS > 1:
        factor = blocked_norm_factor(x_row, res_row, width, count, eps, sum_ptr.dtype.element_ty, MEAN, HAS_RES, "",
                                     "", BLOCK, CHUNKS)
        for c in tl.static_range(CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            s = norm_input(x_row, res_row, cols, width, sum_ptr.dtype.element_ty, HAS_RES, "", "")
            w = s
            if HAS_W:
                w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
            _norm_out(s, normed(s, factor, w, scale, HAS_SCALE, HAS_W), r, a, b, cols, width, x_ptr, sum_ptr, z_ptr,
                      h_ptr, s_ptr, y_ptr, stride_za, stride_zb, HAS_RES, HAS_GATE, ADD_TO, OUT_SCALE)
    else:
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        res = x
        if HAS_RES:
            res = tl.load(res_row + cols, mask=ok, other=0.0).to(tl.float32)
        w = x
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x, y = norm_row(x, res, w, count, eps, scale, sum_ptr.dtype.element_ty, MEAN, HAS_RES, HAS_SCALE, HAS_W)
        _norm_out(x, y, r, a, b, cols, width, x_ptr, sum_ptr, z_ptr, h_ptr, s_ptr, y_ptr, stride_za, stride_zb,
                  HAS_RES, HAS_GATE, ADD_TO, OUT_SCALE)


@triton.jit
def norm_input(x_row, res_row, cols, width, SUM_DTYPE: tl.constexpr, HAS_RES: tl.constexpr, X_CACHE: tl.constexpr,
               RES_CACHE: tl.constexpr):
    """float32 values `cols` of a row: x, or x + res rounded into SUM_DTYPE (norm_row's s). X_CACHE,
    RES_CACHE: the loads' cache modifiers ("" or ".cg", for values other multiprocessors just wrote)."""
    ok = cols < width
    x = tl.load(x_row + cols, mask=ok, other=0.0, cache_modifier=X_CACHE).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_row + cols, mask=ok, other=0.0, cache_modifier=RES_CACHE).to(tl.float32)
        x = _rounded(x + res, SUM_DTYPE)
    return x


@triton.jit
def blocked_norm_factor(x_row, res_row, width, count, eps, SUM_DTYPE: tl.constexpr, MEAN: tl.constexpr,
                        HAS_RES: tl.constexpr, X_CACHE: tl.constexpr, RES_CACHE: tl.constexpr, BLOCK: tl.constexpr,
                        CHUNKS: tl.constexpr):
    """The first pass of a row wider than a block (norm_kernel's and the product tail's alike): the
    square_sum of each of its CHUNKS blocks of norm_input, added in order from 0.0, made into the
    norm's factor. The blocks are unrolled, so that their loads are in flight together."""
    total = 0.0
    for c in tl.static_range(CHUNKS):
        total += square_sum(norm_input(x_row, res_row, c * BLOCK + tl.arange(0, BLOCK), width, SUM_DTYPE, HAS_RES,
                                       X_CACHE, RES_CACHE))
    return norm_factor(total, count, eps, MEAN)


@triton.jit
def _norm_out(s, y, r, a, b, cols, width, x_ptr, sum_ptr, z_ptr, h_ptr, s_ptr, y_ptr, stride_za, stride_zb,
              HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, ADD_TO: tl.constexpr, OUT_SCALE: tl.constexpr):
    """norm_kernel's stores for values `cols` of row r: s (with a residual), y after its gate or its
    add to h (and scale)."""
    ok = cols < width
    if HAS_RES:
        tl.store(sum_ptr + r * width + cols, s.to(sum_ptr.dtype.element_ty), mask=ok)
    if HAS_GATE:
        z = tl.load(z_ptr + a * stride_za + b * stride_zb + cols, mask=ok, other=0.0).to(tl.float32)
        y = _rounded(y, x_ptr.dtype.element_ty) * _silu(z)
    if ADD_TO:
        h = tl.load(h_ptr + r * width + cols, mask=ok, other=0.0).to(tl.float32)
        y = h + _rounded(y, y_ptr.dtype.element_ty)
        if OUT_SCALE:
            y = _rounded(y, y_ptr.dtype.element_ty) * tl.load(s_ptr).to(tl.float32)
    tl.store(y_ptr + r * width + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_head(src, dst, cos_row, sin_row, w_ptr, half, head_dim, count, eps, STYLE: tl.constexpr,
               NORMED: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """One head at src (head_dim values, contiguous): its first 2·half values rotated pairwise by the
    angles at cos_row / sin_row (NEOX or NORM pairs), the rest copied, into dst. With NORMED the head
    is RMS-normed first (x · (Σ x² / count + eps)^(-1/2) ⊙ w over head_dim, rounded into src's dtype:
    a per-head q or k norm), then rotated."""
    i = tl.arange(0, BLOCK_HALF)
    ok = i < half
    if STYLE == NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    x1 = tl.load(src + first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=ok, other=0.0).to(tl.float32)
    if BLOCK_REST > 0:
        j = 2 * half + tl.arange(0, BLOCK_REST)
        rest = j < head_dim
        xr = tl.load(src + j, mask=rest, other=0.0).to(tl.float32)
    if NORMED:
        total = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
        if BLOCK_REST > 0:
            total += tl.sum(xr * xr, axis=0)
        inv = inverse_root(tl.div_rn(total, count), eps)
        x1 = _rounded(x1 * inv * tl.load(w_ptr + first, mask=ok, other=0.0).to(tl.float32), src.dtype.element_ty)
        x2 = _rounded(x2 * inv * tl.load(w_ptr + second, mask=ok, other=0.0).to(tl.float32), src.dtype.element_ty)
        if BLOCK_REST > 0:
            xr = xr * inv * tl.load(w_ptr + j, mask=rest, other=0.0).to(tl.float32)
    c = tl.load(cos_row + i, mask=ok, other=0.0)
    s = tl.load(sin_row + i, mask=ok, other=0.0)
    tl.store(dst + first, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + second, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=ok)
    if BLOCK_REST > 0:
        tl.store(dst + j, xr.to(dst.dtype.element_ty), mask=rest)


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, y_ptr, heads, half, head_dim, count, eps, stride_xn, stride_xh,
                stride_cn, stride_sn, STYLE: tl.constexpr, NORMED: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_REST: tl.constexpr):
    """Head h of token t (program t · heads + h) of x [n, heads, head_dim] by _rope_head with the
    angles of row t of cos / sin [n, half]; y contiguous [n, heads, head_dim]."""
    p = tl.program_id(0).to(tl.int64)  # tokens times heads times head_dim pass 2^31 in a long prompt
    t = p // heads
    h = p % heads
    _rope_head(x_ptr + t * stride_xn + h * stride_xh, y_ptr + p * head_dim, cos_ptr + t * stride_cn,
               sin_ptr + t * stride_sn, w_ptr, half, head_dim, count, eps, STYLE, NORMED, BLOCK_HALF, BLOCK_REST)


@triton.jit
def qk_rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qy_ptr, ky_ptr, vy_ptr, cells_ptr,
                   q_heads, k_heads, half, head_dim, dv, count, eps, stride_qn, stride_qh, stride_kn, stride_kh,
                   stride_vn, stride_vh, stride_cn, stride_sn, stride_kyt, stride_kyh, stride_vyt, stride_vyh,
                   STYLE: tl.constexpr, Q_NORMED: tl.constexpr, K_NORMED: tl.constexpr, STORE: tl.constexpr,
                   V_NORMED: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """q [n, q_heads, head_dim] and k [n, k_heads, head_dim] of one layer, each head by _rope_head
    with the angles of its token's row (program t · (q_heads + k_heads) + h: a q head for h <
    q_heads, else k head h - q_heads), each with its own norm weight when Q_NORMED / K_NORMED: the
    operations rope_kernel makes for it. q's heads go to qy contiguous [n, q_heads, head_dim]; k's
    to row t of ky (strides stride_kyt, stride_kyh), or with STORE to row cells[t] of the K cache
    ky, where the k head's program also copies v[t, h] into row cells[t] of the V cache vy, bits
    unchanged (write_kv_kernel's copy), or with V_NORMED RMS-normed without a weight over its dv
    values first (norm_row: norm_kernel's formula; Gemma 4's V norm)."""
    p = tl.program_id(0)
    heads = q_heads + k_heads
    t = (p // heads).to(tl.int64)  # tokens times a row's stride pass 2^31 in a long prompt
    h = p % heads
    cos_row = cos_ptr + t * stride_cn
    sin_row = sin_ptr + t * stride_sn
    if h < q_heads:
        _rope_head(q_ptr + t * stride_qn + h * stride_qh, qy_ptr + (t * q_heads + h) * head_dim, cos_row, sin_row,
                   qw_ptr, half, head_dim, count, eps, STYLE, Q_NORMED, BLOCK_HALF, BLOCK_REST)
    else:
        hk = h - q_heads
        if STORE:
            row = tl.load(cells_ptr + t).to(tl.int64)
        else:
            row = t.to(tl.int64)
        _rope_head(k_ptr + t * stride_kn + hk * stride_kh, ky_ptr + row * stride_kyt + hk * stride_kyh, cos_row,
                   sin_row, kw_ptr, half, head_dim, count, eps, STYLE, K_NORMED, BLOCK_HALF, BLOCK_REST)
        if STORE:
            d = tl.arange(0, BLOCK_DV)
            values = tl.load(v_ptr + t * stride_vn + hk * stride_vh + d, mask=d < dv, other=0.0)
            if V_NORMED:
                x = values.to(tl.float32)
                _, y = norm_row(x, x, x, dv * 1.0, eps, 1.0, vy_ptr.dtype.element_ty, True, False, False, False)
                values = y.to(vy_ptr.dtype.element_ty)
            tl.store(vy_ptr + row * stride_vyt + hk * stride_vyh + d, values, mask=d < dv)



@triton.jit
def rope_table_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, half, divisor, scale, HAS_DIVISOR: tl.constexpr,
                      HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """Row t (program t) of cos / sin [n, half] (contiguous): the angles p · inv[i], p the position
    as float32 (divided by `divisor`, correctly rounded, with HAS_DIVISOR), each cos and sin times
    `scale` with HAS_SCALE: the float32 operations of runtime/backend_torch.py `rope_table`."""
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < half
    p = tl.load(pos_ptr + t).to(tl.float32)
    if HAS_DIVISOR:
        p = tl.math.div_rn(p, divisor)
    angles = p * tl.load(inv_ptr + i, mask=ok, other=0.0)
    cos = tl.cos(angles)
    sin = tl.sin(angles)
    if HAS_SCALE:
        cos = cos * scale
        sin = sin * scale
    tl.store(cos_ptr + t * half + i, cos, mask=ok)
    tl.store(sin_ptr + t * half + i, sin, mask=ok)


GELU_BETA = tl.constexpr(0.7978845608028654)  # √(2/π)
GELU_KAPPA = tl.constexpr(0.044715)
# the activation of a GLU (activation.GLU's numbers; NO_ACTIVATION: the input read as it is)
NO_ACTIVATION = tl.constexpr(activation.NO_ACTIVATION)
SILU = tl.constexpr(activation.GLU["silu"])
GELU_TANH = tl.constexpr(activation.GLU["gelu_tanh"])


@triton.jit
def _gelu_tanh(x):
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) as x / (1 + exp(−2·inner)): the same value, with no
    cancellation in 1 + tanh where x is negative. x + 0.044715·x³ is one fused multiply-add (one
    rounding), so the value is the same whether or not a launch lets the compiler contract."""
    inner = GELU_BETA * tl.fma(GELU_KAPPA, x * x * x, x)
    return tl.div_rn(x, 1.0 + tl.exp(-2.0 * inner))


@triton.jit
def _glu(g, u, ACT: tl.constexpr, dtype: tl.constexpr):
    """act(g) · u (float32 in) as the reference computes it in `dtype`: act(g) rounded into dtype, times
    u, rounded again, widened back to float32. No step is a product feeding a sum, so the bits do not
    depend on FMA contraction: the product kernel (_quant_jit), which allows it, reads its activation
    rows through this and gets the values glu_kernel writes."""
    if ACT == SILU:
        a = _silu(g)
    else:
        a = _gelu_tanh(g)
    return _rounded(_rounded(a, dtype) * u, dtype)


@triton.jit
def glu_kernel(g_ptr, u_ptr, y_ptr, width, stride_g, stride_u, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """y = act(g) · u (_glu: SILU or GELU_TANH) for row program_id(0), columns of block program_id(1),
    in y's dtype (the reference's F.silu(g) * u, F.gelu(g, approximate="tanh") * u)."""
    r = tl.program_id(0).to(tl.int64)  # a long prompt's rows times a feed-forward's width pass 2^31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(g_ptr + r * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    y = _glu(g, u, ACT, y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * width + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gdn_gate_values(alpha, bias, a, b):
    """(g, β) = (a · softplus(alpha + bias), σ(b)) in float32 from values of any float dtype: the
    formula of gdn_gates_kernel, which gdn_step_kernel runs too (the same operations: the same bits).
    softplus as torch's (threshold 20) and σ: libdevice's log1p(exp(x)) and exp on a GPU; in the interpreter
    log1p(e) = log(1 + e) · e / ((1 + e) − 1), exact to a few ulps where 1 + e rounds away e's low bits."""
    x = alpha.to(tl.float32) + bias.to(tl.float32)
    if ACCURATE_MATH:
        log1p = libdevice.log1p(libdevice.exp(x))
    else:
        e = tl.exp(x)
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * tl.div_rn(e, tl.where(u == 1.0, 1.0, u - 1.0)))
    softplus = tl.where(x > 20.0, x, log1p)
    if ACCURATE_MATH:  # σ(b) through libdevice's e^x too (tl.exp's approximation: 11 ulps off torch on an H200)
        e_b = libdevice.exp(-b.to(tl.float32))
    else:
        e_b = tl.exp(-b.to(tl.float32))
    return a.to(tl.float32) * softplus, tl.div_rn(1.0, 1.0 + e_b)


@triton.jit
def gdn_gates_kernel(b_ptr, alpha_ptr, a_ptr, bias_ptr, g_ptr, beta_ptr, heads, per_group, stride_b, stride_bg,
                     stride_alpha, stride_ag, BLOCK: tl.constexpr):
    """Token program_id(0): g = a · softplus(alpha + dt_bias), β = σ(b) over its heads (float32). b and
    alpha are read as [n, heads / per_group, per_group] through their strides (head h at group
    h // per_group, element h mod per_group), in their dtype (`gdn_gate_values`)."""
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK)
    ok = h < heads
    alpha = tl.load(alpha_ptr + t * stride_alpha + (h // per_group) * stride_ag + h % per_group, mask=ok,
                    other=0.0)
    bias = tl.load(bias_ptr + h, mask=ok, other=0.0)
    a = tl.load(a_ptr + h, mask=ok, other=0.0)
    b = tl.load(b_ptr + t * stride_b + (h // per_group) * stride_bg + h % per_group, mask=ok, other=0.0)
    g, beta = gdn_gate_values(alpha, bias, a, b)
    tl.store(g_ptr + t * heads + h, g, mask=ok)
    tl.store(beta_ptr + t * heads + h, beta, mask=ok)
