"""--imatrix, block level and file format: specconv's weighted encoders against llama.cpp's own, and the
importance-matrix reader on good and broken files.

Reference for the blocks: `ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row, imatrix)` of the
llama.cpp that llama-cpp-python 0.3.36 ships (libggml-base, through ctypes): the call llama.cpp's
quantize makes for every tensor when it has an importance matrix (its `quantize_row_*_impl` paths).
Data: tests/convert/test_kquants.py's special blocks (all-zero, constant, single outlier, one-sign,
Cauchy, tiny and float16-overflowing blocks, scales 1e-8..1e6) in rows of 1024 (K-quants) or 384
(the 32-value types, whose weights use the whole row's mean square), with weights spanning six
decades and including zeros. Whole files (both imatrix formats, a dense, a MoE and a nextn family):
tests/convert/test_kquants_imatrix_files.py.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from specconv.archs.errors import SpecconvError
from specconv.convert import imatrix as im
from tests.fixtures.native import require_native_kquants
from tests.fixtures.quant_rows import special_blocks

WEIGHTED = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS]


def _row(ggml_type: Q) -> int:
    return 384 if ggml_type in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1) else 1024


@pytest.fixture(scope="module")
def ggml_quantize_weighted():
    """llama.cpp's `ggml_quantize_chunk` with quant weights (one slice per row of `row` values)."""
    from tests.fixtures.peers import ggml_quantize_chunk

    return ggml_quantize_chunk()


