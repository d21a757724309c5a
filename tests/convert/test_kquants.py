"""K-quant blocks: specconv's encoders (native C and numpy) against llama.cpp's own quantizer.

The reference is `ggml_quantize_chunk` of the llama.cpp that llama-cpp-python 0.3.36 ships (its
libggml-base), called through ctypes with no importance matrix: the function llama.cpp's quantize
tool calls for every tensor. Data: normal rows at block scales from 1e-8 to 1e6, all-zero,
constant, single-outlier, one-sign, Cauchy, tiny (1e-30) and float16-overflowing blocks, and
bf16-truncated values through the encoder's bf16 input. Both of our encoders must give the
reference's bytes for every block; the fallback types (Q4_0, Q5_0, Q5_1, Q8_0, used when rows do
not hold 256-element blocks) go through the converter's kernels and must equal it too.
Whole files against llama.cpp's quantize tool: tests/convert/test_kquants_files.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from specconv.archs.errors import SpecconvError
from specconv.convert import kquants
from specconv.convert.kernels import encode_run
from tests.fixtures.native import require_native_kquants
from tests.fixtures.quant_rows import special_blocks

K_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FALLBACK_TYPES = [Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q8_0]


@pytest.fixture(scope="module")
def ggml_quantize():
    """llama.cpp's `ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix=NULL)`."""
    from tests.fixtures.peers import ggml_quantize_chunk

    chunk = ggml_quantize_chunk()

    def quantize(ggml_type: Q, x: np.ndarray, row: int = 256) -> np.ndarray:
        return chunk(ggml_type, np.asarray(x, dtype=np.float32).reshape(-1, row))

    return quantize


def _mismatches(ours: np.ndarray, theirs: np.ndarray, size: int) -> list[int]:
    return np.nonzero((ours.reshape(-1, size) != theirs.reshape(-1, size)).any(axis=1))[0].tolist()


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_native_blocks_equal_llama_cpp(ggml_type, ggml_quantize):
    native = require_native_kquants()
    x = special_blocks(np.random.default_rng(int(ggml_type)), n_random=2000)
    expected = ggml_quantize(ggml_type, x)
    ours = np.zeros_like(expected)
    assert native(int(ggml_type), x, ours, False)
    assert _mismatches(ours, expected, kquants.BLOCK_BYTES[ggml_type]) == []


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_native_bf16_input_equals_llama_cpp_on_the_widened_values(ggml_type, ggml_quantize):
    native = require_native_kquants()
    x = special_blocks(np.random.default_rng(100 + int(ggml_type)), n_random=300)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
    expected = ggml_quantize(ggml_type, (bits.astype(np.uint32) << 16).view(np.float32))
    ours = np.zeros_like(expected)
    assert native(int(ggml_type), bits, ours, True)
    assert _mismatches(ours, expected, kquants.BLOCK_BYTES[ggml_type]) == []


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_numpy_blocks_equal_llama_cpp(ggml_type, ggml_quantize):
    x = special_blocks(np.random.default_rng(200 + int(ggml_type)), n_random=250)
    expected = ggml_quantize(ggml_type, x)
    ours = np.zeros_like(expected)
    assert kquants.encode(x, ggml_type, ours)
    assert _mismatches(ours, expected, kquants.BLOCK_BYTES[ggml_type]) == []


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", FALLBACK_TYPES, ids=lambda t: t.name)
def test_fallback_types_equal_llama_cpp(ggml_type, ggml_quantize):
    """Rows of 96 (a multiple of 32, not 256) get these types; the converter's kernels must match."""
    x = special_blocks(np.random.default_rng(300 + int(ggml_type)), n_random=122).reshape(-1, 96)  # 135 blocks: a whole number of rows
    expected = ggml_quantize(ggml_type, x, row=96)
    ours = encode_run(x, ggml_type)
    size = GGML_QUANT_SIZES[ggml_type][1]
    assert _mismatches(ours, expected, size) == []


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_numpy_and_native_agree(ggml_type):
    """Without llama.cpp too: the fallback and the extension give the same bytes."""
    native = require_native_kquants()
    x = special_blocks(np.random.default_rng(400 + int(ggml_type)), n_random=150)
    a, b = np.zeros(x.shape[0] * kquants.BLOCK_BYTES[ggml_type], np.uint8), np.zeros(
        x.shape[0] * kquants.BLOCK_BYTES[ggml_type], np.uint8)
    assert native(int(ggml_type), x, a, False) and kquants.encode(x, ggml_type, b)
    assert _mismatches(a, b, kquants.BLOCK_BYTES[ggml_type]) == []


@pytest.mark.peer
def test_generic_build_equals_llama_cpp_too(ggml_quantize, tmp_path):
    """The encoders are compiled twice (AVX2 and any CPU); SPECCONV_NO_AVX2=1 selects the second,
    which a machine with AVX2 would otherwise never run. It runs in a child process (the choice is
    made when the module loads) and its bytes must equal the reference."""
    import subprocess
    import sys

    native = require_native_kquants()
    x = special_blocks(np.random.default_rng(500), n_random=200)
    np.save(tmp_path / "x.npy", x)
    code = ("import sys, numpy as np; from specconv.convert import _kquants as k; x = np.load(sys.argv[1]); "
            "sizes = {10: 84, 11: 110, 12: 144, 13: 176, 14: 210}; outs = {}\n"
            "for t, b in sizes.items():\n    o = np.zeros(x.shape[0] * b, np.uint8); assert k.encode(t, x, o, False); "
            "outs[str(t)] = o\nnp.savez(sys.argv[2], isa=k.isa(), **outs)")
    env = {**os.environ, "SPECCONV_NO_AVX2": "1"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.npy"), str(tmp_path / "out.npz")], env=env,
                   check=True)
    got = np.load(tmp_path / "out.npz")
    assert str(got["isa"]) == "generic" and native is not None
    for ggml_type in K_TYPES:
        expected = ggml_quantize(ggml_type, x)
        assert _mismatches(got[str(int(ggml_type))], expected, kquants.BLOCK_BYTES[ggml_type]) == [], ggml_type.name


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_values_are_refused(bad):
    """llama.cpp's quantize fails on such rows (its validation); the converter says so in one line."""
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    x[2, 200] = bad
    out = np.zeros(3 * 144, np.uint8)
    assert not kquants.encode(x, Q.Q4_K, out)
    native = require_native_kquants()
    assert not native(int(Q.Q4_K), x, out, False)
    with pytest.raises(SpecconvError, match="infinity or NaN"):
        encode_run(x, Q.Q4_K)


def test_native_rejects_wrong_sizes():
    native = require_native_kquants()
    x = np.zeros(256, np.float32)
    with pytest.raises(ValueError, match="dst holds"):
        native(int(Q.Q6_K), x, np.zeros(209, np.uint8), False)
    with pytest.raises(ValueError, match="multiple of 256"):
        native(int(Q.Q6_K), np.zeros(255, np.float32), np.zeros(210, np.uint8), False)
    with pytest.raises(ValueError, match="not a K-quant"):
        native(int(Q.Q8_0), x, np.zeros(272, np.uint8), False)


def test_kernel_pieces_do_not_change_the_bytes():
    """The converter encodes runs in pieces (and chunks): a run cut anywhere on a block boundary
    encodes to the same bytes as the whole."""
    x = special_blocks(np.random.default_rng(7), n_random=1100).reshape(-1)
    whole = encode_run(x, Q.Q5_K)
    cut = 256 * 517
    parts = np.concatenate([encode_run(x[:cut], Q.Q5_K), encode_run(x[cut:], Q.Q5_K)])
    assert np.array_equal(whole, parts)
