"""RMSNorm and its neighbours in one Triton launch each (float32 inside, one rounding out).

    rms_norm(x, weight, eps, residual=None, gate=None, out_dtype=None, add_to=None, out_scale=None)
        -> y  (or (x + residual, y))
    l2_norm(x, eps, scale=None) -> float32 y

* rms_norm: y = x · (mean(x²) + eps)^(-1/2) ⊙ weight over the last axis, the formula of
  runtime/graphs/ops.py `rms_norm` (the GGUF weight already holds any +1), in `out_dtype` (x's by
  default). With `residual`: s = x + residual rounded into x's dtype, normalised, and returned with y
  (the residual add of a block and the next norm). With `gate`: y rounded into x's dtype, then
  · silu(gate) in float32 (the gated norm of Gated DeltaNet; out_dtype float32 by default). With
  `add_to` h: h + y, y rounded first (Gemma's sandwich norm joining the residual stream), and with
  `out_scale` (one float32 value) that sum rounded and scaled (Gemma 4's layer output scale): the
  torch formula's three roundings, one launch instead of four.
* l2_norm: y = x · (Σ x² + eps)^(-1/2), float32 (q and k of Gated DeltaNet); with `scale`, y · scale
  rounded after the norm (q's dk^(-1/2): the reference's two float32 roundings).

x, residual, gate: [..., width], float32 / bfloat16 / float16, on CUDA (or the CPU under the
interpreter), the last dimension contiguous; up to three dimensions are read through their strides
(a head's slice of a projection needs no copy). One program per row: its sum does not depend on the
other rows, so a row gives the same bits alone or in a batch. A row wider than ROW_CHUNK values is
summed in chunks of it, in order.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common

MAX_WIDTH = 1 << 15  # wider rows take the torch reference
# a row up to this wide is one block of one program; a wider one is cut in blocks this wide (the
# program's sum of squares over the blocks in order, then each block normed): one layout, and one
# number of warps, for every row
ROW_CHUNK = 2048
WARPS = 4


def as_rows(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """t as [A, B, width] read through its strides (more leading dimensions are merged, a copy
    where their strides do not allow a view)."""
    _common.check_float(op, name, t)
    if t.dim() == 0 or t.shape[-1] == 0:
        raise SpecconvError(f"{op}: {name} has shape {tuple(t.shape)}, expected [..., width]")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() > 3:
        t = t.flatten(0, -3)
    return t.reshape((1,) * (3 - t.dim()) + tuple(t.shape))


def row_block(width: int) -> tuple[int, int]:
    """(block, blocks): the block of values a program takes of a row `width` values wide, and how many
    of them make the row (norm_kernel CHUNKS; the product kernel's norm tail alike)."""
    block = min(_common.next_power_of_2(width), ROW_CHUNK)
    return block, _common.cdiv(width, block)


def _norm(op: str, x, weight, eps: float, residual, gate, out_dtype, mean: bool, scale: float | None = None,
          add_to: torch.Tensor | None = None, out_scale: torch.Tensor | None = None):
    width = x.shape[-1]
    if width > MAX_WIDTH:
        raise SpecconvError(f"{op}: rows of {width} values (at most {MAX_WIDTH})")
    rows3 = as_rows(op, "x", x)
    device = _common.check_device(op, x)
    tensors = {"residual": residual, "gate": gate}
    views = {}
    for name, t in tensors.items():
        if t is not None:
            _common.check_shape(op, name, t, tuple(x.shape))
            _common.check_device(op, x, t)
            views[name] = as_rows(op, name, t)
    if weight is not None:
        _common.check_shape(op, "weight", weight, (width,))
        _common.check_device(op, x, weight)
        _common.check_float(op, "weight", weight)
        weight = weight.contiguous()
    if add_to is not None:
        if add_to.dtype != out_dtype:
            raise SpecconvError(f"{op}: add_to must be {out_dtype} (got {add_to.dtype})")
        _common.check_shape(op, "add_to", add_to, tuple(x.shape))
        _common.check_device(op, x, add_to)
        add_to = add_to.contiguous()
    if out_scale is not None:
        if add_to is None or out_scale.numel() != 1 or out_scale.dtype != torch.float32:
            raise SpecconvError(f"{op}: out_scale is one float32 value, with add_to")
        _common.check_device(op, x, out_scale)
    y = torch.empty(x.shape, dtype=out_dtype, device=device)
    total = torch.empty(x.shape, dtype=x.dtype, device=device) if residual is not None else None
    a, inner, _ = rows3.shape
    if a * inner == 0:
        return y if total is None else (total, y)
    res, z = views.get("residual", rows3), views.get("gate", rows3)
    block, chunks = row_block(width)
    jit = _common.jit_module("_pointwise_jit")
    jit.norm_kernel[(a * inner,)](rows3, res, y if total is None else total, x if weight is None else weight, z,
                                  y if add_to is None else add_to, y if out_scale is None else out_scale, y,
                                  inner, width, float(width), rows3.stride(0), rows3.stride(1), res.stride(0),
                                  res.stride(1), z.stride(0), z.stride(1), float(eps),
                                  1.0 if scale is None else float(scale), MEAN=mean, HAS_W=weight is not None,
                                  HAS_RES=residual is not None, HAS_GATE=gate is not None,
                                  HAS_SCALE=scale is not None, ADD_TO=add_to is not None,
                                  OUT_SCALE=out_scale is not None, BLOCK=block, CHUNKS=chunks, num_warps=WARPS,
                                  enable_fp_fusion=False)
    return y if total is None else (total, y)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             add_to: torch.Tensor | None = None, out_scale: torch.Tensor | None = None):
    if out_dtype is None:
        out_dtype = torch.float32 if gate is not None else x.dtype
    if out_dtype not in _common.FLOAT_DTYPES:
        raise SpecconvError(f"rms_norm: out_dtype must be float32, bfloat16 or float16 (got {out_dtype})")
    if add_to is not None and (residual is not None or gate is not None):
        raise SpecconvError("rms_norm: add_to goes with neither residual nor gate")
    return _norm("rms_norm", x, weight, eps, residual, gate, out_dtype, mean=True, add_to=add_to,
                 out_scale=out_scale)


def l2_norm(x: torch.Tensor, eps: float, scale: float | None = None) -> torch.Tensor:
    return _norm("l2_norm", x, None, eps, None, None, torch.float32, mean=False, scale=scale)
