"""Gated activations in one Triton launch each.

    glu(gate, up, act) -> act(gate) · up          (a GLU's product; gate's dtype; act in GLU)
    silu_mul(gate, up) -> silu(gate) · up        (SwiGLU's: glu(gate, up, "silu"))
    gelu_mul(gate, up) -> gelu_tanh(gate) · up   (GeGLU's: glu(gate, up, "gelu_tanh"))
    gdn_gates(b, alpha, a, dt_bias) -> (g, beta)  (the Gated DeltaNet's gates, float32 [n, heads])

glu: gate, up [..., F] of one float dtype, the last dimension contiguous; act(gate) in float32,
rounded into the dtype, times up in float32, rounded again: the reference's F.silu(gate) * up /
F.gelu(gate, approximate="tanh") * up in that dtype (runtime/backend_torch.py). gelu_tanh(x) =
0.5·x·(1 + tanh(inner)), inner = √(2/π)·(x + 0.044715·x³), computed as x / (1 + exp(−2·inner)): the
same function without the cancellation of 1 + tanh for negative x (within a few float32 ulps of
the reference where that does not cancel). One kernel (_pointwise_jit.glu_kernel) with the
activation a compile-time constant; the product kernel (matmul.quant_matmul with `up`) computes the
same values where it reads its input rows.
gdn_gates: b, alpha [n, heads] or [n, groups, heads / groups] (views of one projection, read
through their strides: no copy), a, dt_bias [heads], any float dtype (loaded into float32, as the
reference casts them first): g = a · softplus(alpha + dt_bias), β = σ(b) (runtime/graphs/gdn.py
`gates`), float32 [n, heads] out.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common

BLOCK = 1024  # columns per program of glu
# a GLU's activation -> its number in the kernels (_pointwise_jit.SILU, GELU_TANH); 0: none
GLU = {"silu": 1, "gelu_tanh": 2}
NO_ACTIVATION = 0


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return glu(gate, up, "silu", op="silu_mul")


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return glu(gate, up, "gelu_tanh", op="gelu_mul")


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, op: str = "glu") -> torch.Tensor:
    """act(gate) · up by _pointwise_jit.glu_kernel: one program per row and block of BLOCK columns."""
    g, u = glu_rows(op, gate, up, act)
    device = g.device
    y = torch.empty(gate.shape, dtype=gate.dtype, device=device)
    if y.numel() == 0:
        return y
    width = g.shape[1]
    block = min(BLOCK, _common.next_power_of_2(width))
    jit = _common.jit_module("_pointwise_jit")
    jit.glu_kernel[(g.shape[0], _common.cdiv(width, block))](g, u, y, width, g.stride(0), u.stride(0), ACT=GLU[act],
                                                             BLOCK=block, enable_fp_fusion=False)
    return y


def glu_rows(op: str, gate: torch.Tensor, up: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as [rows, F] (views where their layout allows), checked: a GLU activation, one float
    dtype and shape, one kernel device, contiguous last dimensions (rows may be strided: the halves of
    a fused gate/up product)."""
    if act not in GLU:
        raise SpecconvError(f"{op}: activation {act!r} is not one of {', '.join(GLU)}")
    _common.check_float(op, "gate", gate)
    if up.dtype != gate.dtype:
        raise SpecconvError(f"{op}: gate and up must have one dtype (got {gate.dtype}, {up.dtype})")
    _common.check_shape(op, "up", up, tuple(gate.shape))
    if gate.dim() == 0:
        raise SpecconvError(f"{op}: gate must have a last dimension")
    _common.check_device(op, gate, up)
    width = gate.shape[-1]
    g, u = gate.reshape(-1, width), up.reshape(-1, width)
    for name, t in (("gate", g), ("up", u)):
        _common.check_last_contiguous(op, name, t)
    return g, u


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