def _rows(ggml_type: Q, seed: int, n_random: int = 1200) -> np.ndarray:
    x = special_blocks(np.random.default_rng(seed), n_random=n_random).reshape(-1)
    row = _row(ggml_type)
    return x[:x.size // row * row].reshape(-1, row)


def _weights(rng: np.random.Generator, row: int, n: int = 1) -> np.ndarray:
    w = rng.gamma(0.5, size=(n, row)) * 10.0 ** rng.uniform(-3, 3, size=(n, row))
    w[:, 5] = 0.0
    w[:, 17:40] = 0.0  # a whole zero-weight group
    return w.astype(np.float32)


def _mismatches(ours: np.ndarray, theirs: np.ndarray, ggml_type: Q) -> list[int]:
    size = GGML_QUANT_SIZES[ggml_type][1]
    return np.nonzero((ours.reshape(-1, size) != theirs.reshape(-1, size)).any(axis=1))[0].tolist()


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", WEIGHTED, ids=lambda t: t.name)
def test_weighted_blocks_equal_llama_cpp(ggml_type, ggml_quantize_weighted):
    require_native_kquants()
    x = _rows(ggml_type, 600 + int(ggml_type))
    w = _weights(np.random.default_rng(int(ggml_type)), x.shape[1])[0]
    expected = ggml_quantize_weighted(ggml_type, x, w)
    ours = im.encode_weighted_run(x, ggml_type, w, x.shape[1], x.shape[0], 0)
    bad = _mismatches(ours, expected, ggml_type)
    print(f"{ggml_type.name}: {expected.size // GGML_QUANT_SIZES[ggml_type][1]} blocks, {len(bad)} differ")
    assert bad == []


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", [Q.IQ4_NL, Q.IQ4_XS], ids=lambda t: t.name)
def test_iq4_without_weights_equals_llama_cpp(ggml_type, ggml_quantize_weighted):
    """IQ4_NL / IQ4_XS without an imatrix (weights None: the tool's x^2 weighting), native and numpy."""
    from specconv.convert.kq_weighted import encode_rows

    require_native_kquants()
    x = _rows(ggml_type, 1200 + int(ggml_type), n_random=600)
    expected = ggml_quantize_weighted(ggml_type, x, None)
    assert _mismatches(im.encode_weighted_run(x, ggml_type, None, x.shape[1], x.shape[0], 0), expected, ggml_type) == []
    assert _mismatches(encode_rows(x, ggml_type, None), expected, ggml_type) == []


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_bf16_input_and_uniform_weights(ggml_type, ggml_quantize_weighted):
    """bf16 bits in; and weights of 1 everywhere, which is not the unweighted path (other bytes)."""
    x = _rows(ggml_type, 700 + int(ggml_type), n_random=300)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    ones = np.ones(x.shape[1], np.float32)
    expected = ggml_quantize_weighted(ggml_type, widened, ones)
    assert _mismatches(im.encode_weighted_run(bits, ggml_type, ones, x.shape[1], x.shape[0], 0), expected,
                       ggml_type) == []


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", [Q.Q3_K, Q.Q5_K, Q.Q4_0], ids=lambda t: t.name)
def test_expert_slices_and_row_offsets(ggml_type, ggml_quantize_weighted):
    """A 3-D tensor's rows use their expert's slice: rows [first, first + n) of experts with 3 rows each,
    encoded from the middle of the tensor, equal llama.cpp's per-expert calls."""
    rng = np.random.default_rng(9)
    x = _rows(ggml_type, 800 + int(ggml_type), n_random=200)[:12]  # 4 experts x 3 rows
    w = _weights(rng, x.shape[1], n=4)
    expected = np.concatenate([ggml_quantize_weighted(ggml_type, x[3 * e:3 * e + 3], w[e]) for e in range(4)])
    per_row = expected.size // 12
    ours = im.encode_weighted_run(x[5:11], ggml_type, w.reshape(-1), x.shape[1], 3, 5)
    assert np.array_equal(ours, expected[5 * per_row:11 * per_row])


@pytest.mark.peer
@pytest.mark.parametrize("ggml_type", WEIGHTED, ids=lambda t: t.name)
def test_numpy_fallback_equals_llama_cpp(ggml_type, ggml_quantize_weighted):
    """convert/kq_weighted.py (used when the extension is not built): the same bytes."""
    from specconv.convert.kq_weighted import encode_rows

    x = _rows(ggml_type, 900 + int(ggml_type), n_random=250)
    w = _weights(np.random.default_rng(50 + int(ggml_type)), x.shape[1])[0]
    expected = ggml_quantize_weighted(ggml_type, x, w)
    assert _mismatches(encode_rows(x, ggml_type, np.broadcast_to(w, x.shape)), expected, ggml_type) == []


@pytest.mark.parametrize("ggml_type", WEIGHTED, ids=lambda t: t.name)
def test_numpy_fallback_equals_native(ggml_type, monkeypatch):
    """Without llama.cpp too: SPECCONV_NO_NATIVE=1 routes encode_weighted_run to numpy, same bytes,
    expert slices included."""
    require_native_kquants()
    x = _rows(ggml_type, 1000 + int(ggml_type), n_random=150)
    w = _weights(np.random.default_rng(70), x.shape[1], n=3)
    per = -(-x.shape[0] // 3)
    native = im.encode_weighted_run(x, ggml_type, w.reshape(-1), x.shape[1], per, 0)
    monkeypatch.setenv("SPECCONV_NO_NATIVE", "1")
    assert np.array_equal(im.encode_weighted_run(x, ggml_type, w.reshape(-1), x.shape[1], per, 0), native)


@pytest.mark.peer
def test_generic_build_equals_llama_cpp_too(ggml_quantize_weighted, tmp_path):
    """The weighted K-quant super-blocks are compiled for AVX2 and for any CPU (kq_wblocks.h);
    SPECCONV_NO_AVX2=1 selects the second, in a child process (chosen when the module loads)."""
    import os
    import subprocess
    import sys

    require_native_kquants()
    x = _rows(Q.Q4_K, 1100, n_random=200)
    w = _weights(np.random.default_rng(11), x.shape[1])[0]
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "w.npy", w)
    code = ("import sys, numpy as np; from specconv.convert import _kquants as k; x = np.load(sys.argv[1]); "
            "w = np.load(sys.argv[2]); sizes = {10: 84, 11: 110, 12: 144, 13: 176, 14: 210}; outs = {}\n"
            "for t, b in sizes.items():\n    o = np.zeros(x.size // 256 * b, np.uint8); "
            "assert k.encode_weighted(t, x, o, False, x.shape[1], w, x.shape[0], 0); outs[str(t)] = o\n"
            "np.savez(sys.argv[3], isa=k.isa(), **outs)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.npy"), str(tmp_path / "w.npy"),
                    str(tmp_path / "out.npz")], env={**os.environ, "SPECCONV_NO_AVX2": "1"}, check=True)
    got = np.load(tmp_path / "out.npz")
    assert str(got["isa"]) == "generic"
    for ggml_type in WEIGHTED[:5]:
        assert _mismatches(got[str(int(ggml_type))], ggml_quantize_weighted(ggml_type, x, w), ggml_type) == []


