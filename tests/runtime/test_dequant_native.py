"""The native dequantizer (runtime/_dequant.c through runtime/dequant_native.py) against the
pure-torch decoders of runtime/dequant.py: the same float32 bits for every covered type, on random
blocks whose scale fields hold chosen f16 values (largest finite, subnormals, signed zeros,
infinities and NaNs), odd row counts, 3-D leading dims, rows that are not contiguous, several
threads, the AVX2 and the plain C kernels; the switch to the torch path; the fused product (AVX-512,
AVX2 and plain C kernels, 1 .. 19 activation rows, each block decoded once per 9 rows, torch's
OpenMP threads and the pthread fallback) and the stored-weight product within a measured float32
summation-noise bound; a missing build fails the run under
SPECCONV_REQUIRE_NATIVE=1 (tests/run.sh)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from specconv.runtime import dequant_native
from specconv.runtime.dequant import dequantize_rows
from tests.fixtures.native import require_native_dequant
from tests.fixtures.quant_rows import F16_FIELDS, SCALE_BITS, sane_rows

torch.set_num_threads(1)

COVERED = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K,
           QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.F16, QType.BF16]


@pytest.fixture(autouse=True)
def native(monkeypatch):
    require_native_dequant()
    monkeypatch.delenv("SPECCONV_NO_NATIVE", raising=False)
    monkeypatch.delenv("SPECCONV_NO_NATIVE_DEQUANT", raising=False)
    # the float32-activation kernels, held here to float32 summation noise; the 8-bit-activation
    # Q8_0 product (the default where the CPU has it) has its own bound: test_int8_product.py
    monkeypatch.setenv("SPECCONV_NATIVE_FLOAT_ACTIVATIONS", "1")


def random_rows(qtype: QType, shape: tuple[int, ...], blocks_per_row: int, seed: int) -> torch.Tensor:
    """uint8 [*shape, row bytes] of random bytes with every f16 scale field set from SCALE_BITS."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (*shape, blocks_per_row, size), dtype=np.uint8)
    n_blocks = raw[..., 0].size
    for offset in F16_FIELDS[qtype]:
        chosen = SCALE_BITS[rng.permutation(np.arange(n_blocks) % len(SCALE_BITS))]
        raw[..., offset:offset + 2] = chosen.view(np.uint8).reshape(*raw.shape[:-1], 2)
    if qtype in (QType.F16, QType.BF16):  # every value of the special list in the data itself
        words = raw.reshape(-1).view(np.uint16)
        words[:len(SCALE_BITS)] = SCALE_BITS
    return torch.from_numpy(raw.reshape(*shape, blocks_per_row * size))


