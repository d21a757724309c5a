"""The optional native dequantizer (runtime/_dequant.c, runtime/dq_blocks.c) behind `dequantize_rows`.

The extension is optional: `pip install -e .` compiles it when a C compiler is present, and the
runtime falls back to the pure-torch decoders of runtime/dequant.py (the same values bit for bit,
slower) when it is not built or cannot be imported. `SPECCONV_NO_NATIVE=1` (every native path of
the project) or `SPECCONV_NO_NATIVE_DEQUANT=1` (this one only) forces the torch path, so tests can
exercise both.

Covered: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, and F16/BF16
widened to float32, on the CPU. The blocks (or rows) of one call are split over up to
`torch.get_num_threads()` threads, GIL released, when every thread gets at least
`min_thread_elements()` values: on torch's own OpenMP threads where the extension finds them
(runtime/_dequant.c; a split then costs microseconds), else on a pthread started per share
(`SPECCONV_NATIVE_PTHREADS=1` forces that fallback; a child made by fork() takes it too), which
only pays for large calls. The pieces of
a chunked product are always decoded on the calling thread.
"""

from __future__ import annotations

import functools
import os

import torch
from gguf import GGMLQuantizationType as QType

# Values a thread must get before a call is split. On torch's OpenMP pool (awake after each torch
# operation) entering a parallel region costs a few microseconds: 128 K values (~10 us of fused
# product on one core) keeps that small while splitting every matrix of a ~1 B model but the
# smallest (docs/runtime.md, "Native dequantization"). A pthread started per call costs tens of
# microseconds and then competes with torch's spinning OpenMP threads for the cores: only calls of
# about a millisecond of work (4 M values) are split that way.
MIN_THREAD_ELEMENTS = 1 << 17
MIN_THREAD_ELEMENTS_PTHREADS = 1 << 22


@functools.lru_cache(maxsize=None)
def _module():
    try:
        from specconv.runtime import _dequant
    except ImportError:
        return None
    return _dequant


@functools.lru_cache(maxsize=None)
def _covered() -> dict[int, tuple[int, int]]:
    module = _module()
    return {} if module is None else dict(module.types())


# switches() bits
NO_NATIVE, NO_NATIVE_DEQUANT, FLOAT_ACTIVATIONS, NO_NATIVE_GDN = 1, 2, 4, 8
_SWITCHES = {NO_NATIVE: "SPECCONV_NO_NATIVE", NO_NATIVE_DEQUANT: "SPECCONV_NO_NATIVE_DEQUANT",
             FLOAT_ACTIVATIONS: "SPECCONV_NATIVE_FLOAT_ACTIVATIONS", NO_NATIVE_GDN: "SPECCONV_NO_NATIVE_GDN"}


def switches() -> int:
    """The bits of the switches above set to "1" in the environment now. Read by the extension
    (getenv) where it is built: every product asks, and os.environ takes about a microsecond per
    name it does not hold (measured: 2-6 % of a 1 B model's forward went to these reads)."""
    module = _module()
    if module is not None and hasattr(module, "switches"):
        return module.switches()
    return sum(bit for bit, name in _SWITCHES.items() if os.environ.get(name) == "1")


def available() -> bool:
    """Whether the extension is built and not switched off by the environment."""
    return _module() is not None and not switches() & (NO_NATIVE | NO_NATIVE_DEQUANT)


def covers(qtype: QType) -> bool:
    """Whether `qtype` rows can be dequantized natively now (built, enabled, type covered)."""
    return available() and int(qtype) in _covered()


