"""The native dequantizer (runtime/_dequant.c through runtime/dequant_native.py) against the
pure-torch decoders of runtime/dequant.py: the same float32 bits for every covered type, on random
blocks whose scale fields hold chosen f16 values (largest finite, subnormals, signed zeros,
infinities and NaNs), odd row counts, 3-D leading dims, rows that are not contiguous, several
threads, the AVX2 and the plain C kernels; the switch to the torch path; the fused decode product
and the stored-weight product within a measured float32 summation-noise bound; a missing build fails the run under
SPECCONV_REQUIRE_NATIVE=1 (tests/run.sh)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from specconv.runtime import dequant_native
from specconv.runtime.dequant import dequantize_rows

torch.set_num_threads(1)

COVERED = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K,
           QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.F16, QType.BF16]
# byte offsets of each type's f16 scale fields inside a block (restated from the layouts)
F16_FIELDS = {
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
    QType.IQ4_NL: (0,), QType.IQ4_XS: (0,), QType.F16: (), QType.BF16: (),
}
# f16 bit patterns: ±largest finite, ±smallest subnormal, largest subnormal, smallest normal, ±0,
# ordinary values, ±inf, a quiet and a signalling NaN
SCALE_BITS = np.array([0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x0400, 0x0000, 0x8000, 0x3C00, 0xBA00,
                       0x2248, 0x5CB2, 0x7C00, 0xFC00, 0x7E00, 0x7C01], dtype=np.uint16)


def require_native_dequant():
    """Skip when the extension is not built; fail instead under SPECCONV_REQUIRE_NATIVE=1."""
    if dequant_native._module() is None:
        if os.environ.get("SPECCONV_REQUIRE_NATIVE") == "1":
            pytest.fail("specconv.runtime._dequant is not built but SPECCONV_REQUIRE_NATIVE=1")
        pytest.skip("specconv.runtime._dequant is not built (no C compiler at install time?)")


@pytest.fixture(autouse=True)
def native(monkeypatch):
    require_native_dequant()
    monkeypatch.delenv("SPECCONV_NO_NATIVE", raising=False)
    monkeypatch.delenv("SPECCONV_NO_NATIVE_DEQUANT", raising=False)


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
# |fused - x @ dense(W).t()| <= FUSED_BOUND * eps * sum_i |x_i| |w_i| for every output. Measured
# (the worst case per type is printed): 0.24 (F16) to 0.61 (Q5_K) over n_in = 256 .. 4099. Two
# float32 sums of n products in different orders can differ by up to about 2 n eps sum |x_i w_i| in
# the worst case; 2 leaves room above the measurements while still catching any wrong value or lost
# term (those give differences of order sum |x_i w_i| itself, millions of times larger).
FUSED_BOUND = 2.0


def sane_rows(qtype: QType, rows: int, n_in: int, seed: int) -> torch.Tensor:
    """Random blocks whose f16 scales are ordinary positive numbers (no inf/NaN in the values)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in (QType.F16, QType.BF16):
        values = torch.from_numpy(rng.standard_normal((rows, n_in)).astype(np.float32) * 0.05)
        return values.to(torch.float16 if qtype == QType.F16 else torch.bfloat16).view(torch.uint8)
    raw = rng.integers(0, 256, (rows, n_in // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.random((rows, n_in // block)) * 0.01 + 1e-3).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, n_in // block, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def fused_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - x @ w.t()| in units of eps * sum |x_i w_i| (per output)."""
    reference = x.reshape(-1, x.shape[-1]) @ w.t()
    scale = x.reshape(-1, x.shape[-1]).abs() @ w.abs().t()
    return float(((y.reshape(reference.shape) - reference).abs() / (EPS * scale)).max())


@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_fused_product_within_summation_noise(qtype, monkeypatch):
    monkeypatch.setattr(dequant_native, "MIN_THREAD_ELEMENTS", 1)  # let these small products split
    block = GGML_QUANT_SIZES[qtype][0]
    worst = 0.0
    for n_in, nx in ([(256, 1), (1024, 3), (4096, 8)] if block > 1 else [(256, 1), (1000, 3), (4099, 2)]):
        raw = sane_rows(qtype, 37, n_in, seed=n_in)
        w = dequantize_rows(raw, qtype)  # the exact values, as the torch path gives them
        x = torch.randn(nx, n_in, generator=torch.Generator().manual_seed(nx))
        y = dequant_native.matmul_t(x, raw, qtype, n_in)
        assert y.shape == (nx, 37)
        worst = max(worst, fused_error(y, x, w))
        for threads in (2, 5):  # rows split over threads: the same sums
            assert torch.equal(dequant_native.matmul_t(x, raw, qtype, n_in, threads=threads), y)
        with monkeypatch.context() as m:  # the portable kernel (no AVX2) keeps the same 32 sums
            m.setenv("SPECCONV_NATIVE_PORTABLE", "1")
            assert torch.equal(dequant_native.matmul_t(x, raw, qtype, n_in), y)
    print(f"\n[fused {qtype.name}] worst |Δ| = {worst:.3f} eps·Σ|x·w|")
    assert worst <= FUSED_BOUND


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


def test_fused_kernels_where_avx2_is():
    hot = [QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16, QType.F16]
    import platform
    if platform.machine() in ("x86_64", "AMD64") and "avx2" in open("/proc/cpuinfo").read():
        assert all(dequant_native.has_fused_kernel(t) for t in hot)
    assert not dequant_native.has_fused_kernel(QType.Q4_0) and not dequant_native.has_fused_kernel(QType.TQ2_0)


def test_portable_setting_has_no_fused_kernels(monkeypatch):
    monkeypatch.setenv("SPECCONV_NATIVE_PORTABLE", "1")
    assert not any(dequant_native.has_fused_kernel(t) for t in COVERED)


@pytest.mark.parametrize("portable", [False, True], ids=["fastest", "portable"])
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16, QType.F16, QType.Q4_0],
                         ids=lambda t: t.name)
