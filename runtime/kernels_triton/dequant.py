"""GGUF-packed weight rows -> values, in one Triton kernel launch.

    dequantize_rows(packed, qtype, rows, n_in, dtype=torch.bfloat16) -> Tensor [rows, n_in]

`packed`: uint8 [rows, row bytes] (or [..., row bytes] whose leading dims hold `rows` rows) exactly as
runtime/stored.py keeps a weight (`StoredWeight.raw`), on a CUDA device (or the CPU under
TRITON_INTERPRET=1); rows may be a strided view as long as each row is contiguous. `qtype` one of
KERNEL_TYPES (Q8_0, Q4_K, Q5_K, Q6_K, BF16, F16, F32). Values are decoded in float32 with
runtime/dequant.py's formulas and operation order (bit-identical to it and to gguf.quants in
float32) and cast to `dtype` once. This is the tile source of the prompt path of
kernels_triton.quant_matmul (dequantize a piece of W, then one dense product).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from specconv.archs.errors import SpecconvError
from specconv.runtime.dequant import row_bytes
from specconv.runtime.kernels_triton import _common
from specconv.runtime.rows_first import Q8_0_ROWS

# type -> (values, bytes) of the unit a kernel step walks: the GGUF block, or 32 values of a
# 16/32-bit float row (whose rows may end part-way through one)
GEOMETRY = {
    QType.Q8_0: GGML_QUANT_SIZES[QType.Q8_0], QType.Q4_K: GGML_QUANT_SIZES[QType.Q4_K],
    QType.Q5_K: GGML_QUANT_SIZES[QType.Q5_K], QType.Q6_K: GGML_QUANT_SIZES[QType.Q6_K],
    QType.BF16: (32, 64), QType.F16: (32, 64), QType.F32: (32, 128),
    Q8_0_ROWS: GGML_QUANT_SIZES[QType.Q8_0],  # runtime/rows_first.py: Q8_0's bytes, each row's values first
}
KERNEL_TYPES = frozenset(GEOMETRY)
BLOCK_N = 32  # weight rows per program
STEP_BLOCKS = 4  # blocks per program


def packed_matrix(op: str, packed: torch.Tensor, qtype: QType, rows: int, n_in: int) -> torch.Tensor:
    """`packed` as a [rows, row bytes] uint8 matrix with contiguous rows, after the checks every
    kernel over packed rows needs (one-line SpecconvErrors)."""
    if qtype not in KERNEL_TYPES:
        raise SpecconvError(f"{op}: no Triton kernel for {getattr(qtype, 'name', qtype)} "
                            f"(covered: {', '.join(sorted(t.name for t in KERNEL_TYPES))})")
    if n_in <= 0:
        raise SpecconvError(f"{op}: rows of {n_in} values")
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise SpecconvError(f"{op}: packed weights must be a uint8 tensor (got {packed.dtype}, "
                            f"shape {tuple(packed.shape)})")
    expected = (rows, row_bytes(qtype, n_in))  # refuses a row of part of a block
    if packed.dim() != 2:
        packed = packed.reshape(-1, packed.shape[-1])
    _common.check_shape(op, "packed", packed, expected)
    _common.check_last_contiguous(op, "packed", packed)
    return packed


def dequantize_rows(packed: torch.Tensor, qtype: QType, rows: int, n_in: int,
                    dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """Values [rows, n_in] in `dtype` (written into `out` when given) of `rows` packed rows."""
    op = "dequantize_rows"
    packed = packed_matrix(op, packed, qtype, rows, n_in)
    device = _common.check_device(op, packed)
    if out is None:
        out = torch.empty(rows, n_in, dtype=dtype, device=device)
    else:
        _common.check_shape(op, "out", out, (rows, n_in))
        _common.check_device(op, packed, out)
    _common.check_float(op, "out", out)
    _common.check_last_contiguous(op, "out", out)
    if rows == 0:
        return out
    values, size = GEOMETRY[qtype]
    jit = _common.jit_module("_quant_jit")
    n_blocks = _common.cdiv(n_in, values)
    grid = (_common.cdiv(rows, BLOCK_N), _common.cdiv(n_blocks, STEP_BLOCKS))
    jit.dequantize_kernel[grid](packed, out, rows, n_in, n_blocks, packed.stride(0), out.stride(0),
                                QTYPE=int(qtype), VALUES=values, BYTES=size, BLOCK_N=BLOCK_N, NB=STEP_BLOCKS,
                                enable_fp_fusion=False)  # (d·scale)·q − dmin·min: two roundings, as the reference
    return out
