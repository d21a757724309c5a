"""Importance-weighted encoding (llama.cpp's quantize with --imatrix) in numpy: the fallback for
convert/kq_weighted.h when the extension is not built, the same bytes (docs/convert.md,
"Importance matrix").

The searches are convert/kquants.py's, vectorised across groups and super-blocks, with every sum the
reference accumulates term by term accumulated term by term here too; what the weighted paths add is
(1) the weights w * sqrt(sigma2 + x^2) (Q6_K: w), (2) the 37-grid affine search from -0.9 for
Q2_K/Q4_K/Q5_K/Q4_1/Q5_1 (`_affine_search` with those parameters), (3) the 19-grid signed search with
given weights for Q3_K/Q6_K/Q4_0/Q5_0 and Q3_K's scales (`kquants.signed_fit`), and (4) the sub-block scales
fitted to the float16 super-scale by a weighted search and level sweeps (`_positive_fit`).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from .kquants import (_affine_search, _half, _pack_2bit, _q6_k, _round, _seq_sum, _signed_peak, _u8, pack_q2_k, pack_q4_k,
                      pack_q5_k, refine_levels, signed_fit)

Q = GGMLQuantizationType
F = np.float32
_EPS = F(1e-15)


def encode_rows(x: np.ndarray, ggml_type: GGMLQuantizationType, w: np.ndarray | None) -> np.ndarray | None:
    """[R, n] float32 rows and their [R, n] weights (None: IQ4 types without an imatrix) -> the encoded
    bytes (flat uint8); None when a value is infinite or NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        return None
    with np.errstate(all="ignore"):  # masked-out lanes divide by zero; their results are discarded
        if ggml_type in (Q.IQ4_NL, Q.IQ4_XS):
            return _iq4(x, None if w is None else np.ascontiguousarray(w, dtype=np.float32), ggml_type).reshape(-1)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if ggml_type in _K:
            return _K[ggml_type](x.reshape(-1, 256), w.reshape(-1, 256)).reshape(-1)
        sigma2 = _seq_sum(x * x) / F(x.shape[1])  # the whole row's mean square
        xb, wb = x.reshape(x.shape[0], -1, 32), w.reshape(x.shape[0], -1, 32)
        weight = (wb * np.sqrt(sigma2[:, None, None] + xb * xb)).reshape(-1, 32)
        return _BLOCK32[ggml_type](xb.reshape(-1, 32), weight).reshape(-1)




def _positive_fit(x: np.ndarray, w: np.ndarray, nmax: int):
    """Per row of non-negative sub-block scales: uint8 levels 0..nmax and the super-scale (ggml's
    make_qp_quants): the grid through the maximum and 8 neighbours by weighted error, then up to 5
    sweeps moving one level at a time. Levels wrap as the reference's uint8_t do."""
    top = np.zeros(x.shape[0], dtype=np.float32)
    for i in range(x.shape[1]):
        top = np.where(top > x[:, i], top, x[:, i])
    zero = top < _EPS
    inv = F(nmax) / top
    levels = _u8(_round(inv[:, None] * x))
    scale = F(1) / inv
    diff = x - scale[:, None] * levels.astype(np.float32)
    best = _seq_sum((w * diff) * diff)
    for k in range(-4, 5):
        if k == 0:
            continue
        inv_k = (F(0.1) * F(k) + F(nmax)) / top
        scale_k = F(1) / inv_k
        lv = np.minimum(_round(inv_k[:, None] * x), nmax)
        diff = x - scale_k[:, None] * lv.astype(np.float32)
        err = _seq_sum((w * diff) * diff)
        take = err < best
        best = np.where(take, err, best)
        inv = np.where(take, inv_k, inv)
    lv = np.minimum(_round(inv[:, None] * x), nmax)
    levels = _u8(lv)
    wx = w * x
    fl = lv.astype(np.float32)
    s_xl, s_l2 = _seq_sum(wx * fl), _seq_sum((w * fl) * fl)
    levels, s_xl, s_l2 = refine_levels(x, w, wx, levels, s_xl, s_l2, zero, lambda c: np.minimum(c, nmax), _u8,
                                       gate_before=True)
    out = np.where(s_l2 > 0, s_xl / s_l2, F(0))
    return np.where(zero[:, None], np.uint8(0), levels), np.where(zero, F(0), out)


def _weights(x: np.ndarray, qw: np.ndarray, twice: bool) -> np.ndarray:
    s = _seq_sum(x * x)
    sigma2 = (F(2) * s if twice else s) / F(256)
    return qw * np.sqrt(sigma2[:, None] + x * x)


