"""runtime/dequant.py against gguf.quants: bit-identical float32 for every supported type, on random
blocks with deliberately chosen scales, any leading dims; output dtypes; errors; CUDA when present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType, quants

from specconv.archs.errors import SpecconvError
from specconv.runtime.dequant import SUPPORTED, dequantize_rows, row_bytes

torch.set_num_threads(1)

# Byte offsets of the f16 scale fields inside one block of each type (its layout, restated here
# independently of the module). MXFP4/NVFP4 have 8-bit scales, handled by ONE_BYTE_SCALES.
F16_FIELDS = {
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
    QType.Q6_K: (208,), QType.IQ4_NL: (0,), QType.IQ4_XS: (0,), QType.TQ1_0: (52,),
    QType.TQ2_0: (64,), QType.MXFP4: (), QType.NVFP4: (),
}
ONE_BYTE_SCALES = {QType.MXFP4: (0,), QType.NVFP4: (0, 1, 2, 3)}  # e8m0 / ue4m3: every byte is finite
FLOATS = (QType.F32, QType.F16, QType.BF16)
REQUIRED = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
QUANTIZED = sorted((t for t in SUPPORTED if t not in FLOATS), key=lambda t: t.name)
ALL_TYPES = sorted(SUPPORTED, key=lambda t: t.name)

# f16 scales: the largest finite, subnormals down to the smallest, zero of both signs, negatives
SCALES = np.array([65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -15, 6.1e-5, 0.0, -0.0,
                   1.0, -0.75, 0.0123, 300.5], dtype=np.float16)


def random_rows(qtype: QType, shape: tuple[int, ...], blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """uint8 [*shape, row bytes]: random bytes, scale fields set to SCALES (cycled, shuffled)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in FLOATS:
        return finite_floats(qtype, (*shape, blocks_per_row * block), rng)
    raw = rng.integers(0, 256, (*shape, blocks_per_row, size), dtype=np.uint8)
    n_blocks = raw[..., 0].size
    for offset in F16_FIELDS[qtype]:
        chosen = SCALES[rng.permutation(np.arange(n_blocks) % len(SCALES))]
        raw[..., offset:offset + 2] = chosen.view(np.uint8).reshape(*raw.shape[:-1], 2)
    for offset in ONE_BYTE_SCALES.get(qtype, ()):
        raw[..., offset] = rng.permutation(np.arange(n_blocks) % 256).reshape(raw.shape[:-1])
    return raw.reshape(*shape, blocks_per_row * size)


