"""Gated activations in one Triton launch each.

    silu_mul(gate, up) -> silu(gate) · up        (SwiGLU's product; gate's dtype)
    gelu_mul(gate, up) -> gelu_tanh(gate) · up   (GeGLU's product; gate's dtype)
    gdn_gates(b, alpha, a, dt_bias) -> (g, beta)  (the Gated DeltaNet's gates, float32 [n, heads])

silu_mul: gate, up [..., F] of one float dtype, the last dimension contiguous; silu in float32,
rounded into the dtype, times up in float32, rounded again: the reference's F.silu(gate) * up in
that dtype (runtime/backend_torch.py). gelu_mul: the same with gelu_tanh(x) = 0.5·x·(1 +
tanh(inner)), inner = √(2/π)·(x + 0.044715·x³), the reference's F.gelu(gate, approximate="tanh")
* up, computed as x / (1 + exp(−2·inner)): the same function without the cancellation of 1 + tanh
for negative x (within a few float32 ulps of the reference where that does not cancel).
gdn_gates: b, alpha [n, heads] or [n, groups, heads / groups] (views of one projection, read
through their strides: no copy), a, dt_bias [heads], any float dtype (loaded into float32, as the
reference casts them first): g = a · softplus(alpha + dt_bias), β = σ(b) (runtime/graphs/gdn.py
`gates`), float32 [n, heads] out.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common

BLOCK = 1024  # columns per program of silu_mul / gelu_mul


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _gated_product("silu_mul", gate, up)


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _gated_product("gelu_mul", gate, up)


def _gated_product(op: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) · up (silu_mul or gelu_mul) by its kernel in _pointwise_jit.py: one program per row and
    block of BLOCK columns."""
    _common.check_float(op, "gate", gate)
    if up.dtype != gate.dtype:
        raise SpecconvError(f"{op}: gate and up must have one dtype (got {gate.dtype}, {up.dtype})")
    _common.check_shape(op, "up", up, tuple(gate.shape))
    if gate.dim() == 0:
        raise SpecconvError(f"{op}: gate must have a last dimension")
    device = _common.check_device(op, gate, up)
    width = gate.shape[-1]
    g, u = gate.reshape(-1, width), up.reshape(-1, width)
    for name, t in (("gate", g), ("up", u)):
        _common.check_last_contiguous(op, name, t)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=device)
    if y.numel() == 0:
        return y
    block = min(BLOCK, _common.next_power_of_2(width))
    jit = _common.jit_module("_pointwise_jit")
    kernel = jit.silu_mul_kernel if op == "silu_mul" else jit.gelu_mul_kernel
    kernel[(g.shape[0], _common.cdiv(width, block))](g, u, y, width, g.stride(0), u.stride(0), BLOCK=block,
                                                     enable_fp_fusion=False)
    return y


def gdn_gates(b: torch.Tensor, alpha: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor):
    op = "gdn_gates"
    if b.dim() not in (2, 3):
        raise SpecconvError(f"{op}: expected b, alpha [n, heads] or [n, groups, heads / groups] "
                            f"(got b {tuple(b.shape)})")
    _common.check_shape(op, "alpha", alpha, tuple(b.shape))
    n, per_group = b.shape[0], b.shape[-1]
    heads = b.shape[1] * b.shape[2] if b.dim() == 3 else per_group
    _common.check_shape(op, "a", a, (heads,))
    _common.check_shape(op, "dt_bias", dt_bias, (heads,))
    for name, t in (("b", b), ("alpha", alpha), ("a", a), ("dt_bias", dt_bias)):
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    device = _common.check_device(op, b, alpha, a, dt_bias)
    g = torch.empty(n, heads, dtype=torch.float32, device=device)
    beta = torch.empty(n, heads, dtype=torch.float32, device=device)
    if n * heads == 0:
        return g, beta
    jit = _common.jit_module("_pointwise_jit")
    groups = (b.stride(1), alpha.stride(1)) if b.dim() == 3 else (0, 0)  # a 2-D row: one group of all heads
    jit.gdn_gates_kernel[(n,)](b, alpha, a, dt_bias, g, beta, heads, max(per_group, 1), b.stride(0), groups[0],
                               alpha.stride(0), groups[1], BLOCK=_common.next_power_of_2(heads),
                               enable_fp_fusion=False)
    return g, beta
