"""The native dequantizer (runtime/_dequant.c through runtime/dequant_native.py) against the
pure-torch decoders of runtime/dequant.py: the same float32 bits for every covered type, on random
blocks whose scale fields hold chosen f16 values (largest finite, subnormals, signed zeros,
infinities and NaNs), odd row counts, 3-D leading dims, rows that are not contiguous, several
threads; the switch to the torch path; a missing build fails the run under
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


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_native_equals_torch(qtype, rows, monkeypatch):
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
