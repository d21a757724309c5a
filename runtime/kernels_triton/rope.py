"""Rotary position embedding of q or k in one Triton launch; of a layer's q and k together in one.

    rope(x, cos, sin, style, norm_weight=None, eps=0.0) -> y [n, heads, head_dim] in x's dtype
    rope_qk(q, k, cos, sin, style, q_norm=None, k_norm=None, eps=0.0) -> (q', k'), each rope's result
    rope_qk_store(q, k, v, cos, sin, style, k_cache, v_cache, cells, q_norm=None, k_norm=None, eps=0.0,
                  v_norm=False)
        -> q'; k' and v written into the caches at `cells` (attention.write_kv), no k' tensor
    rope_table(positions, inv_freq, divisor=None, scale=None) -> (cos, sin) float32 [n, half]

x [n, heads, head_dim] (float32 / bfloat16 / float16, the last dimension contiguous, the others read
through their strides); cos, sin float32 [n, half] (runtime/graphs/ops.py `rope_cos_sin`). The first
2·half values of every head are rotated by the angles of their token's row, in float32, then
rounded once; the rest are copied. `style`: "neox" rotates the pairs (i, i + half) (ops.py
`rope_neox_partial`), "norm" the adjacent pairs (2i, 2i + 1) (llama.cpp's NORM rope). With
`norm_weight` [head_dim], every head is RMS-normed first (runtime/graphs/ops.py `rms_norm` over
head_dim, rounded into x's dtype: Qwen3's and Gemma's q and k norms), one launch for both steps.

rope_qk: q [n, q_heads, hd] and k [n, k_heads, hd] of one layer (one dtype, the same cos and sin, each
its own optional norm weight), one program per head of either: each head gets the operations `rope`
makes for it, so the same bits as two `rope` calls. rope_qk_store: the same launch writes k' and v
[n, k_heads, dv] into the caches [cells, k_heads, ·] (their dtype k's and v's) at rows `cells`
(int64 [n]) instead of returning k': an attention layer's norms, rope and K/V store in one launch.
With `v_norm`, each head of v is RMS-normed without a weight (eps; over dv, rounded into v's dtype:
Gemma 4's V norm, norm.rms_norm(v, None, eps)'s formula) before it is stored.

rope_table: the angles of a batch's rows, cos / sin [n, half] = cos / sin(p · inv_freq[i]) for p each
position (int32 / int64 [n]) as float32, divided by `divisor` first (linear rope scaling), times
`scale` (YaRN's attention factor) when given: runtime/backend_torch.py `rope_table`'s float32
operations (correctly rounded product and quotient; cos and sin from Triton's libdevice, the CUDA
math library's functions), one launch where four to six torch operations ran.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common
from specconv.runtime.kernels_triton.attention import check_stored_rows

STYLES = {"neox": 0, "norm": 1}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox",
         norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    op = "rope"
    _check(op, x, cos, sin, style, norm_weight)
    n, heads, head_dim = x.shape
    half = cos.shape[1]
    if norm_weight is not None:
        norm_weight = norm_weight.contiguous()
    y = torch.empty(n, heads, head_dim, dtype=x.dtype, device=x.device)
    if n * heads == 0:
        return y
    rest = head_dim - 2 * half
    jit = _common.jit_module("_pointwise_jit")
    jit.rope_kernel[(n * heads,)](x, cos, sin, cos if norm_weight is None else norm_weight, y, heads, half, head_dim,
                                  float(head_dim), float(eps), x.stride(0), x.stride(1), cos.stride(0),
                                  sin.stride(0), STYLE=STYLES[style], NORMED=norm_weight is not None,
                                  BLOCK_HALF=_common.next_power_of_2(half),
                                  BLOCK_REST=_common.next_power_of_2(rest) if rest else 0, num_warps=1,
                                  enable_fp_fusion=False)
    return y


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox",
            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
            eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    q_norm, k_norm = _check_qk("rope_qk", q, k, cos, sin, style, q_norm, k_norm)
    yq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    yk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_qk(q, k, cos, sin, style, q_norm, k_norm, eps, yq, yk)
    return yq, yk


def rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  style: str, k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 0.0, v_norm: bool = False) -> torch.Tensor:
    op = "rope_qk_store"
    q_norm, k_norm = _check_qk(op, q, k, cos, sin, style, q_norm, k_norm)
    if k_cache.dim() != 3 or v_cache.dim() != 3:
        raise SpecconvError(f"{op}: expected caches [cells, kv_heads, d] (got {tuple(k_cache.shape)}, "
                            f"{tuple(v_cache.shape)})")
    n = q.shape[0]
    if cells.dim() != 1 or cells.shape[0] != n or cells.dtype != torch.int64 or (n > 1 and cells.stride(0) != 1):
        raise SpecconvError(f"{op}: cells must be a contiguous int64 vector of {n} (got {cells.dtype} "
                            f"{tuple(cells.shape)})")
    _common.check_shape(op, "k_cache", k_cache, (k_cache.shape[0], *k.shape[1:]))
    _common.check_shape(op, "v", v, (n, k.shape[1], v_cache.shape[2]))
    _common.check_shape(op, "v_cache", v_cache, (k_cache.shape[0], *v.shape[1:]))
    check_stored_rows(op, k, v, k_cache, v_cache)
    _common.check_device(op, q, k, v, k_cache, v_cache, cells)
    yq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_qk(q, k, cos, sin, style, q_norm, k_norm, eps, yq, k_cache, v, v_cache, cells, v_norm)
    return yq


def _check(op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
           norm_weight: torch.Tensor | None) -> None:
    if style not in STYLES:
        raise SpecconvError(f"{op}: style must be one of {sorted(STYLES)}, not {style!r}")
    if x.dim() != 3 or cos.dim() != 2:
        raise SpecconvError(f"{op}: expected x [n, heads, head_dim] and cos, sin [n, half] "
                            f"(got x {tuple(x.shape)}, cos {tuple(cos.shape)})")
    n, heads, head_dim = x.shape
    half = cos.shape[1]
    _common.check_float(op, "x", x)
    _common.check_shape(op, "cos", cos, (n, half))
    _common.check_shape(op, "sin", sin, (n, half))
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise SpecconvError(f"{op}: cos and sin must be float32 (got {cos.dtype}, {sin.dtype})")
    if not 1 <= 2 * half <= head_dim:
        raise SpecconvError(f"{op}: {2 * half} rotated values in heads of {head_dim}")
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        _common.check_last_contiguous(op, name, t)
    _common.check_device(op, x, cos, sin)
    if norm_weight is not None:
        _common.check_shape(op, "norm_weight", norm_weight, (head_dim,))
        _common.check_float(op, "norm_weight", norm_weight)
        _common.check_device(op, x, norm_weight)


def _check_qk(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
              q_norm: torch.Tensor | None, k_norm: torch.Tensor | None):
    """q and k checked as `rope` checks x, of one dtype and head size; their norm weights contiguous."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise SpecconvError(f"{op}: expected q [n, q_heads, head_dim] and k [n, k_heads, head_dim] "
                            f"(got q {tuple(q.shape)}, k {tuple(k.shape)})")
    if q.dtype != k.dtype:
        raise SpecconvError(f"{op}: q is {q.dtype}, k {k.dtype}")
    _check(f"{op} (q)", q, cos, sin, style, q_norm)
    _check(f"{op} (k)", k, cos, sin, style, k_norm)
    return tuple(None if w is None else w.contiguous() for w in (q_norm, k_norm))


