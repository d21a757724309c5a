"""Fast encoders: a run of tensor elements -> the bytes GGUF stores, identical to gguf-py's encoders.

`outtype.encode` (gguf.quants, numpy) is the reference llama.cpp's converter uses; it makes ~12
full-size float32 temporaries per call and runs on one core. These kernels produce the same bytes
on cache-sized pieces into per-thread buffers reused for every piece, with calls that release the
GIL (numpy ufuncs, and the native Q8_0 encoder when it is built: convert/native.py), so several
threads encode different pieces of a tensor at once. Every quantity is computed with the same IEEE
float32 operations in the same order as gguf.quants (division, reciprocal, product, round-half-away
via floor), so the results are bit-identical; a piece holding a NaN or an infinity, whose encoding
depends on NaN payload rules, is passed to the reference encoder instead. BF16 from BF16 is the
source bits, F16, Q4_0 and BF16 from other float types are gguf.quants itself, piece by piece.
K-quants (Q2_K..Q6_K) are convert/kquants.py's encoding, on the native encoder when it is built.

Inputs are flat runs of a tensor in its source dtype (BF16 as uint16 bits, F16, F32 views of the
checkpoint) or in float32 (the result of a value-changing transform); the block types used here
never span rows, so any run that starts and ends on a block boundary encodes independently of its
neighbours.
"""

from __future__ import annotations

import threading

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from specconv.archs.errors import SpecconvError

from .checkpoint import BF16_BITS, as_float32
from . import kquants
from .native import kquants_native, q8_0_native
from .outtype import encode as reference_encode

Q = GGMLQuantizationType

# Elements per piece: a multiple of every block size (32, 256). Each piece costs ~20 numpy calls
# whose dispatch holds the GIL, so pieces must be large for threads to overlap, yet small enough that
# the per-thread work buffers stay in cache: 256K elements measured best (docs/convert.md).
PIECE = 262144
_FAST = {Q.F32, Q.BF16, Q.Q8_0}  # F16 is numpy's own cast, already fast
_NATIVE_Q8_0 = q8_0_native()  # the C encoder when built (same bytes, ~5x the numpy kernel)
_NATIVE_KQ = kquants_native()  # the K-quant C encoder when built (same bytes as kquants.encode)