def test_native_weighted_rejects_bad_arguments():
    encode = require_native_kquants() and __import__("specconv.convert._kquants", fromlist=["x"]).encode_weighted
    x, w = np.zeros((2, 256), np.float32), np.ones(256, np.float32)
    with pytest.raises(ValueError, match="do not cover"):
        encode(int(Q.Q4_K), x, np.zeros(288, np.uint8), False, 256, w, 1, 0)  # 2 groups of 1 row, 1 slice
    with pytest.raises(ValueError, match="whole rows"):
        encode(int(Q.Q4_K), x, np.zeros(288, np.uint8), False, 512 + 256, w, 1, 0)
    with pytest.raises(ValueError, match="no weighted encoder"):
        encode(int(Q.Q8_0), x, np.zeros(544, np.uint8), False, 256, w, 2, 0)
    x[1, 3] = np.nan
    assert not encode(int(Q.Q4_K), x, np.zeros(288, np.uint8), False, 256, w, 2, 0)
    with pytest.raises(SpecconvError, match="infinity or NaN"):
        im.encode_weighted_run(x, Q.Q4_K, w, 256, 2, 0)


# ------------------------------------------------------------------ the file formats


def _sample(rng: np.random.Generator):
    sums = {"blk.0.attn_q.weight": (rng.gamma(1.0, size=(1, 512)) * 100).astype(np.float32),
            "blk.0.ffn_down_exps.weight": rng.gamma(1.0, size=(4, 256)).astype(np.float32)}
    counts = {"blk.0.attn_q.weight": np.array([700]), "blk.0.ffn_down_exps.weight": np.array([3, 0, 1024, 5])}
    return sums, counts


def test_both_formats_give_the_tools_weights(tmp_path):
    sums, counts = _sample(np.random.default_rng(0))
    im.write_gguf(tmp_path / "a.gguf", sums, counts, ["calib.txt"], chunk_count=3)
    im.write_legacy(tmp_path / "a.dat", sums, counts, chunk_size=512, chunk_count=3, dataset="calib.txt")
    g, d = im.load(str(tmp_path / "a.gguf")), im.load(str(tmp_path / "a.dat"))
    assert not g.legacy and d.legacy and g.datasets == d.datasets == ["calib.txt"] and g.chunk_count == 3
    for name, s in sums.items():
        c = counts[name].astype(np.float32)[:, None]
        expected = np.where(c > 0, s / np.where(c > 0, c, 1), np.float32(1)).reshape(-1)  # an idle expert: 1
        assert np.array_equal(g.weights[name], expected)
        np.testing.assert_allclose(d.weights[name], expected, rtol=1e-6)
    e = g.for_tensor("blk.0.ffn_down_exps.weight", (4, 64, 256))
    assert e.size == 1024 and np.all(e[256:512] == 1)
    assert g.for_tensor("blk.9.attn_q.weight", (512, 512)) is None  # no entry: quantized without weights
    with pytest.raises(SpecconvError, match="blk.0.attn_q.weight has 512 weights, but the tensor needs 1024"):
        g.for_tensor("blk.0.attn_q.weight", (64, 1024))
    kv = {e.key: e.value for e in g.kv()}
    assert kv == {"quantize.imatrix.file": str(tmp_path / "a.gguf"), "quantize.imatrix.dataset": "calib.txt",
                  "quantize.imatrix.entries_count": 2, "quantize.imatrix.chunks_count": 3}


def test_token_embd_of_another_size_is_quantized_without_weights(tmp_path):
    im.write_gguf(tmp_path / "e.gguf", {"token_embd.weight": np.ones((1, 64), np.float32)}, {"token_embd.weight": [2]})
    assert im.load(tmp_path / "e.gguf").for_tensor("token_embd.weight", (1000, 256)) is None


def _legacy(*parts: bytes) -> bytes:
    return b"".join(parts)


@pytest.mark.parametrize("data,message", [
    (b"", "too short"),
    (struct.pack("<i", 0), "no data"),
    (struct.pack("<ii", 1, -5), "name length of -5"),
    (struct.pack("<ii", 1, 10) + b"abc", "truncated at byte 8 reading entry 1's name"),
    (struct.pack("<ii", 1, 1) + b"w" + struct.pack("<ii", 1, 0), "w has 0 values"),
    (struct.pack("<ii", 1, 1) + b"w" + struct.pack("<ii", 1, 1000) + b"\0" * 12, "truncated at byte 17 reading w's 1000"),
    (struct.pack("<ii", 1, 1) + b"w" + struct.pack("<iif", 1, 1, np.inf), "w holds a non-finite weight"),
])
def test_broken_legacy_files_are_one_line_errors(tmp_path, data, message):
    path = tmp_path / "bad.dat"
    path.write_bytes(data)
    with pytest.raises(SpecconvError, match=message):
        im.load(path)


