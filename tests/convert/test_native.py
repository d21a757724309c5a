"""The native Q8_0 encoder (convert/_native.c) against gguf.quants, byte for byte.

Skipped when the extension is not built, unless SPECCONV_REQUIRE_NATIVE=1 (then it fails).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from specconv.convert.native import q8_0_native
from tests.fixtures.native import require_native_q8_0


@pytest.fixture
def q8_0(monkeypatch):
    monkeypatch.delenv("SPECCONV_NO_NATIVE", raising=False)
    return require_native_q8_0()


def _reference(x32: np.ndarray) -> np.ndarray:
    return quantize(x32.reshape(-1, 32), GGMLQuantizationType.Q8_0).reshape(-1)


def _encode(q8_0, src: np.ndarray, bf16: bool = False) -> tuple[bool, np.ndarray]:
    out = np.full(src.size // 32 * 34, 0xAA, np.uint8)
    return q8_0(src, out, bf16), out


def _assert_same(q8_0, x32: np.ndarray) -> np.ndarray:
    ok, out = _encode(q8_0, np.ascontiguousarray(x32, np.float32))
    assert ok
    ref = _reference(x32)
    bad = np.flatnonzero(out != ref)
    assert bad.size == 0, f"{bad.size} bytes differ, first block {bad[0] // 34}"
    return out


def _scales(out: np.ndarray) -> np.ndarray:
    return out.reshape(-1, 34)[:, :2].copy().view(np.float16).reshape(-1)


@pytest.mark.parametrize("kind", ["normal", "uniform", "heavy"])
def test_random_f32_and_bf16_match_gguf(q8_0, kind):
    rng = np.random.default_rng()
    n = 32 * 4096
    if kind == "normal":
        scale = 10.0 ** rng.uniform(-3, 3, n // 32).repeat(32)
        x = (rng.standard_normal(n) * scale).astype(np.float32)
    elif kind == "uniform":
        x = rng.uniform(-1, 1, n).astype(np.float32)
    else:
        x = rng.standard_cauchy(n).astype(np.float32)
    _assert_same(q8_0, x)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated bfloat16
    ok, out = _encode(q8_0, bits, bf16=True)
    assert ok
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(out, _reference(widened))


@pytest.mark.parametrize("blocks", [1, 7, 8, 9, 16, 17, 23])
def test_any_block_count_and_no_write_past_the_end(q8_0, blocks):
    """Blocks are encoded in groups of 8: full groups, a partial last group, zero blocks inside one."""
    rng = np.random.default_rng(blocks)
    x = (rng.standard_normal(32 * blocks) * 10.0 ** rng.uniform(-4, 4, blocks).repeat(32)).astype(np.float32)
    x[32 * (blocks // 2):32 * (blocks // 2 + 1)] = 0.0
    for src, bf16, ref_in in [(x, False, x), ((x.view(np.uint32) >> 16).astype(np.uint16), True, None)]:
        if ref_in is None:
            ref_in = (src.astype(np.uint32) << 16).view(np.float32)
        room = np.full(34 * blocks + 64, 0xAA, np.uint8)
        assert q8_0(src, room[:34 * blocks], bf16) is True
        assert np.array_equal(room[:34 * blocks], _reference(ref_in))
        assert np.all(room[34 * blocks:] == 0xAA)


def test_zero_and_negative_zero_blocks(q8_0):
    x = np.zeros(32 * 3, np.float32)
    x[32:64] = -0.0
    x[64:96] = np.where(np.arange(32) % 2 == 0, -0.0, 0.0)
    x[70] = -1.0  # a block with some -0.0 and a real value
    out = _assert_same(q8_0, x)
    assert np.all(out.reshape(-1, 34)[:2, 2:] == 0)


def test_exact_half_ties_round_away_from_zero(q8_0):
    rng = np.random.default_rng()
    blocks = []
    for e in range(-20, 20):
        amax = np.float32(127 * 2.0**e)  # d = 2^e exactly, so 1/d and x/d are exact
        k = rng.integers(-127, 127, 32)
        x = ((k + 0.5) * 2.0**e).astype(np.float32)
        x[0] = amax if e % 2 else -amax
        blocks.append(x)
    x = np.concatenate(blocks)
    d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / np.float32(127)
    scaled = x.reshape(-1, 32) * (np.float32(1) / d)
    ties = np.sum(np.abs(scaled) % 1 == 0.5)
    assert ties >= 30 * len(blocks), ties  # the construction really makes k + 0.5 ties
    _assert_same(q8_0, x)


def _blocks_with_amax(amax: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng()
    amax = amax.astype(np.float32)
    x = (rng.uniform(-1, 1, (amax.size, 32)) * amax[:, None]).astype(np.float32)
    x[np.arange(amax.size), rng.integers(0, 32, amax.size)] = amax * rng.choice([-1, 1], amax.size)
    return x.reshape(-1)


def test_scale_overflows_fp16_to_inf(q8_0):
    amax = np.array([65504 * 127, 65520 * 127, 1e30, 3.4e38], np.float32)
    out = _assert_same(q8_0, _blocks_with_amax(amax))
    assert np.isinf(_scales(out)).sum() >= 3


def test_scale_in_fp16_subnormal_range(q8_0):
    amax = (127 * 2.0 ** np.linspace(-24.5, -14, 400)).astype(np.float32)
    out = _assert_same(q8_0, _blocks_with_amax(amax))
    s = _scales(out)
    assert np.sum((s != 0) & (np.abs(s) < np.float16(6.1035e-05))) > 300


def _amax_for_exact_d(targets: np.ndarray) -> tuple[np.ndarray, int]:
    """float32 amax values with amax / 127 == target where one exists nearby; count of exact hits."""
    targets = targets.astype(np.float32)
    amax = (targets.astype(np.float64) * 127).astype(np.float32)
    hits = 0
    for i, t in enumerate(targets):
        a = amax[i]
        for _ in range(4):
            d = a / np.float32(127)
            if d == t:
                hits += 1
                break
            a = np.nextafter(a, np.float32(np.inf) if d < t else np.float32(0))
        amax[i] = a
    return amax, hits


def test_scale_across_fp16_halfway_points(q8_0):
    lower_bits = np.arange(0x0001, 0x7BFF, 97, dtype=np.uint16)
    lower = lower_bits.view(np.float16).astype(np.float64)
    upper = (lower_bits + np.uint16(1)).view(np.float16).astype(np.float64)
    halfway = ((lower + upper) / 2).astype(np.float32)  # exact: one bit below float16's mantissa
    straddle = np.concatenate(
        [halfway, np.nextafter(halfway, np.float32(0)), np.nextafter(halfway, np.float32(np.inf))]
    )
    amax, hits = _amax_for_exact_d(straddle)
    assert hits > len(halfway), hits  # many scales land exactly on a float16 tie
    _assert_same(q8_0, _blocks_with_amax(amax))


def test_every_fp16_exponent_and_boundaries(q8_0):
    """float -> half through the scale: each fp16 binade, the subnormal/normal edge, 65504/65520."""
    rng = np.random.default_rng()
    targets = []
    for e in range(-26, 17):
        base = np.float32(2.0**e)
        targets += [base, np.nextafter(base, 0), np.nextafter(base, np.float32(np.inf))]
        targets += list((base * rng.uniform(1, 2, 40)).astype(np.float32))
    edges = np.array([6.1035156e-05, 6.097555e-05, 5.9604645e-08, 2.9802322e-08, 65504, 65519.996,
                      65520, 65520.004, 65535, 65536], np.float32)
    for t in edges:
        targets += [t, np.nextafter(t, 0), np.nextafter(t, np.float32(np.inf))]
    amax, hits = _amax_for_exact_d(np.array(targets, np.float32))
    assert hits > len(targets) // 2, hits
    out = _assert_same(q8_0, _blocks_with_amax(amax))
    exact = np.abs(amax / np.float32(127)).astype(np.float16)
    assert np.array_equal(np.abs(_scales(out)).view(np.uint16), exact.view(np.uint16))


def test_float32_subnormal_scale_is_refused(q8_0):
    x = np.zeros(64, np.float32)
    x[:32] = 1.0
    x[40] = np.float32(1e-37)  # d ~ 8e-40: float32 subnormal, 1 / d overflows
    assert not np.isfinite(np.float32(1) / (x[32:].max() / np.float32(127)))
    ok, _ = _encode(q8_0, x)
    assert ok is False


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [32, 49, 63, 32 * 9 + 5])  # in a first, partial group; in a second one
def test_non_finite_is_refused(q8_0, bad, where):
    x = np.random.default_rng().standard_normal(32 * (3 if where < 96 else 11)).astype(np.float32)
    x[where] = bad
    assert _encode(q8_0, x)[0] is False
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert _encode(q8_0, bits, bf16=True)[0] is False


def test_wrong_sizes_raise(q8_0):
    with pytest.raises(ValueError):
        q8_0(np.zeros(33, np.float32), np.zeros(34, np.uint8), False)
    with pytest.raises(ValueError):
        q8_0(np.zeros(32, np.float32), np.zeros(35, np.uint8), False)
    with pytest.raises(ValueError):
        q8_0(np.zeros(32, np.float32), np.zeros(34, np.uint8), True)  # float32 given as bf16
    assert q8_0(np.zeros(64, np.float32), np.zeros(68, np.uint8), False) is True


def test_read_only_source_is_accepted(q8_0):
    x = np.random.default_rng().standard_normal(32 * 8).astype(np.float32)
    x.flags.writeable = False
    ok, out = _encode(q8_0, x)
    assert ok and np.array_equal(out, _reference(x))


def test_no_native_env_disables_loader(monkeypatch):
    require_native_q8_0()  # only meaningful when the module is built
    monkeypatch.setenv("SPECCONV_NO_NATIVE", "1")
    assert q8_0_native() is None
    monkeypatch.delenv("SPECCONV_NO_NATIVE")
    assert q8_0_native() is not None
