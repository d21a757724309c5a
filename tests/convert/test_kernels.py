"""The fast chunk encoders give exactly gguf-py's bytes (the encoders llama.cpp's converter uses).

gguf.quants is the independent reference here: `outtype.encode` calls it unchanged. Values are
random plus the cases where a re-implementation goes wrong: ties at .5 after scaling, values one ulp
below a tie, zero blocks, subnormals, F16 overflow, infinities and NaNs, and runs longer than a piece
that end mid-piece.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from specconv.convert import kernels
from specconv.convert.outtype import encode as reference
from tests.fixtures.native import require_native_q8_0

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0]


@pytest.fixture(autouse=True, params=["native", "numpy"])
def q8_0_kernel(request, monkeypatch):
    """Every test runs on both Q8_0 kernels: the C encoder (when built) and the numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "_NATIVE_Q8_0", None)
    else:
        require_native_q8_0()
    return request.param
SOURCES = ["float32", "bfloat16", "float16"]


def _source(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the converter receives them: numpy float arrays, BF16 as uint16 bits
    (rounded to BF16 by torch, independently of the code under test)."""
    if dtype == "bfloat16":
        return torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    return x.astype(dtype)


def _float32(source: np.ndarray) -> np.ndarray:
    """The exact float32 values of a source array (torch widens the BF16 bits)."""
    if source.dtype == np.uint16:
        return torch.from_numpy(source.view(np.int16)).view(torch.bfloat16).float().numpy()
    return source.astype(np.float32)


def _values(n_rows: int, row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_rows, row)) * rng.uniform(1e-3, 10, size=(n_rows, 1))).astype(np.float32)
    x[0, :64] = 0.0  # zero blocks: d = 0 and the inverse scale must be 0, not inf
    x[1, :32] = np.float32(1e-40)  # subnormal inputs
    ties = np.arange(32, dtype=np.float32) - 15.5  # with max |x| = 127 below, x / d hits exact .5 ties
    x[2, :32] = ties
    x[2, 31] = 127.0
    x[3, :32] = np.nextafter(ties, np.float32(0))  # one ulp below each tie
    x[3, 31] = 127.0
    x[4, :] = 70000.0 * np.sign(x[4, :])  # beyond F16's range: inf in F16, as numpy casts
    return x


def _special(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x[5, 7] = np.inf
    x[6, 3] = -np.inf
    x[7, 9] = np.nan
    x[8, 0] = -np.nan
    return x


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("source_dtype", SOURCES)
def test_chunk_encoder_matches_gguf_quants(ggml_type, source_dtype):
    x = _source(_values(40, 2048, seed=1), source_dtype)
    want = reference(_float32(x), ggml_type)
    got = kernels.encode_run(x, ggml_type)
    assert got.dtype == np.uint8 and got.nbytes == want.nbytes
    mismatched = int(np.count_nonzero(got != want))
    print(f"{source_dtype} -> {ggml_type.name}: {got.nbytes} bytes, {mismatched} differ")
    assert mismatched == 0


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_non_finite_values_encode_as_gguf_quants_does(ggml_type):
    x = _special(_values(16, 256, seed=2))
    with np.errstate(all="ignore"):
        want = reference(x, ggml_type)
    for source in (x, _source(x, "bfloat16"), _source(x, "float16")):
        with np.errstate(all="ignore"):
            expected = reference(_float32(source), ggml_type)
        assert np.array_equal(kernels.encode_run(source, ggml_type), expected)
    assert np.array_equal(kernels.encode_run(x, ggml_type), want)


@pytest.mark.parametrize("ggml_type", [Q.BF16, Q.Q8_0, Q.F16], ids=lambda t: t.name)
def test_runs_across_piece_boundaries(monkeypatch, ggml_type):
    """A run longer than a piece, ending mid-piece, encodes like one whole-tensor call."""
    monkeypatch.setattr(kernels, "PIECE", 256)
    x = _source(_values(9, 96, seed=3).reshape(-1)[: 9 * 96 - 32], "bfloat16")  # 832 = 3.25 pieces
    assert np.array_equal(kernels.encode_run(x, ggml_type), reference(_float32(x), ggml_type))


def test_rounding_is_half_away_from_zero():
    """Q8_0 of a block whose scale is 1: ±k.5 rounds away from zero; one ulp below rounds down."""
    block = np.zeros(32, dtype=np.float32)
    block[:4] = [0.5, -0.5, 2.5, np.nextafter(np.float32(0.5), np.float32(0))]
    block[31] = 127.0
    got = kernels.encode_run(block, Q.Q8_0)
    assert np.frombuffer(got[:2].tobytes(), dtype=np.float16)[0] == 1.0
    assert list(got[2:6].view(np.int8)) == [1, -1, 3, 0]


def test_passthrough_only_where_encoding_keeps_the_bytes():
    """BF16 from BF16 and F32 from F32 are written as the source bytes (no copy), equal to gguf-py's
    encoding; a BF16 run with a NaN, or any other pairing, is encoded instead."""
    x = _values(8, 512, seed=4)
    bf16 = _source(x, "bfloat16")
    for source, ggml_type in ((bf16, Q.BF16), (x, Q.F32)):
        same = kernels.passthrough(source, ggml_type)
        assert same is not None and np.array_equal(same, reference(_float32(source), ggml_type))
        assert np.shares_memory(same, source)
    with_nan = bf16.copy()
    with_nan[3, 5] = _source(np.array([np.nan], dtype=np.float32), "bfloat16")[0]
    assert kernels.passthrough(with_nan, Q.BF16) is None
    assert kernels.passthrough(x, Q.BF16) is None and kernels.passthrough(bf16, Q.Q8_0) is None
    assert kernels.passthrough(x.astype(np.float16), Q.F16) is None