def torch_path(raw: torch.Tensor, qtype: QType, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv("SPECCONV_NO_NATIVE_DEQUANT", "1")
        return dequantize_rows(raw, qtype)


def assert_same_bits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal float32 bit patterns; a NaN only has to be a NaN (torch itself writes different NaN
    payloads on its scalar and vector paths)."""
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours.view(torch.int32)[~nan], expected.view(torch.int32)[~nan])


def test_covered_types():
    assert {QType(t) for t in dequant_native._covered()} == set(COVERED)
    assert dequant_native.covers(QType.Q8_0) and not dequant_native.covers(QType.TQ1_0)
    assert not dequant_native.covers(QType.F32)  # float32 rows are a view already


@pytest.mark.parametrize("portable", [False, True], ids=["fastest", "portable"])
@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_native_equals_torch(qtype, rows, portable, monkeypatch):
    """Both kernel sets: the AVX2 decoders where the CPU has AVX2, and the plain C ones
    (SPECCONV_NATIVE_PORTABLE=1)."""
    if portable:
        monkeypatch.setenv("SPECCONV_NATIVE_PORTABLE", "1")
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_rows(qtype, (rows,), blocks_per_row=3 if block > 1 else 96, seed=rows)
    ours = dequant_native.dequantize(raw, qtype)
    assert ours is not None
    assert_same_bits(ours, torch_path(raw, qtype, monkeypatch))
    assert_same_bits(dequantize_rows(raw, qtype), ours)  # dequantize_rows takes the native path


@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_every_special_scale_in_every_field(qtype, monkeypatch):
    raw = random_rows(qtype, (5,), blocks_per_row=2 * len(SCALE_BITS) if qtype not in (QType.F16, QType.BF16)
                      else 512, seed=11)
    assert_same_bits(dequant_native.dequantize(raw, qtype), torch_path(raw, qtype, monkeypatch))


@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_leading_dims_and_strided_rows(qtype, monkeypatch):
    raw = random_rows(qtype, (3, 5), blocks_per_row=2 if GGML_QUANT_SIZES[qtype][0] > 1 else 64, seed=3)
    assert_same_bits(dequant_native.dequantize(raw, qtype), torch_path(raw, qtype, monkeypatch))
    strided = raw[:, ::2]  # not contiguous: copied first
    assert not strided.is_contiguous()
    assert_same_bits(dequant_native.dequantize(strided, qtype), torch_path(strided, qtype, monkeypatch))
    odd = torch.zeros(raw.numel() + 1, dtype=torch.uint8)  # rows starting at an odd address
    odd[1:] = raw.reshape(-1)
    assert_same_bits(dequant_native.dequantize(odd[1:].view(raw.shape), qtype), torch_path(raw, qtype, monkeypatch))


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.IQ4_XS, QType.BF16], ids=lambda t: t.name)
def test_threads_split_the_rows(qtype, monkeypatch):
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS", 256)  # split even this small call
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_rows(qtype, (37,), blocks_per_row=max(1, 512 // block), seed=5)
    one = dequant_native.dequantize(raw, qtype, threads=1)
    for threads in (2, 3, 8):
        assert_same_bits(dequant_native.dequantize(raw, qtype, threads=threads), one)


def test_out_buffer_is_reused():
    raw = random_rows(QType.Q8_0, (4,), blocks_per_row=2, seed=1)
    buffer = torch.full((1000,), 7.0)
    values = dequant_native.dequantize(raw, QType.Q8_0, out=buffer)
    assert values.shape == (4, 64) and values.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[256:], torch.full((744,), 7.0))  # nothing past the values written
    with pytest.raises(ValueError, match="at least 256 values"):
        dequant_native.dequantize(raw, QType.Q8_0, out=torch.empty(255))


def test_no_rows_and_not_applicable():
    empty = dequant_native.dequantize(torch.zeros(0, 34, dtype=torch.uint8), QType.Q8_0)
    assert empty.shape == (0, 32)
    assert dequant_native.dequantize(torch.zeros(2, 34, dtype=torch.uint8), QType.TQ2_0) is None
    assert dequant_native.dequantize(torch.zeros(2, 4, dtype=torch.uint8), QType.F32) is None


@pytest.mark.parametrize("variable", ["SPECCONV_NO_NATIVE", "SPECCONV_NO_NATIVE_DEQUANT"])
def test_switch_forces_the_torch_path(variable, monkeypatch):
    raw = random_rows(QType.Q4_K, (2,), blocks_per_row=1, seed=2)
    assert dequant_native.covers(QType.Q4_K)
    monkeypatch.setenv(variable, "1")
    assert not dequant_native.available() and dequant_native.dequantize(raw, QType.Q4_K) is None
    called = []
    monkeypatch.setattr(dequant_native, "_module", lambda: called.append(1))  # never reached
    assert dequantize_rows(raw, QType.Q4_K).shape == (2, 256) and not called


def test_require_native_fails_without_the_build(monkeypatch):
    """What tests/run.sh relies on: with SPECCONV_REQUIRE_NATIVE=1 a missing build is a failure."""
    monkeypatch.setattr(dequant_native, "_module", lambda: None)
    monkeypatch.setenv("SPECCONV_REQUIRE_NATIVE", "1")
    with pytest.raises(pytest.fail.Exception, match="not built"):
        require_native_dequant()
    monkeypatch.setenv("SPECCONV_REQUIRE_NATIVE", "0")
    with pytest.raises(pytest.skip.Exception):
        require_native_dequant()


# ---- the fused product (runtime/dq_dot.c) and the stored-weight product on the CPU -----------------

EPS = float(torch.finfo(torch.float32).eps)
# |fused - x @ dense(W).t()| <= FUSED_BOUND * eps * sum_i |x_i| |w_i| for every output. Both are
# float32 sums of the same products in different orders (vector lanes and FMA in the fused kernels,
# MKL's own blocking in the reference), each off the exact sum by a few eps * sum |x_i w_i| at
# these lengths. Measured (the worst case per type and kernel is printed): at most 1.23 here, 2.1
# in wider random sweeps (n_in up to 9001, 1 .. 19 rows), the reference's own error included; 4
# leaves room while a
# wrong value or a lost term (a difference of order sum |x_i w_i|, millions of times larger) fails.
FUSED_BOUND = 4.0
FUSED = [QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16, QType.F16]
# the kernel sets: the widest this CPU has, AVX2 (16 lanes off), the plain C decode-then-multiply
KERNELS = {"fastest": {}, "avx2": {"SPECCONV_NATIVE_NO_AVX512": "1"}, "portable": {"SPECCONV_NATIVE_PORTABLE": "1"}}


def fused_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - x @ w.t()| in units of eps * sum |x_i w_i| (per output; exact zeros count as 0)."""
    x64, w64 = x.reshape(-1, x.shape[-1]).double(), w.double()
    reference = x.reshape(-1, x.shape[-1]) @ w.t()
    scale = x64.abs() @ w64.abs().t()
    diff = (y.reshape(reference.shape).double() - reference.double()).abs()
    assert bool(((diff == 0) | (scale > 0)).all())
    return float((diff / (EPS * scale).clamp_min(1e-300)).max())


def widths(qtype: QType, kernel: str, monkeypatch) -> int:
    for name, value in KERNELS[kernel].items():
        monkeypatch.setenv(name, value)
    return dequant_native.fused_width(qtype)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_fused_product_within_summation_noise(qtype, kernel, monkeypatch):
    """Every row count 1 .. 9 (one pass over the weights) and beyond (several passes), n_in not a
    multiple of the vector width where the type allows (16-bit floats: after the last 32-value block
    no vector, one of 8, one of 16, a few values), threads 1 vs 2 vs 5."""
    width = widths(qtype, kernel, monkeypatch)
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS", 1)  # let these small products split
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS_PTHREADS", 1)
    block = GGML_QUANT_SIZES[qtype][0]
    worst = 0.0
    shapes = [(256, (1, 2, 3)), (1056 if block == 32 else 1024, range(1, 10)), (4352, (4, 9, 10, 19))]
    if block == 1:
        shapes = [(256, (1, 2)), (1000, range(1, 10)), (4099, (3, 11)), (7, (1, 5)), (1013, (1, 2, 5))]
    for n_in, row_counts in shapes:
        raw = sane_rows(qtype, 37, n_in, seed=n_in)
        w = dequantize_rows(raw, qtype)  # the exact values, as the torch path gives them
        for nx in row_counts:
            x = torch.randn(nx, n_in, generator=torch.Generator().manual_seed(nx))
            y = dequant_native.matmul_t(x, raw, qtype, n_in, threads=1)
            assert y.shape == (nx, 37)
            worst = max(worst, fused_error(y, x, w))
            for threads in (2, 5):  # rows of W split over threads: each output computed alike
                assert torch.equal(dequant_native.matmul_t(x, raw, qtype, n_in, threads=threads), y)
    print(f"\n[fused {qtype.name}, {kernel} ({width or 'plain C'}{'-bit' if width else ''})] worst |Δ| = {worst:.3f} eps·Σ|x·w|")
    assert worst <= FUSED_BOUND


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
def test_fused_product_extreme_scales(qtype, kernel, monkeypatch):
    """Scales of ±65504, subnormals and ±0 (16-bit floats: values over 11 decades)."""
    widths(qtype, kernel, monkeypatch)
    n_in = 512 if GGML_QUANT_SIZES[qtype][0] > 1 else 515
    raw = sane_rows(qtype, 29, n_in, seed=7, scales="extreme")
    w = dequantize_rows(raw, qtype)
    assert bool(w.isfinite().all())
    worst = 0.0
    for nx in (1, 4, 9):
        x = torch.randn(nx, n_in, generator=torch.Generator().manual_seed(nx))
        worst = max(worst, fused_error(dequant_native.matmul_t(x, raw, qtype, n_in), x, w))
    print(f"\n[fused {qtype.name}, {kernel}, extreme scales] worst |Δ| = {worst:.3f} eps·Σ|x·w|")
    assert worst <= FUSED_BOUND


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.BF16], ids=lambda t: t.name)
def test_fused_product_decodes_each_block_once_per_nine_rows(qtype, monkeypatch):
    """The weights' values decoded (the extension's own count) for 1 .. 9 activation rows: the
    matrix once; 10 .. 18 rows: twice (two groups), whatever the thread count."""
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS", 1)
    n_out, n_in = 23, 768
    raw = sane_rows(qtype, n_out, n_in, seed=3)
    for kernel in KERNELS:
        with monkeypatch.context() as m:
            widths(qtype, kernel, m)
            for nx, passes in [(1, 1), (2, 1), (5, 1), (9, 1), (10, 2), (18, 2), (19, 3)]:
                for threads in (1, 2):
                    before = dequant_native._module().decoded()
                    dequant_native.matmul_t(torch.randn(nx, n_in), raw, qtype, n_in, threads=threads)
                    decoded = dequant_native._module().decoded() - before
                    # the plain C path decodes each row once for all the rows of x
                    assert decoded == n_out * n_in * (passes if kernel != "portable" else 1), (kernel, nx)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q6_K], ids=lambda t: t.name)