def _launch_qk(q, k, cos, sin, style, q_norm, k_norm, eps, yq, yk, v=None, yv=None, cells=None,
               v_norm: bool = False) -> None:
    """qk_rope_kernel over every head of q and k: q' into yq (contiguous), k' into row t of yk, or
    with `cells` into row cells[t] of the cache yk and v (RMS-normed per head with `v_norm`) into
    row cells[t] of the cache yv."""
    n, q_heads, head_dim = q.shape
    k_heads, half = k.shape[1], cos.shape[1]
    if n * (q_heads + k_heads) == 0:
        return
    rest = head_dim - 2 * half
    store = cells is not None
    dv = v.shape[2] if store else 0
    if not store:  # unused pointers and strides: any tensor of the right kind
        v, yv, cells = k, yk, cos
    jit = _common.jit_module("_pointwise_jit")
    jit.qk_rope_kernel[(n * (q_heads + k_heads),)](
        q, k, v, cos, sin, cos if q_norm is None else q_norm, cos if k_norm is None else k_norm, yq, yk, yv, cells,
        q_heads, k_heads, half, head_dim, dv, float(head_dim), float(eps), q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), yk.stride(0), yk.stride(1),
        yv.stride(0), yv.stride(1), STYLE=STYLES[style], Q_NORMED=q_norm is not None, K_NORMED=k_norm is not None,
        STORE=store, V_NORMED=store and v_norm, BLOCK_HALF=_common.next_power_of_2(half),
        BLOCK_REST=_common.next_power_of_2(rest) if rest else 0,
        BLOCK_DV=_common.next_power_of_2(dv) if store else 1, num_warps=1, enable_fp_fusion=False)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, divisor: float | None = None,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    op = "rope_table"
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise SpecconvError(f"{op}: positions must be an int32 or int64 vector (got {positions.dtype} "
                            f"{tuple(positions.shape)})")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.shape[0] == 0:
        raise SpecconvError(f"{op}: inv_freq must be a non-empty float32 vector (got {inv_freq.dtype} "
                            f"{tuple(inv_freq.shape)})")
    if divisor is not None and not divisor > 0:
        raise SpecconvError(f"{op}: divisor must be positive (got {divisor})")
    device = _common.check_device(op, positions, inv_freq)
    n, half = positions.shape[0], inv_freq.shape[0]
    cos, sin = (torch.empty(n, half, dtype=torch.float32, device=device) for _ in range(2))
    if n == 0:
        return cos, sin
    jit = _common.jit_module("_pointwise_jit")
    jit.rope_table_kernel[(n,)](positions.contiguous(), inv_freq.contiguous(), cos, sin, half,
                                float(divisor or 1.0), float(1.0 if scale is None else scale),
                                HAS_DIVISOR=divisor is not None, HAS_SCALE=scale is not None,
                                BLOCK=_common.next_power_of_2(half), num_warps=1, enable_fp_fusion=False)
    return cos, sin