def _q2_k(x, qw):
    b = x.shape[0]
    weight = _weights(x, qw, False)
    sw = _seq_sum(weight.reshape(-1, 16)).reshape(b, 16)
    levels, scale, neg_min = _affine_search(x.reshape(-1, 16), weight.reshape(-1, 16), 3, -0.9, 0.05, 36, False)
    ls, dm = _positive_fit(scale.reshape(b, 16), sw, 15)
    lm, mm = _positive_fit(neg_min.reshape(b, 16), sw, 15)
    sc = _u8(ls.astype(np.int32) | (lm.astype(np.int32) << 4))
    return pack_q2_k(x, levels, sc, _half(dm), _half(mm))


def _q3_k(x, qw):
    b = x.shape[0]
    weight = _weights(x, qw, True)
    sw = _seq_sum(weight.reshape(-1, 16)).reshape(b, 16)
    levels, scale = signed_fit(x.reshape(-1, 16), weight.reshape(-1, 16), 4)
    ls, d_block = signed_fit(scale.reshape(b, 16), sw, 32)  # 0..63
    sc = np.zeros((b, 12), dtype=np.uint8)
    sc[:, :8] = _u8((ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4))
    for g in range(16):
        sc[:, 8 + g % 4] |= _u8((ls[:, g] >> 4) << (2 * (g // 4)))
    d_bits, d = _half(d_block)
    step = np.repeat(d[:, None] * (ls - 32).astype(np.float32), 16, axis=1)
    levels = np.where(step != 0, np.clip(_round(x / step), -4, 3) + 4, levels.reshape(b, 256))
    high = levels > 3
    levels = np.where(high, levels - 4, levels)
    bits = high.reshape(b, 8, 32).astype(np.uint8)
    out = np.empty((b, 110), dtype=np.uint8)
    out[:, :32] = 0
    for k in range(8):
        out[:, :32] |= bits[:, k] << k
    out[:, 32:96] = _pack_2bit(levels)
    out[:, 96:108] = sc
    out[:, 108:110] = d_bits.reshape(-1, 1).view(np.uint8)
    return out


def _affine_k(x, qw, nmax: int, clamp: bool):
    b = x.shape[0]
    weight = _weights(x, qw, True)
    sw = _seq_sum(weight.reshape(-1, 32)).reshape(b, 8)
    levels, scale, neg_min = _affine_search(x.reshape(-1, 32), weight.reshape(-1, 32), nmax, -0.9, 0.05, 36, False)
    ls, d_block = _positive_fit(scale.reshape(b, 8), sw, 63)
    lm, m_block = _positive_fit(neg_min.reshape(b, 8), sw, 63)
    if clamp:
        ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    head = np.empty((b, 16), dtype=np.uint8)
    d_bits, d = _half(d_block)
    m_bits, m = _half(m_block)
    head[:, 0:2] = d_bits.reshape(-1, 1).view(np.uint8)
    head[:, 2:4] = m_bits.reshape(-1, 1).view(np.uint8)
    sc = head[:, 4:16]
    sc[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    sc[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    s = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)  # as stored
    mn = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    step = np.repeat(d[:, None] * s.astype(np.float32), 32, axis=1)
    shift = np.repeat(m[:, None] * mn.astype(np.float32), 32, axis=1)
    levels = np.where(step != 0, np.clip(_round((x + shift) / step), 0, nmax), levels.reshape(b, 256))
    return levels, head


def _q4_k(x, qw):
    return pack_q4_k(*_affine_k(x, qw, 15, False))


def _q5_k(x, qw):
    return pack_q5_k(*_affine_k(x, qw, 31, True))


def _pack_32(levels: np.ndarray, head: int, five: bool) -> np.ndarray:
    """[B, 32] levels after `head` bytes of scales: Q4 (16 nibble bytes) or Q5 (4 high-bit bytes first)."""
    q = levels.astype(np.uint32)
    out = np.zeros((q.shape[0], head + (20 if five else 16)), dtype=np.uint8)
    body = head + (4 if five else 0)
    out[:, body:] = _u8((q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4))
    if five:
        bits = ((q >> 4) & 1) << np.arange(32, dtype=np.uint32)
        high = np.bitwise_or.reduce(bits, axis=1).astype("<u4")
        out[:, head:head + 4] = high.reshape(-1, 1).view(np.uint8)
    return out


def _sym32(nmax: int, five: bool):
    def encode(x, w):
        levels, d = signed_fit(x, w, nmax)
        out = _pack_32(levels, 2, five)
        out[:, 0:2] = _half(d)[0].reshape(-1, 1).view(np.uint8)
        return out
    return encode


def _affine32(nmax: int, five: bool):
    def encode(x, w):
        levels, scale, neg_min = _affine_search(x, w, nmax, -0.9, 0.05, 36, False)
        out = _pack_32(levels, 4, five)
        out[:, 0:2] = _half(scale)[0].reshape(-1, 1).view(np.uint8)
        out[:, 2:4] = _half(-neg_min)[0].reshape(-1, 1).view(np.uint8)
        return out
    return encode


_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_index(v: np.ndarray) -> np.ndarray:
    """The nearest non-linear level (ties to the upper one), as the reference's bisection finds it."""
    hi = np.clip(np.searchsorted(_IQ4_VALUES, v, side="right"), 1, 15)
    pick = np.where(v - _IQ4_VALUES[hi - 1] < _IQ4_VALUES[hi] - v, hi - 1, hi)
    return np.where(v <= _IQ4_VALUES[0], 0, np.where(v >= _IQ4_VALUES[15], 15, pick))


def _iq4(x: np.ndarray, w: np.ndarray | None, ggml_type) -> np.ndarray:
    """IQ4_NL (blocks of 32) / IQ4_XS (super-blocks of 256, 6-bit sub-block scales)."""
    n = 256 if ggml_type == Q.IQ4_XS else 32
    sb = x.reshape(-1, n)
    sigma2 = _seq_sum(sb * sb) * (F(2) / F(n))
    xb = sb.reshape(-1, 32)
    wb = xb * xb if w is None else (w.reshape(-1, n) * np.sqrt(sigma2[:, None] + sb * sb)).reshape(-1, 32)
    peak, peak_abs = _signed_peak(xb)
    zero = peak_abs < _EPS

    def sums(inv):
        q = _IQ4_VALUES[_iq4_index(inv[:, None] * xb)]
        return _seq_sum((wb * q) * xb), _seq_sum((wb * q) * q)

    s_qx, s_q2 = sums(F(1) / (-peak / F(-127)))
    d = np.where(s_q2 > 0, s_qx / s_q2, F(0))
    best = d * s_qx
    for k in range(-7, 8):
        t_qx, t_q2 = sums(F(k - 127) / peak)
        take = (t_q2 > 0) & (t_qx * t_qx > best * t_q2)
        d = np.where(take, t_qx / t_q2, d)
        best = np.where(take, d * t_qx, best)
    scale = np.where(zero, F(0), d)
    if ggml_type == Q.IQ4_NL:
        inv = np.where(scale != 0, F(1) / scale, F(0))
        levels = _iq4_index(inv[:, None] * xb)
        out = np.empty((xb.shape[0], 18), dtype=np.uint8)
        out[:, 0:2] = _half(scale)[0].reshape(-1, 1).view(np.uint8)
        out[:, 2:] = _u8(levels[:, :16] | (levels[:, 16:] << 4))
        return out
    scale = scale.reshape(-1, 8)
    top, _ = _signed_peak(scale)
    d = -top / F(32)
    inv = np.where(d != 0, F(1) / d, F(0))
    lv = np.clip(_round(inv[:, None] * scale), -32, 31)
    dl = d[:, None] * lv.astype(np.float32)
    idl = np.where(dl != 0, F(1) / dl, F(0))
    levels = _iq4_index(idl.reshape(-1)[:, None] * xb).reshape(-1, 256)
    stored = lv + 32
    out = np.empty((sb.shape[0], 136), dtype=np.uint8)
    out[:, 0:2] = _half(d)[0].reshape(-1, 1).view(np.uint8)
    high = np.zeros(sb.shape[0], dtype=np.uint32)
    for ib in range(8):
        high |= ((stored[:, ib] >> 4).astype(np.uint32)) << (2 * ib)
    out[:, 2:4] = high.astype("<u2").reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = _u8((stored[:, 0::2] & 0xF) | ((stored[:, 1::2] & 0xF) << 4))
    q = levels.reshape(-1, 8, 32)
    out[:, 8:] = _u8(q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(-1, 128)
    return out


_K = {Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}  # Q6_K: kquants' with weights
_BLOCK32 = {Q.Q4_0: _sym32(8, False), Q.Q5_0: _sym32(16, True), Q.Q4_1: _affine32(15, False),
            Q.Q5_1: _affine32(31, True)}
