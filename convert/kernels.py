"""Fast encoders: a run of tensor elements -> the bytes GGUF stores, identical to gguf-py's encoders.

`outtype.encode` (gguf.quants, numpy) is the reference llama.cpp's converter uses; it makes ~12
full-size float32 temporaries per call and runs on one core. These kernels produce the same bytes
from torch ops on small cache-sized pieces, without the Python GIL, so several threads can encode
different pieces of a tensor at once. Every quantity is computed with the same IEEE float32
operations in the same order as gguf.quants (division, reciprocal, product, round-half-away via
floor), so the results are bit-identical; a piece holding a NaN or an infinity, whose encoding
depends on NaN payload rules, is passed to the reference encoder instead.

Inputs are flat runs of a tensor in its source dtype (BF16/F16/F32 views of the checkpoint) or in
float32 (the result of a value-changing transform); the block types used here never span rows, so
any run that starts and ends on a block boundary encodes independently of its neighbours.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from .outtype import encode as reference_encode

Q = GGMLQuantizationType

# Elements per piece: a multiple of every block size (32, 256), small enough that a piece's
# float32 temporaries stay in the L2 cache (measured fastest on 128K-element pieces).
PIECE = 131072
_SIGN_BIT = torch.tensor(-2**31, dtype=torch.int32)
_FAST = {Q.F32, Q.BF16, Q.Q8_0}  # F16 is numpy's own cast, already fast


def encoded_size(n_elements: int, ggml_type: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return n_elements // block * size


def encode_run(values: torch.Tensor, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """A contiguous run of elements (any float dtype, any shape) -> its GGUF bytes as flat uint8."""
    flat = values.reshape(-1)
    n = flat.numel()
    out = np.empty(encoded_size(n, ggml_type), dtype=np.uint8)
    step = PIECE
    per_piece = encoded_size(step, ggml_type)
    with torch.no_grad():
        for i, start in enumerate(range(0, n, step)):
            piece = flat[start:start + step]
            out[i * per_piece:i * per_piece + encoded_size(piece.numel(), ggml_type)] = _encode_piece(piece, ggml_type)
    return out


def _encode_piece(piece: torch.Tensor, ggml_type: GGMLQuantizationType) -> np.ndarray:
    if ggml_type not in _FAST:
        return _reference(piece, ggml_type)
    if ggml_type == Q.BF16 and piece.dtype == torch.bfloat16:
        if _has_nan_bf16(piece):  # gguf-py sets the quiet bit of NaNs: let it decide
            return _reference(piece, ggml_type)
        return _bytes(piece)  # BF16 -> float32 -> BF16 is exact: the source bits are the answer
    x = piece.float()
    if ggml_type == Q.F32:
        return _bytes(x)
    if ggml_type == Q.Q8_0:
        return _q8_0(x)
    if bool(torch.isnan(x).any()):  # gguf-py sets the quiet bit of NaNs: let it decide
        return _reference(piece, ggml_type)
    return _bytes(x.to(torch.bfloat16))


def _q8_0(x: torch.Tensor) -> np.ndarray:
    """Blocks of 32: an F16 scale d = max|x| / 127 and 32 int8 values round(x / d), as gguf.quants."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    if not bool(torch.isfinite(amax).all()):  # an inf or NaN in some block
        return _reference(x, Q.Q8_0)
    d = amax / 127
    inverse = torch.where(d == 0, torch.zeros((), dtype=torch.float32), 1 / d)
    scaled = blocks * inverse
    # Round half away from zero, exactly as gguf.quants' np_roundf: floor(a) + floor(2 (a - floor(a)))
    # on a = |scaled|, then the sign bit of `scaled` put back (an integer OR: torch's copysign is slow).
    a = scaled.abs()
    rounded = a.floor()
    twice_fraction = a - rounded
    rounded += twice_fraction.add_(twice_fraction).floor_()
    sign_bits = scaled.view(torch.int32).bitwise_and_(_SIGN_BIT)
    rounded = rounded.view(torch.int32).bitwise_or_(sign_bits).view(torch.float32)
    out = torch.empty((blocks.shape[0], 34), dtype=torch.uint8)
    out[:, :2] = d.half().view(torch.uint8)
    out[:, 2:] = rounded.to(torch.int8).view(torch.uint8)  # -0.0 -> 0
    return out.numpy().reshape(-1)


def _has_nan_bf16(piece: torch.Tensor) -> bool:
    """Exponent all ones and a non-zero mantissa (numpy's integer kernels: ~8x torch's bf16 isnan)."""
    bits = piece.view(torch.int16).numpy().view(np.uint16)
    return bool(np.any((bits & 0x7FFF) > 0x7F80))


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array (numpy has no bfloat16: go through int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).view(np.uint8)


def _reference(piece: torch.Tensor, ggml_type: GGMLQuantizationType) -> np.ndarray:
    with np.errstate(all="ignore"):  # infinities and NaNs encode as gguf-py encodes them, silently
        return reference_encode(piece.float().numpy(), ggml_type)
