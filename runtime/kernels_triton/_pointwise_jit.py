"""Triton kernels around the products: norms, rope, SwiGLU's and GeGLU's products and the Gated
DeltaNet's gates (imported on first use; needs Triton). The wrappers are norm.py, rope.py and
activation.py.

Every kernel computes in float32 and rounds once into the output dtype, with the operations of the
torch reference formula in its order (runtime/backend_torch.py): where the reference rounds an
intermediate into the compute dtype (SwiGLU's silu, a residual sum, a norm before its gate), the
kernel rounds it too. Divisions and square roots are the correctly rounded ones (div_rn, sqrt_rn),
as the CPU computes them; the launches ask the compiler not to contract a product and a sum into
one FMA. A row's reduction is one program's sum over a block whose size depends on the row's width
only, so a row gives the same bits alone or in a batch of any size.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
def norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, z_ptr, y_ptr, inner, width, count, stride_xa, stride_xb,
                stride_ra, stride_rb, stride_za, stride_zb, eps, scale, MEAN: tl.constexpr, HAS_W: tl.constexpr,
                HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """Row r (= a · inner + b) of x [A, inner, width]: s = x (+ res, rounded into sum's dtype and
    written to sum), y = s · (Σ s² (/ width with MEAN) + eps)^(-1/2) (· scale, rounded after the
    norm) (· w), with a gate rounded into x's dtype first and multiplied by silu(z); y, sum
    contiguous [A · inner, width]. `count`: width as a float (the mean's divisor)."""
    r = tl.program_id(0)
    a = r // inner
    b = r % inner
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + a * stride_ra + b * stride_rb + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(sum_ptr + r * width + cols, x.to(sum_ptr.dtype.element_ty), mask=ok)
        x = _rounded(x, sum_ptr.dtype.element_ty)
    total = tl.sum(x * x, axis=0)
    if MEAN:
        total = tl.div_rn(total, count)
    y = x * inverse_root(total, eps)
    if HAS_SCALE:
        y = y * scale
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_GATE:
        z = tl.load(z_ptr + a * stride_za + b * stride_zb + cols, mask=ok, other=0.0).to(tl.float32)
        y = _rounded(y, x_ptr.dtype.element_ty) * _silu(z)
    tl.store(y_ptr + r * width + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, heads, half, head_dim, stride_xn, stride_xh, stride_cn, stride_sn,
                STYLE: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Head h of token t (program t · heads + h) of x [n, heads, head_dim]: its first 2·half values
    rotated pairwise by the angles of row t of cos / sin [n, half] (NEOX or NORM pairs), the rest
    copied; y contiguous [n, heads, head_dim]."""
    p = tl.program_id(0)
    t = p // heads
    h = p % heads
    src = x_ptr + t * stride_xn + h * stride_xh
    dst = y_ptr + p * head_dim
    i = tl.arange(0, BLOCK_HALF)
    ok = i < half
    if STYLE == NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    x1 = tl.load(src + first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_cn + i, mask=ok, other=0.0)
    s = tl.load(sin_ptr + t * stride_sn + i, mask=ok, other=0.0)
    tl.store(dst + first, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + second, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=ok)
    if BLOCK_REST > 0:
        j = 2 * half + tl.arange(0, BLOCK_REST)
        rest = j < head_dim
        tl.store(dst + j, tl.load(src + j, mask=rest, other=0.0).to(y_ptr.dtype.element_ty), mask=rest)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, y_ptr, width, stride_g, stride_u, BLOCK: tl.constexpr):
    """y = silu(g) · u for row program_id(0), columns of block program_id(1); silu(g) rounded into
    y's dtype first (the reference's F.silu(g) * u in that dtype)."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(g_ptr + r * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    s = _rounded(_silu(g), y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * width + cols, (s * u).to(y_ptr.dtype.element_ty), mask=ok)


GELU_BETA = tl.constexpr(0.7978845608028654)  # √(2/π)
GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _gelu_tanh(x):
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) as x / (1 + exp(−2·inner)): the same value, with no
    cancellation in 1 + tanh where x is negative."""
    inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x))
    return tl.div_rn(x, 1.0 + tl.exp(-2.0 * inner))


@triton.jit
def gelu_mul_kernel(g_ptr, u_ptr, y_ptr, width, stride_g, stride_u, BLOCK: tl.constexpr):
    """y = gelu_tanh(g) · u for row program_id(0), columns of block program_id(1); gelu_tanh(g)
    rounded into y's dtype first (the reference's F.gelu(g, approximate="tanh") * u in that dtype)."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(g_ptr + r * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    s = _rounded(_gelu_tanh(g), y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * width + cols, (s * u).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gdn_gate_values(alpha, bias, a, b):
    """(g, β) = (a · softplus(alpha + bias), σ(b)) in float32 from values of any float dtype: the
    formula of gdn_gates_kernel, which gdn_step_kernel runs too (the same operations: the same bits).
    softplus as torch's (threshold 20) with log1p(e) = log(1 + e) · e / ((1 + e) − 1), exact to a few
    ulps where 1 + e rounds away e's low bits."""
    x = alpha.to(tl.float32) + bias.to(tl.float32)
    e = tl.exp(x)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * tl.div_rn(e, tl.where(u == 1.0, 1.0, u - 1.0)))
    softplus = tl.where(x > 20.0, x, log1p)
    return a.to(tl.float32) * softplus, tl.div_rn(1.0, 1.0 + tl.exp(-b.to(tl.float32)))


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