def test_openmp_pool_and_pthread_fallback_agree(qtype, monkeypatch):
    """A split call on torch's OpenMP threads and on started pthreads (SPECCONV_NATIVE_PTHREADS=1):
    the same rows to each output, so the same values."""
    assert dequant_native.thread_pool() == "openmp"  # torch's libgomp is loaded: found
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS", 1)
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS_PTHREADS", 1)
    raw = sane_rows(qtype, 301, 1024, seed=9)
    x = torch.randn(4, 1024)
    pool = dequant_native.matmul_t(x, raw, qtype, 1024, threads=2)
    decoded = dequant_native.dequantize(raw, qtype, threads=2)
    monkeypatch.setenv("SPECCONV_NATIVE_PTHREADS", "1")
    assert dequant_native.thread_pool() == "pthreads"
    assert torch.equal(dequant_native.matmul_t(x, raw, qtype, 1024, threads=2), pool)
    assert_same_bits(dequant_native.dequantize(raw, qtype, threads=2), decoded)
    assert fused_error(pool, x, dequantize_rows(raw, qtype)) <= FUSED_BOUND
    assert dequant_native.min_thread_elements() == dequant_native.MIN_THREAD_ELEMENTS_PTHREADS


def test_forked_child_splits_over_pthreads(monkeypatch):
    """libgomp's pool does not survive fork(): a child that splits a call falls back to started
    pthreads (a parallel region there would wait forever) and computes the same values."""
    import signal
    import time

    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS", 1)
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS_PTHREADS", 1)
    raw = sane_rows(QType.Q8_0, 96, 512, seed=4)
    x = torch.randn(2, 512)
    expected = dequant_native.matmul_t(x, raw, QType.Q8_0, 512, threads=2)  # the pool used in the parent
    assert dequant_native.thread_pool() == "openmp"
    pid = os.fork()
    if pid == 0:  # child: exit status 0 only if it fell back and got the same values
        try:
            same = torch.equal(dequant_native.matmul_t(x, raw, QType.Q8_0, 512, threads=2), expected)
            os._exit(0 if same and dequant_native.thread_pool() == "pthreads" else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in a parallel region")


def test_threads_on_the_pool_inside_torch_threads(monkeypatch):
    """torch.get_num_threads() threads by default; a call made while torch runs 1 thread stays on
    one (no parallel region)."""
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS", 1)
    raw = sane_rows(QType.Q8_0, 64, 256, seed=2)
    x = torch.randn(3, 256)
    one = dequant_native.matmul_t(x, raw, QType.Q8_0, 256)
    assert dequant_native._split(None, 10 ** 9) == torch.get_num_threads() == 1
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert dequant_native._split(None, 10 ** 9) == 2
        assert torch.equal(dequant_native.matmul_t(x, raw, QType.Q8_0, 256), one)
    finally:
        torch.set_num_threads(previous)


def test_fused_product_leading_dims_and_refusals():
    raw = sane_rows(QType.Q8_0, 10, 64, seed=1)
    x = torch.randn(2, 3, 64)
    y = dequant_native.matmul_t(x, raw, QType.Q8_0, 64)
    assert y.shape == (2, 3, 10)
    assert fused_error(y, x, dequantize_rows(raw, QType.Q8_0)) <= FUSED_BOUND
    assert dequant_native.matmul_t(x.double(), raw, QType.Q8_0, 64) is None  # float32 only
    assert dequant_native.matmul_t(x, raw, QType.TQ2_0, 64) is None  # type not covered
    assert dequant_native.matmul_t(x[..., :32], raw, QType.Q8_0, 32) is None  # rows of another width


def _stored(qtype: QType, rows: int, n_in: int, seed: int):
    from specconv.runtime.stored import ReadCounter, StoredWeight

    raw = sane_rows(qtype, rows, n_in, seed)
    counter = ReadCounter()
    return StoredWeight(raw, qtype, (rows, n_in), torch.float32, torch.device("cpu"), counter), raw, counter


def test_fused_kernels_where_avx2_is(monkeypatch):
    import platform
    flags = open("/proc/cpuinfo").read() if platform.machine() in ("x86_64", "AMD64") else ""
    if " avx2" in flags and " fma" in flags:
        expected = 512 if all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")) else 256
        assert all(dequant_native.fused_width(t) == expected for t in FUSED)
        monkeypatch.setenv("SPECCONV_NATIVE_NO_AVX512", "1")
        assert all(dequant_native.fused_width(t) == 256 for t in FUSED)
    assert not dequant_native.has_fused_kernel(QType.Q4_0) and not dequant_native.has_fused_kernel(QType.TQ2_0)


def test_portable_setting_has_no_fused_kernels(monkeypatch):
    monkeypatch.setenv("SPECCONV_NATIVE_PORTABLE", "1")
    assert not any(dequant_native.has_fused_kernel(t) for t in COVERED)


@pytest.mark.parametrize("portable", [False, True], ids=["fastest", "portable"])
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16, QType.F16, QType.Q4_0],
                         ids=lambda t: t.name)