def test_broken_gguf_files_are_one_line_errors(tmp_path):
    sums, counts = _sample(np.random.default_rng(1))
    good = tmp_path / "good.gguf"
    im.write_gguf(good, sums, counts)
    data = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(SpecconvError, match="imatrix .*cut.gguf: not a readable GGUF file"):
        im.load(tmp_path / "cut.gguf")
    im._write_gguf_file(tmp_path / "nometa.gguf", [("general.type", im.GGUFValueType.STRING, "imatrix")],
                        [("w.in_sum2", np.ones((1, 32), np.float32)), ("w.counts", np.ones((1, 1), np.float32))])
    with pytest.raises(SpecconvError, match="missing imatrix metadata"):
        im.load(tmp_path / "nometa.gguf")
    meta = [("imatrix.datasets", im.GGUFValueType.ARRAY, []), ("imatrix.chunk_count", im.GGUFValueType.UINT32, 1),
            ("imatrix.chunk_size", im.GGUFValueType.UINT32, 512)]
    im._write_gguf_file(tmp_path / "alone.gguf", meta, [("w.in_sum2", np.ones((1, 32), np.float32))])
    with pytest.raises(SpecconvError, match="w has no counts tensor"):
        im.load(tmp_path / "alone.gguf")
    im._write_gguf_file(tmp_path / "odd.gguf", meta, [("w.in_sum2", np.ones((1, 33), np.float32)),
                                                      ("w.counts", np.ones((2, 1), np.float32))])
    with pytest.raises(SpecconvError, match="33 sums for 2 counts"):
        im.load(tmp_path / "odd.gguf")
    im._write_gguf_file(tmp_path / "nan.gguf", meta, [("w.in_sum2", np.full((1, 32), np.nan, np.float32)),
                                                      ("w.counts", np.ones((1, 1), np.float32))])
    with pytest.raises(SpecconvError, match="non-finite"):
        im.load(tmp_path / "nan.gguf")
    with pytest.raises(SpecconvError, match="cannot read it"):
        im.load(tmp_path / "missing.gguf")


def test_counts_are_rounded_as_the_tool_rounds_them(tmp_path):
    """lround: 2.5 -> 3, 0.4 -> 0 (then weights 1), -1 -> weights 1."""
    sums = {"w": np.full((4, 32), 6.0, np.float32)}
    im.write_gguf(tmp_path / "c.gguf", sums, {"w": np.array([2.5, 0.4, -1.0, 1.5])})
    w = im.load(tmp_path / "c.gguf").weights["w"].reshape(4, 32)
    assert w[0, 0] == np.float32(2.0) and w[1, 0] == 1 and w[2, 0] == 1 and w[3, 0] == np.float32(3.0)


def test_mutated_files_load_or_fail_in_one_line(tmp_path):
    """Random byte flips, truncations and extensions of valid files in both formats: each either loads
    or raises SpecconvError (never another exception, never a hang)."""
    sums, counts = _sample(np.random.default_rng(2))
    im.write_gguf(tmp_path / "a.gguf", sums, counts, ["calib.txt"], chunk_count=3)
    im.write_legacy(tmp_path / "a.dat", sums, counts, dataset="calib.txt")
    rng = np.random.default_rng(3)
    outcomes = {"loaded": 0, "refused": 0}
    for name in ("a.gguf", "a.dat"):
        good = bytearray((tmp_path / name).read_bytes())
        for i in range(200):
            data = bytearray(good)
            kind = i % 3
            if kind == 0:
                for _ in range(int(rng.integers(1, 8))):
                    data[int(rng.integers(0, min(len(data), 600)))] = int(rng.integers(0, 256))
            elif kind == 1:
                data = data[:int(rng.integers(0, len(data)))]
            else:
                data += bytes(rng.integers(0, 256, size=int(rng.integers(1, 64)), dtype=np.uint8))
            path = tmp_path / f"m{i}{name[-5:]}"
            path.write_bytes(bytes(data))
            try:
                im.load(path)
                outcomes["loaded"] += 1
            except SpecconvError as e:
                assert "\n" not in str(e)
                outcomes["refused"] += 1
    print(outcomes)
    assert outcomes["refused"] > 50