def test_stored_product_takes_the_native_paths(qtype, portable, monkeypatch):
    """matmul_t above CHUNK_ELEMENTS: fused for one row where the type has a fused kernel, native
    chunks into the reused per-thread buffer otherwise (short last chunk included); both against
    x @ dense(W).t()."""
    from specconv.runtime import stored

    if portable:
        monkeypatch.setenv("SPECCONV_NATIVE_PORTABLE", "1")

    monkeypatch.setattr(stored, "CHUNK_ELEMENTS", 256 * 40)
    monkeypatch.setattr(stored, "NATIVE_CHUNK_ELEMENTS", 256 * 9)  # 9 rows a piece, the last one short
    w, raw, counter = _stored(qtype, 301, 256, seed=4)
    dense = dequantize_rows(raw, qtype)
    for shape in [(1, 256), (256,), (2, 256), (3, 256), (2, 4, 256)]:
        x = torch.randn(*shape)
        counter.reset()
        y = stored.matmul_t(x, w)
        assert y.shape == (*shape[:-1], 301)
        assert counter.reset() == raw.numel()  # every stored byte read once
        rows = x.numel() // 256
        # fused, or the BLAS product of each piece (whose kernels may sum in another order than
        # for the whole matrix): the same products, summed in other orders
        assert fused_error(y, x, dense) <= FUSED_BOUND
    assert stored._chunk_buffer(1).numel() >= 9 * 256  # one buffer for this thread, kept


def test_stored_product_without_the_native_path(monkeypatch):
    from specconv.runtime import stored

    monkeypatch.setattr(stored, "CHUNK_ELEMENTS", 256 * 40)
    w, raw, _ = _stored(QType.Q8_0, 100, 256, seed=6)
    x = torch.randn(1, 256)
    expected = x @ dequantize_rows(raw, QType.Q8_0).t()
    monkeypatch.setenv("SPECCONV_NO_NATIVE_DEQUANT", "1")
    assert not stored._native_on_cpu(x, w)
    torch.testing.assert_close(stored.matmul_t(x, w), expected, rtol=1e-6, atol=1e-6)
    monkeypatch.delenv("SPECCONV_NO_NATIVE_DEQUANT")
    assert stored._native_on_cpu(x, w) and not stored._native_on_cpu(x.double(), w)
