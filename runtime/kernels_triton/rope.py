"""Rotary position embedding of q or k in one Triton launch.

    rope(x, cos, sin, style, norm_weight=None, eps=0.0) -> y [n, heads, head_dim] in x's dtype

x [n, heads, head_dim] (float32 / bfloat16 / float16, the last dimension contiguous, the others read
through their strides); cos, sin float32 [n, half] (runtime/graphs/ops.py `rope_cos_sin`). The first
2·half values of every head are rotated by the angles of their token's row, in float32, then
rounded once; the rest are copied. `style`: "neox" rotates the pairs (i, i + half) (ops.py
`rope_neox_partial`), "norm" the adjacent pairs (2i, 2i + 1) (llama.cpp's NORM rope). With
`norm_weight` [head_dim], every head is RMS-normed first (runtime/graphs/ops.py `rms_norm` over
head_dim, rounded into x's dtype: Qwen3's and Gemma's q and k norms), one launch for both steps.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common

STYLES = {"neox": 0, "norm": 1}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox",
         norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    op = "rope"
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
    device = _common.check_device(op, x, cos, sin)
    if norm_weight is not None:
        _common.check_shape(op, "norm_weight", norm_weight, (head_dim,))
        _common.check_float(op, "norm_weight", norm_weight)
        _common.check_device(op, x, norm_weight)
        norm_weight = norm_weight.contiguous()
    y = torch.empty(n, heads, head_dim, dtype=x.dtype, device=device)
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