def test_stored_product_takes_the_native_paths(qtype, portable, monkeypatch):
    """The CPU backend's product above CHUNK_ELEMENTS: fused for up to FUSED_MAX_ROWS rows where the
    type has a fused kernel, native chunks into the reused per-thread buffer otherwise (short last
    chunk included); both against x @ dense(W).t()."""
    from specconv.runtime import backend_cpu, stored

    if portable:
        monkeypatch.setenv("SPECCONV_NATIVE_PORTABLE", "1")

    native = backend_cpu.NativeCpuBackend()
    monkeypatch.setattr(stored, "CHUNK_ELEMENTS", 256 * 40)
    monkeypatch.setattr(backend_cpu, "NATIVE_CHUNK_ELEMENTS", 256 * 9)  # 9 rows a piece, the last one short
    w, raw, counter = _stored(qtype, 301, 256, seed=4)
    dense = dequantize_rows(raw, qtype)
    for shape in [(1, 256), (256,), (2, 256), (3, 256), (2, 4, 256), (9, 256), (17, 256)]:
        x = torch.randn(*shape)
        counter.reset()
        y = native.linear(x, w)
        assert y.shape == (*shape[:-1], 301)
        assert counter.reset() == raw.numel()  # every stored byte read once
        rows = x.numel() // 256
        # fused, or the BLAS product of each piece (whose kernels may sum in another order than
        # for the whole matrix): the same products, summed in other orders
        assert fused_error(y, x, dense) <= FUSED_BOUND
    assert backend_cpu._chunk_buffer(1).numel() >= 9 * 256  # one buffer for this thread, kept


def test_stored_product_without_the_native_path(monkeypatch):
    from specconv.runtime import backend_cpu, stored

    monkeypatch.setattr(stored, "CHUNK_ELEMENTS", 256 * 40)
    w, raw, _ = _stored(QType.Q8_0, 100, 256, seed=6)
    x = torch.randn(1, 256)
    expected = x @ dequantize_rows(raw, QType.Q8_0).t()
    monkeypatch.setenv("SPECCONV_NO_NATIVE_DEQUANT", "1")
    assert not backend_cpu._native(x, w)
    torch.testing.assert_close(backend_cpu.NativeCpuBackend().linear(x, w), expected, rtol=1e-6, atol=1e-6)
    monkeypatch.delenv("SPECCONV_NO_NATIVE_DEQUANT")
    assert backend_cpu._native(x, w) and not backend_cpu._native(x.double(), w)