def finite_floats(qtype: QType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bit patterns of a float type (subnormals, signed zeros...), NaN/Inf replaced by 0."""
    bits, exponent = {QType.F32: (np.uint32, 0x7F800000), QType.F16: (np.uint16, 0x7C00),
                      QType.BF16: (np.uint16, 0x7F80)}[qtype]
    info = np.iinfo(bits)
    words = rng.integers(0, int(info.max) + 1, shape, dtype=bits)
    words[(words & exponent) == exponent] = 0
    return words.view(np.uint8).reshape(*shape[:-1], -1)


def reference(raw: np.ndarray, qtype: QType) -> torch.Tensor:
    with np.errstate(all="ignore"):  # 65504-scale and 2^127 (MXFP4) blocks overflow to inf, as intended
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, qtype), dtype=np.float32))


def assert_bit_identical(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert torch.equal(ours, expected)
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))  # also the sign of zeros


def test_supported_types():
    assert REQUIRED <= {t.name for t in SUPPORTED}
    assert QType.IQ2_XXS not in SUPPORTED


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matches_gguf_quants(qtype, rows):
    raw = random_rows(qtype, (rows,), blocks_per_row=3, seed=rows)
    ours = dequantize_rows(torch.from_numpy(raw), qtype)
    assert_bit_identical(ours, reference(raw, qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_every_chosen_scale_appears(qtype):
    """Enough blocks that each extreme scale value (or every 8-bit scale byte) is in every field."""
    n_blocks = 256 if qtype in ONE_BYTE_SCALES else 4 * len(SCALES)
    raw = random_rows(qtype, (4,), blocks_per_row=n_blocks // 4, seed=11)
    assert_bit_identical(dequantize_rows(torch.from_numpy(raw), qtype), reference(raw, qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_leading_dims_like_moe_experts(qtype):
    raw = random_rows(qtype, (3, 5), blocks_per_row=2, seed=3)  # [experts, rows, bytes]
    ours = dequantize_rows(torch.from_numpy(raw), qtype)
    assert_bit_identical(ours, reference(raw, qtype))
    for expert in range(3):  # a slice of the batch gives the same rows
        assert torch.equal(dequantize_rows(torch.from_numpy(raw)[expert], qtype), ours[expert])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_output_dtype_is_the_float32_result_cast(qtype, dtype):
    raw = torch.from_numpy(random_rows(qtype, (3,), blocks_per_row=2, seed=5))
    ours = dequantize_rows(raw, qtype, dtype)
    assert ours.dtype == dtype
    assert torch.equal(ours, dequantize_rows(raw, qtype).to(dtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_misaligned_views_and_raw_left_untouched(qtype):
    """Rows starting at an odd address (scales cannot be viewed as f16 there) decode the same, and
    the input bytes are never written."""
    raw = random_rows(qtype, (3,), blocks_per_row=2, seed=7)
    buffer = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buffer[1:] = torch.from_numpy(raw).reshape(-1)
    odd = buffer[1:].view(raw.shape)
    before = buffer.clone()
    assert_bit_identical(dequantize_rows(odd, qtype), reference(raw, qtype))
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_accelerator_code_path_on_cpu(qtype, monkeypatch):
    """The steps chosen off the CPU (no contiguous copies, promoted products) give the same bits."""
    import specconv.runtime.dequant as dequant
    monkeypatch.setattr(dequant, "_on_cpu", lambda tensor: False)
    raw = random_rows(qtype, (2, 3), blocks_per_row=2, seed=17)
    assert_bit_identical(dequantize_rows(torch.from_numpy(raw), qtype), reference(raw, qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_no_rows(qtype):
    out = dequantize_rows(torch.zeros(0, row_bytes(qtype, 256), dtype=torch.uint8), qtype)
    assert out.shape == (0, 256) and out.dtype == torch.float32


def test_row_bytes():
    assert row_bytes(QType.F32, 5) == 20
    assert row_bytes(QType.BF16, 7) == 14
    assert row_bytes(QType.Q8_0, 4096) == 128 * 34
    assert row_bytes(QType.Q4_K, 512) == 2 * 144
    assert row_bytes(QType.MXFP4, 64) == 2 * 17
    for qtype in SUPPORTED:
        block, size = GGML_QUANT_SIZES[qtype]
        assert row_bytes(qtype, 3 * block) == 3 * size


@pytest.mark.parametrize("qtype, n_elems", [(QType.Q4_K, 100), (QType.Q8_0, 48), (QType.NVFP4, 32)])
def test_row_bytes_rejects_partial_blocks(qtype, n_elems):
    with pytest.raises(SpecconvError, match=f"{n_elems} values is not a whole number of {qtype.name} blocks"):
        row_bytes(qtype, n_elems)


def test_unsupported_type_is_named():
    with pytest.raises(SpecconvError) as error:
        dequantize_rows(torch.zeros(0, dtype=torch.uint8), QType.IQ2_XXS)
    message = str(error.value)
    assert message.startswith("tensor type IQ2_XXS is not supported by the runtime (supported: ")
    assert all(name in message for name in REQUIRED)


def test_bad_input_is_refused():
    with pytest.raises(SpecconvError, match="whole number of 34-byte blocks"):
        dequantize_rows(torch.zeros(2, 35, dtype=torch.uint8), QType.Q8_0)
    with pytest.raises(SpecconvError, match="uint8"):
        dequantize_rows(torch.zeros(2, 34, dtype=torch.int8), QType.Q8_0)
    with pytest.raises(SpecconvError, match="floating-point"):
        dequantize_rows(torch.zeros(2, 34, dtype=torch.uint8), QType.Q8_0, torch.int32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_gguf_quants(qtype):
    raw = random_rows(qtype, (2, 7), blocks_per_row=3, seed=13)
    ours = dequantize_rows(torch.from_numpy(raw).cuda(), qtype)
    assert ours.device.type == "cuda"
    assert_bit_identical(ours.cpu(), reference(raw, qtype))
    half = dequantize_rows(torch.from_numpy(raw).cuda(), qtype, torch.bfloat16)
    assert torch.equal(half.cpu(), reference(raw, qtype).to(torch.bfloat16))