def dequantize(raw: torch.Tensor, qtype: QType, out: torch.Tensor | None = None,
               threads: int | None = None) -> torch.Tensor | None:
    """float32 values [..., n] of the uint8 rows `raw` [..., row_bytes], or None where the native
    path does not apply (extension missing or disabled, type not covered, not on the CPU).

    `out`, when given, is a C-contiguous float32 CPU tensor of at least that many elements; the
    values are written to its start and returned as a view of it. Rows that are not contiguous are
    first copied (bytes are at most a quarter of the values' size)."""
    if raw.device.type != "cpu" or raw.dtype != torch.uint8 or not covers(qtype):
        return None
    block, size = _covered()[int(qtype)]
    if raw.shape[-1] % size:
        return None  # dequantize_rows reports the error
    if not raw.is_contiguous():
        raw = raw.contiguous()
    shape = (*raw.shape[:-1], raw.shape[-1] // size * block)
    count = raw.numel() // size * block
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    else:
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < count:
            raise ValueError(f"out must be a contiguous float32 CPU tensor of at least {count} values")
        out = out.view(-1)[:count].view(shape)
    if count:
        _module().dequantize(int(qtype), raw.data_ptr(), raw.numel(), out.data_ptr(), _split(threads, count))
    return out


def thread_pool() -> str | None:
    """Where a split call runs: "openmp" (torch's OpenMP threads), "pthreads" (a thread started per
    share), or None without the extension."""
    return _module().pool() if available() else None


def min_thread_elements() -> int:
    """Values each thread must get before a call is split (MIN_THREAD_ELEMENTS on the OpenMP pool,
    MIN_THREAD_ELEMENTS_PTHREADS on started threads)."""
    return MIN_THREAD_ELEMENTS if thread_pool() == "openmp" else MIN_THREAD_ELEMENTS_PTHREADS


def _split(threads: int | None, elements: int) -> int:
    if threads is None:
        threads = torch.get_num_threads()
    return max(1, min(threads, elements // min_thread_elements()))


def fused_width(qtype: QType) -> int:
    """The vector width in bits of matmul_t()'s kernel for `qtype` that computes the values in
    registers (512: AVX-512, 256: AVX2; Q8_0, Q4_K, Q5_K, Q6_K, BF16, F16), 0 where each row is
    decoded into a buffer first (other types, no AVX2, SPECCONV_NATIVE_PORTABLE=1)."""
    return _module().fused(int(qtype)) if covers(qtype) else 0


def has_fused_kernel(qtype: QType) -> bool:
    """Whether matmul_t() has a vector kernel for `qtype` (fused_width() > 0)."""
    return fused_width(qtype) > 0


def int8_width(qtype: QType) -> int:
    """The vector width in bits of matmul_t()'s kernel with 8-bit activations for `qtype` (512: Q8_0
    with AVX-512 VNNI), 0 where there is none (other types and CPUs, SPECCONV_NATIVE_PORTABLE=1,
    SPECCONV_NATIVE_NO_AVX512=1, an extension built without it)."""
    return _module().i8(int(qtype)) if covers(qtype) and hasattr(_module(), "i8") else 0


def default_activations(qtype: QType) -> str:
    """What matmul_t() multiplies `qtype` weights with by default: "int8" where int8_width() > 0 (the
    activation rows quantized to 8-bit blocks, as llama.cpp's CPU kernels do: its bound in
    runtime/dq_dot_i8.inc) unless SPECCONV_NATIVE_FLOAT_ACTIVATIONS=1, else "float32"."""
    return "float32" if switches() & FLOAT_ACTIVATIONS or not int8_width(qtype) else "int8"


def chunk_decoder(qtype: QType, raw: torch.Tensor, buffer: torch.Tensor):
    """For a chunked product: `decode(start, rows)` dequantizes rows start .. start+rows-1 of the
    C-contiguous uint8 rows `raw` [n, row_bytes] into the start of the float32 `buffer` and returns
    that part of it (flat). Checks once what dequantize() checks per call; single-threaded (the
    pieces are small; the product after each runs on torch's threads)."""
    if not covers(qtype) or raw.device.type != "cpu" or not raw.is_contiguous() or raw.dim() != 2:
        raise ValueError("chunk_decoder needs covered, C-contiguous 2-D uint8 rows on the CPU")
    if buffer.dtype != torch.float32 or not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise ValueError("chunk_decoder needs a contiguous float32 CPU buffer")
    block, size = _covered()[int(qtype)]
    row_bytes = raw.shape[1]
    if row_bytes % size:
        raise ValueError(f"rows of {row_bytes} bytes are not whole {qtype.name} blocks")
    per_row = row_bytes // size * block
    code, base, n_rows, out, room = int(qtype), raw.data_ptr(), raw.shape[0], buffer.data_ptr(), buffer.numel()
    run = _module().dequantize

    def decode(start: int, rows: int) -> torch.Tensor:
        if start < 0 or rows < 0 or start + rows > n_rows or rows * per_row > room:
            raise ValueError(f"rows {start}..{start + rows} do not fit the matrix or the buffer")
        run(code, base + start * row_bytes, rows * row_bytes, out, 1)
        return buffer[:rows * per_row]

    return decode


def matmul_t(x: torch.Tensor, raw: torch.Tensor, qtype: QType, n_in: int,
             threads: int | None = None, activations: str | None = None) -> torch.Tensor | None:
    """x @ Wᵀ for a matrix W stored as `qtype` in the uint8 rows `raw` [n_out, row_bytes], fused:
    W streams from memory once for up to 9 rows of x (16 with 8-bit activations): one pass for a
    decode step or the check of several drafts; the float32 matrix is never written.
    float32 [..., n_out], or None where the native path does not apply (extension missing or
    disabled, type not covered, not float32 on the CPU).

    `activations` (default: default_activations(qtype)):
    * "float32": each block of W dequantized once (the values dequantize() gives), in registers or
      a buffer in cache, and multiplied with the rows of x. Sums run in orders of their own (vector
      lanes, FMA where the CPU has it): the result equals `x @ dense(W).t()` within float32
      summation noise, not bit for bit, and the kernels of other widths (fused_width) and thread
      counts agree with it within the same noise.
    * "int8" (where int8_width(qtype) > 0): each row of x quantized to 8-bit blocks of 32 and
      multiplied by integer dot products, llama.cpp's arithmetic; off the exact product by at most
      Σ_b max_b|x|/254 · Σ_{i∈b}|w_i| (and float32 noise: runtime/dq_dot_i8.inc). A row's result
      does not depend on the other rows of x or the thread count, bit for bit."""
    if (x.dtype != torch.float32 or x.device.type != "cpu" or raw.device.type != "cpu"
            or raw.dtype != torch.uint8 or raw.dim() != 2 or not covers(qtype)):
        return None
    block, size = _covered()[int(qtype)]
    if n_in % block or raw.shape[-1] != n_in // block * size or x.shape[-1] != n_in:
        return None
    if not raw.is_contiguous():
        raw = raw.contiguous()
    if activations is None:
        activations = default_activations(qtype)
    if activations not in ("float32", "int8") or (activations == "int8" and not int8_width(qtype)):
        raise ValueError(f"no {activations} activations for {qtype.name} products here")
    n_out = raw.shape[0]
    xs = x.reshape(-1, n_in).contiguous()
    out = torch.empty(xs.shape[0], n_out, dtype=torch.float32)
    dot = _module().dot_i8 if activations == "int8" else _module().dot
    dot(int(qtype), raw.data_ptr(), n_out, n_in, xs.data_ptr(), xs.shape[0], out.data_ptr(), n_out,
        _split(threads, n_out * n_in))
    return out.reshape(*x.shape[:-1], n_out)