def encoded_size(n_elements: int, ggml_type: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return n_elements // block * size


def encode_run(values: np.ndarray, ggml_type: GGMLQuantizationType, out: np.ndarray | None = None) -> np.ndarray:
    """A contiguous run of elements (any float dtype, any shape) -> its GGUF bytes as flat uint8.

    `out`, when given, is filled and returned (it must hold exactly the encoded size).
    """
    flat = values.reshape(-1)
    n = flat.size
    size = encoded_size(n, ggml_type)
    if out is None:
        out = np.empty(size, dtype=np.uint8)
    elif out.nbytes != size:
        raise ValueError(f"output buffer of {out.nbytes} bytes for {size} encoded bytes")
    step = PIECE
    per_piece = encoded_size(step, ggml_type)
    for i, start in enumerate(range(0, n, step)):
        piece = flat[start:start + step]
        _encode_piece(piece, ggml_type, out[i * per_piece:i * per_piece + encoded_size(piece.size, ggml_type)])
    return out


def passthrough(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray | None:
    """The run's own bytes when encoding would not change them (BF16 from BF16 without NaNs, F32 from
    F32), as a uint8 view (no copy); None when they must be encoded."""
    flat = values.reshape(-1)
    if ggml_type == Q.F32 and flat.dtype == np.float32:
        return flat.view(np.uint8)
    if ggml_type == Q.BF16 and flat.dtype == BF16_BITS:
        if any(_has_nan_bf16(flat[i:i + PIECE]) for i in range(0, flat.size, PIECE)):
            return None  # gguf-py sets the quiet bit of NaNs: encode
        return flat.view(np.uint8)
    return None


class _Scratch(threading.local):
    """Per-thread work buffers, reused for every piece: fresh allocations of this size are page
    faults, and page-table changes serialise the threads of a process."""

    def __init__(self):
        self.buffers: dict[tuple[str, np.dtype], np.ndarray] = {}

    def get(self, name: str, n: int, dtype=np.float32) -> np.ndarray:
        key = (name, np.dtype(dtype))
        buf = self.buffers.get(key)
        if buf is None or buf.size < n:
            buf = self.buffers[key] = np.empty(max(n, PIECE), dtype=dtype)
        return buf[:n]


_scratch = _Scratch()


def _encode_piece(piece: np.ndarray, ggml_type: GGMLQuantizationType, out: np.ndarray) -> None:
    bf16_in = piece.dtype == BF16_BITS
    if ggml_type in kquants.K_TYPES:
        _encode_kquant(piece, ggml_type, out, bf16_in)
        return
    if ggml_type not in _FAST or (ggml_type == Q.BF16 and not bf16_in):
        out[:] = _reference(piece, ggml_type)
        return
    if ggml_type == Q.BF16:
        out[:] = piece.view(np.uint8)  # BF16 -> float32 -> BF16 is exact: the source bits are the answer
        if _has_nan_bf16(piece):  # gguf-py sets the quiet bit of NaNs: let it decide
            out[:] = _reference(piece, ggml_type)
        return
    if ggml_type == Q.F32:
        as_float32(piece, out=out.view(np.float32))
        return
    if _NATIVE_Q8_0 is not None:  # reads BF16 bits and float32 directly
        source = piece if bf16_in or piece.dtype == np.float32 else as_float32(piece, out=_scratch.get("x", piece.size))
        encoded = _NATIVE_Q8_0(source, out, bf16_in)
    else:
        with np.errstate(all="ignore"):  # subnormal scales overflow 1/d exactly as in gguf.quants
            encoded = _q8_0(as_float32(piece, out=_scratch.get("x", piece.size)), out.reshape(-1, 34))
    if not encoded:  # an inf or NaN in some block
        out[:] = _reference(piece, ggml_type)


def _encode_kquant(piece: np.ndarray, ggml_type: GGMLQuantizationType, out: np.ndarray, bf16_in: bool) -> None:
    if _NATIVE_KQ is not None and (bf16_in or piece.dtype == np.float32):
        encoded = _NATIVE_KQ(int(ggml_type), piece, out, bf16_in)
    else:
        x = as_float32(piece, out=_scratch.get("x", piece.size))
        encoded = _NATIVE_KQ(int(ggml_type), x, out, False) if _NATIVE_KQ is not None \
            else kquants.encode(x, ggml_type, out)
    if not encoded:
        raise SpecconvError(f"a tensor to be stored as {ggml_type.name} holds an infinity or NaN "
                            "(llama.cpp's quantize refuses such tensors too)")


def _q8_0(x: np.ndarray, out: np.ndarray) -> bool:
    """Blocks of 32: an F16 scale d = max|x| / 127 and 32 int8 values round(x / d), as gguf.quants.

    Writes `out` ([blocks, 34] uint8) and returns True, or returns False for non-finite input. The
    fallback when the native encoder is not built.
    numpy's ufuncs release the GIL inside their loops, so this kernel runs on several threads at
    once; `x` (float32 scratch) is overwritten.
    """
    n, m = x.size, x.size // 32
    blocks = x.reshape(m, 32)
    work = _scratch.get("work", n).reshape(m, 32)
    rounded = _scratch.get("rounded", n).reshape(m, 32)
    amax, d = _scratch.get("amax", m).reshape(m, 1), _scratch.get("d", m).reshape(m, 1)
    np.abs(blocks, out=work)
    np.max(work, axis=1, keepdims=True, out=amax)
    if not np.isfinite(amax).all():
        return False
    np.divide(amax, np.float32(127), out=d)
    inverse = np.divide(np.float32(1), d, out=amax)
    inverse[d == 0] = 0
    scaled = np.multiply(blocks, inverse, out=blocks)
    # Round half away from zero, exactly as gguf.quants' np_roundf: floor(a) + floor(2 (a - floor(a)))
    # on a = |scaled|, then the sign bit of `scaled` put back (an integer OR).
    np.abs(scaled, out=work)
    np.floor(work, out=rounded)
    np.subtract(work, rounded, out=work)
    np.add(work, work, out=work)
    np.floor(work, out=work)
    np.add(rounded, work, out=rounded)
    sign_bits = np.bitwise_and(scaled.view(np.uint32), np.uint32(0x80000000), out=scaled.view(np.uint32))
    np.bitwise_or(rounded.view(np.uint32), sign_bits, out=rounded.view(np.uint32))
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = rounded.astype(np.int8).view(np.uint8)  # integral values; -0.0 -> 0
    return True


def _has_nan_bf16(bits: np.ndarray) -> bool:
    """Exponent all ones and a non-zero mantissa."""
    work = np.bitwise_and(bits, 0x7FFF, out=_scratch.get("nan", bits.size, np.uint16))
    return bool(work.max(initial=0) > 0x7F80)  # a reduction: no temporary array (an allocation of this size is an mmap)


def _reference(piece: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    with np.errstate(all="ignore"):  # infinities and NaNs encode as gguf-py encodes them, silently
        return reference_encode(as_float32(piece), ggml_type)
