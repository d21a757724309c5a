/* Importance-weighted encoders (llama.cpp's quantize with --imatrix): Q2_K..Q6_K and the 32-value
 * types the K-quant rules fall back to (Q4_0, Q4_1, Q5_0, Q5_1), bytes equal to the weighted paths of
 * the pinned ggml (ggml/src/ggml-quants.c, the `quantize_row_*_impl` functions that
 * ggml_quantize_chunk takes when it is given quant weights; docs/convert.md, "importance matrix").
 *
 * Scalar float32 code in the reference's order (every product and sum as written there, C's
 * int -> float conversions where it mixes them; built with -ffp-contract=off): one row at a time,
 * the row's weights indexed by column. The K-quants weigh each value by w * sqrt(sigma2 + x^2)
 * with sigma2 the super-block's mean square (Q6_K: by w alone); the 32-value types use the row's
 * mean square. Included once by _kquants.c; convert/kq_weighted.py is the numpy fallback (same bytes). */
#ifndef SPECCONV_KQ_WEIGHTED_H
#define SPECCONV_KQ_WEIGHTED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kq_common.h"

#define KW_EPS 1e-15f /* a group whose largest magnitude is below this is all zeros */

static inline int kw_clamp(int v, int lo, int hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

/* Affine levels 0..nmax, x ~ scale * l + min (min <= 0 returned negated in *neg_min): the min/max
 * grid, then nstep + 1 stretched grids solved by weighted least squares, keeping the smallest
 * weighted squared error. */
static float kw_affine(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min, float rmin,
                       float rdelta, int nstep)
{
    uint8_t trial[32];
    float lo = x[0], hi = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < lo)
            lo = x[i];
        if (x[i] > hi)
            hi = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (lo > 0)
        lo = 0;
    if (hi <= lo) {
        memset(L, 0, (size_t)n);
        *neg_min = -lo;
        return 0.f;
    }
    float inv = (float)nmax / (hi - lo), scale = 1 / inv, best = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)kw_clamp(kq_round(inv * (x[i] - lo)), 0, nmax);
        float diff = scale * (float)L[i] + lo - x[i];
        best += w[i] * (diff * diff);
    }
    for (int step = 0; step <= nstep; step++) {
        inv = (rmin + rdelta * (float)step + (float)nmax) / (hi - lo);
        float s_l = 0, s_l2 = 0, s_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = kw_clamp(kq_round(inv * (x[i] - lo)), 0, nmax);
            trial[i] = (uint8_t)l;
            s_l += w[i] * (float)l;
            s_l2 += w[i] * (float)l * (float)l;
            s_xl += w[i] * (float)l * x[i];
        }
        float det = sum_w * s_l2 - s_l * s_l;
        if (!(det > 0))
            continue;
        float t_scale = (sum_w * s_xl - sum_x * s_l) / det;
        float t_min = (s_l2 * sum_x - s_l * s_xl) / det;
        if (t_min > 0) {
            t_min = 0;
            t_scale = s_xl / s_l2;
        }
        float err = 0;
        for (int i = 0; i < n; i++) {
            float diff = t_scale * (float)trial[i] + t_min - x[i];
            err += w[i] * (diff * diff);
        }
        if (err < best) {
            memcpy(L, trial, (size_t)n);
            best = err;
            scale = t_scale;
            lo = t_min;
        }
    }
    *neg_min = -lo;
    return scale;
}

/* Symmetric levels -nmax..nmax-1 (stored + nmax) through the peak, then the peak mapped to
 * -(nmax + 0.1 k), k = -9..9, keeping the best weighted least-squares fit. */
static float kw_signed(int n, int nmax, const float *x, int8_t *L, const float *w)
{
    float peak = 0, peak_abs = 0;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > peak_abs) {
            peak_abs = a;
            peak = x[i];
        }
    }
    if (peak_abs < KW_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float inv = (float)(-nmax) / peak, s_xl = 0, s_l2 = 0;
    for (int i = 0; i < n; i++) {
        int l = kw_clamp(kq_round(inv * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        s_xl += w[i] * x[i] * (float)l;
        s_l2 += w[i] * (float)l * (float)l;
    }
    float scale = s_l2 != 0 ? s_xl / s_l2 : 0.0f, best = scale * s_xl;
    for (int k = -9; k <= 9; k++) {
        if (k == 0)
            continue;
        inv = -((float)nmax + 0.1f * (float)k) / peak;
        s_xl = s_l2 = 0;
        for (int i = 0; i < n; i++) {
            int l = kw_clamp(kq_round(inv * x[i]), -nmax, nmax - 1);
            s_xl += w[i] * x[i] * (float)l;
            s_l2 += w[i] * (float)l * (float)l;
        }
        if (s_l2 > 0 && s_xl * s_xl > best * s_l2) {
            for (int i = 0; i < n; i++)
                L[i] = (int8_t)(nmax + kw_clamp(kq_round(inv * x[i]), -nmax, nmax - 1));
            scale = s_xl / s_l2;
            best = scale * s_xl;
        }
    }
    return scale;
}

/* Non-negative levels 0..nmax for the sub-block scales (x >= 0 in practice): the grid through the
 * maximum and 8 neighbours by weighted error, then up to 5 sweeps moving one level at a time.
 * Levels are kept in uint8_t as the reference keeps them (a negative level would wrap there too). */
static float kw_positive(int n, int nmax, const float *x, uint8_t *L, const float *w)
{
    float top = 0;
    for (int i = 0; i < n; i++)
        top = top > x[i] ? top : x[i];
    if (top < KW_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float inv = (float)nmax / top;
    for (int i = 0; i < n; i++)
        L[i] = (uint8_t)kq_round(inv * x[i]);
    float scale = 1 / inv, best = 0;
    for (int i = 0; i < n; i++) {
        float diff = x[i] - scale * (float)L[i];
        best += w[i] * diff * diff;
    }
    for (int k = -4; k <= 4; k++) {
        if (k == 0)
            continue;
        float inv_k = (0.1f * (float)k + (float)nmax) / top, scale_k = 1 / inv_k, err = 0;
        for (int i = 0; i < n; i++) {
            int l = kq_round(inv_k * x[i]);
            l = l < nmax ? l : nmax;
            float diff = x[i] - scale_k * (float)l;
            err += w[i] * diff * diff;
        }
        if (err < best) {
            best = err;
            inv = inv_k;
        }
    }
    float s_xl = 0, s_l2 = 0;
    for (int i = 0; i < n; i++) {
        int l = kq_round(inv * x[i]);
        l = l < nmax ? l : nmax;
        L[i] = (uint8_t)l;
        s_xl += w[i] * x[i] * (float)l;
        s_l2 += w[i] * (float)l * (float)l;
    }
    for (int sweep = 0; sweep < 5; sweep++) {
        int moved = 0;
        for (int i = 0; i < n; i++) {
            float xl = s_xl - w[i] * x[i] * (float)L[i];
            float l2 = s_l2 - w[i] * (float)L[i] * (float)L[i];
            if (!(xl > 0 && l2 > 0))
                continue;
            int cand = kq_round(x[i] * l2 / xl);
            cand = cand < nmax ? cand : nmax;
            if (cand == L[i])
                continue;
            xl += w[i] * x[i] * (float)cand;
            l2 += w[i] * (float)cand * (float)cand;
            if (xl * xl * s_l2 > s_xl * s_xl * l2) {
                L[i] = (uint8_t)cand;
                s_xl = xl;
                s_l2 = l2;
                moved++;
            }
        }
        if (!moved)
            break;
    }
    return s_l2 > 0.0f ? s_xl / s_l2 : 0.0f;
}

static float kw_mean_square(const float *x, int64_t n, float twice)
{
    float sum = 0;
    for (int64_t i = 0; i < n; i++)
        sum += x[i] * x[i];
    return twice ? 2 * sum / (float)n : sum / (float)n;
}

static void kw_pack_2bit(const uint8_t *levels, uint8_t *qs)
{
    for (int half = 0; half < KQ_SUPER; half += 128)
        for (int l = 0; l < 32; l++)
            qs[half / 4 + l] = (uint8_t)(levels[half + l] | (levels[half + l + 32] << 2) |
                                         (levels[half + l + 64] << 4) | (levels[half + l + 96] << 6));
}

/* ---------------------------------------------------------------- one super-block, weights qw[256] */

static void kw_q2_k(const float *x, const float *qw, uint8_t *out)
{
    uint8_t L[KQ_SUPER], Ls[16], Lm[16];
    float scale[16], neg_min[16], sw[16], weight[16];
    float sigma2 = kw_mean_square(x, KQ_SUPER, 0);
    for (int g = 0; g < 16; g++) {
        for (int i = 0; i < 16; i++)
            weight[i] = qw[16 * g + i] * sqrtf(sigma2 + x[16 * g + i] * x[16 * g + i]);
        float s = 0;
        for (int i = 0; i < 16; i++)
            s += weight[i];
        sw[g] = s;
        scale[g] = kw_affine(16, 3, x + 16 * g, weight, L + 16 * g, neg_min + g, -0.9f, 0.05f, 36);
    }
    float dm = kw_positive(16, 15, scale, Ls, sw), mm = kw_positive(16, 15, neg_min, Lm, sw);
    uint16_t d = kq_half(dm), dmin = kq_half(mm);
    float df = kq_unhalf(d), mf = kq_unhalf(dmin);
    for (int g = 0; g < 16; g++)
        out[g] = (uint8_t)(Ls[g] | (Lm[g] << 4));
    for (int g = 0; g < 16; g++) {
        float step = df * (float)(out[g] & 0xF);
        if (step == 0)
            continue;
        float shift = mf * (float)(out[g] >> 4);
        for (int i = 0; i < 16; i++)
            L[16 * g + i] = (uint8_t)kw_clamp(kq_round((x[16 * g + i] + shift) / step), 0, 3);
    }
    kw_pack_2bit(L, out + 16);
    kq_put_half(out + 80, d);
    kq_put_half(out + 82, dmin);
}

static void kw_q3_k(const float *x, const float *qw, uint8_t *out)
{
    int8_t L[KQ_SUPER], Ls[16];
    float scale[16], sw[16], weight[16];
    float sigma2 = kw_mean_square(x, KQ_SUPER, 1);
    for (int g = 0; g < 16; g++) {
        for (int i = 0; i < 16; i++)
            weight[i] = qw[16 * g + i] * sqrtf(sigma2 + x[16 * g + i] * x[16 * g + i]);
        float s = 0;
        for (int i = 0; i < 16; i++)
            s += weight[i];
        sw[g] = s;
        scale[g] = kw_signed(16, 4, x + 16 * g, L + 16 * g, weight);
    }
    uint8_t *hmask = out, *qs = out + 32, *sc = out + 96;
    memset(sc, 0, 12);
    float d_block = kw_signed(16, 32, scale, Ls, sw);
    for (int g = 0; g < 16; g++) {
        int l = Ls[g];
        if (g < 8)
            sc[g] = (uint8_t)(l & 0xF);
        else
            sc[g - 8] |= (uint8_t)((l & 0xF) << 4);
        sc[8 + g % 4] |= (uint8_t)((l >> 4) << (2 * (g / 4)));
    }
    uint16_t d = kq_half(d_block);
    float df = kq_unhalf(d);
    for (int g = 0; g < 16; g++) {
        int low = g < 8 ? (sc[g] & 0xF) : (sc[g - 8] >> 4);
        int8_t s = (int8_t)((low | (((sc[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32);
        float step = df * (float)s;
        if (step == 0)
            continue;
        for (int i = 0; i < 16; i++)
            L[16 * g + i] = (int8_t)(kw_clamp(kq_round(x[16 * g + i] / step), -4, 3) + 4);
    }
    uint8_t levels[KQ_SUPER];
    memset(hmask, 0, 32);
    for (int j = 0; j < KQ_SUPER; j++) { /* the third bit of value 32 k + l: bit k of hmask byte l */
        int v = L[j];
        if (v > 3) {
            hmask[j % 32] |= (uint8_t)(1u << (j / 32));
            v -= 4;
        }
        levels[j] = (uint8_t)v;
    }
    kw_pack_2bit(levels, qs);
    kq_put_half(out + 108, d);
}

/* Q4_K / Q5_K: 8 groups of 32 with 6-bit scales and minimums; levels in L, header in out[0..16). */
static void kw_affine_k(const float *x, const float *qw, uint8_t *out, uint8_t *L, int nmax, int clamp63)
{
    uint8_t Ls[8], Lm[8];
    float scale[8], neg_min[8], sw[8], weight[32];
    float sigma2 = kw_mean_square(x, KQ_SUPER, 1);
    for (int g = 0; g < 8; g++) {
        for (int i = 0; i < 32; i++)
            weight[i] = qw[32 * g + i] * sqrtf(sigma2 + x[32 * g + i] * x[32 * g + i]);
        float s = 0;
        for (int i = 0; i < 32; i++)
            s += weight[i];
        sw[g] = s;
        scale[g] = kw_affine(32, nmax, x + 32 * g, weight, L + 32 * g, neg_min + g, -0.9f, 0.05f, 36);
    }
    float d_block = kw_positive(8, 63, scale, Ls, sw), m_block = kw_positive(8, 63, neg_min, Lm, sw);
    uint8_t *sc = out + 4;
    for (int g = 0; g < 8; g++) {
        uint8_t ls = Ls[g], lm = Lm[g];
        if (clamp63) {
            ls = ls < 63 ? ls : 63;
            lm = lm < 63 ? lm : 63;
        }
        if (g < 4) {
            sc[g] = ls;
            sc[g + 4] = lm;
        } else {
            sc[g + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[g - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[g] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    uint16_t d = kq_half(d_block), dmin = kq_half(m_block);
    kq_put_half(out, d);
    kq_put_half(out + 2, dmin);
    float df = kq_unhalf(d), mf = kq_unhalf(dmin);
    for (int g = 0; g < 8; g++) {
        int s, m;
        if (g < 4) {
            s = sc[g] & 63;
            m = sc[g + 4] & 63;
        } else {
            s = (sc[g + 4] & 0xF) | ((sc[g - 4] >> 6) << 4);
            m = (sc[g + 4] >> 4) | ((sc[g] >> 6) << 4);
        }
        float step = df * (float)s;
        if (step == 0)
            continue;
        float shift = mf * (float)m;
        for (int i = 0; i < 32; i++)
            L[32 * g + i] = (uint8_t)kw_clamp(kq_round((x[32 * g + i] + shift) / step), 0, nmax);
    }
}

static void kw_q4_k(const float *x, const float *qw, uint8_t *out)
{
    uint8_t L[KQ_SUPER];
    kw_affine_k(x, qw, out, L, 15, 0);
    uint8_t *qs = out + 16;
    for (int q = 0; q < 4; q++)
        for (int l = 0; l < 32; l++)
            qs[32 * q + l] = (uint8_t)(L[64 * q + l] | (L[64 * q + l + 32] << 4));
}

static void kw_q5_k(const float *x, const float *qw, uint8_t *out)
{
    uint8_t L[KQ_SUPER];
    kw_affine_k(x, qw, out, L, 31, 1);
    uint8_t *qh = out + 16, *qs = out + 48;
    memset(qh, 0, 32);
    for (int q = 0; q < 4; q++) {
        for (int l = 0; l < 32; l++) {
            int a = L[64 * q + l], b = L[64 * q + l + 32];
            if (a > 15) {
                a -= 16;
                qh[l] |= (uint8_t)(1u << (2 * q));
            }
            if (b > 15) {
                b -= 16;
                qh[l] |= (uint8_t)(2u << (2 * q));
            }
            qs[32 * q + l] = (uint8_t)(a | (b << 4));
        }
    }
}

static void kw_q6_k(const float *x, const float *qw, uint8_t *out)
{
    int8_t L[KQ_SUPER];
    float scale[16], peak = 0, peak_abs = 0;
    for (int g = 0; g < 16; g++) {
        scale[g] = kw_signed(16, 32, x + 16 * g, L + 16 * g, qw + 16 * g); /* weights: w alone */
        float a = fabsf(scale[g]);
        if (a > peak_abs) {
            peak_abs = a;
            peak = scale[g];
        }
    }
    memset(out, 0, KQ_Q6_K_BYTES);
    if (peak_abs < KW_EPS)
        return;
    int8_t *sc = (int8_t *)(out + 192);
    float inv = -128.f / peak;
    uint16_t d = kq_half(1 / inv);
    for (int g = 0; g < 16; g++) {
        int s = kq_round(inv * scale[g]);
        sc[g] = (int8_t)(s < 127 ? s : 127);
    }
    float df = kq_unhalf(d);
    for (int g = 0; g < 16; g++) {
        float step = df * (float)sc[g];
        if (step == 0)
            continue;
        for (int i = 0; i < 16; i++)
            L[16 * g + i] = (int8_t)(kw_clamp(kq_round(x[16 * g + i] / step), -32, 31) + 32);
    }
    uint8_t *ql = out, *qh = out + 128;
    for (int half = 0; half < 2; half++) {
        const int8_t *lv = L + 128 * half;
        uint8_t *low = ql + 64 * half, *high = qh + 32 * half;
        for (int l = 0; l < 32; l++) {
            low[l] = (uint8_t)((lv[l] & 0xF) | ((lv[l + 64] & 0xF) << 4));
            low[l + 32] = (uint8_t)((lv[l + 32] & 0xF) | ((lv[l + 96] & 0xF) << 4));
            high[l] = (uint8_t)((lv[l] >> 4) | ((lv[l + 32] >> 4) << 2) | ((lv[l + 64] >> 4) << 4) |
                                ((lv[l + 96] >> 4) << 6));
        }
    }
    kq_put_half(out + 208, d);
}

/* ------------------------------------------------------------ 32-value blocks, sigma2 of the row */

#define KW_Q4_0 2
#define KW_Q4_1 3
#define KW_Q5_0 6
#define KW_Q5_1 7

static void kw_pack_32(const uint8_t *L, uint8_t *qs, uint8_t *qh) /* qh: NULL for 4-bit types */
{
    uint32_t high = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((L[j] & 0xF) | ((L[j + 16] & 0xF) << 4));
        high |= ((L[j] & 0x10u) >> 4) << j;
        high |= ((L[j + 16] & 0x10u) >> 4) << (j + 16);
    }
    if (qh) {
        for (int k = 0; k < 4; k++)
            qh[k] = (uint8_t)(high >> (8 * k));
    }
}

static void kw_block_32(int type, const float *x, const float *qw, float sigma2, uint8_t *out)
{
    float weight[32];
    for (int j = 0; j < 32; j++)
        weight[j] = qw[j] * sqrtf(sigma2 + x[j] * x[j]);
    if (type == KW_Q4_0 || type == KW_Q5_0) {
        int8_t L[32];
        uint8_t U[32];
        float d = kw_signed(32, type == KW_Q4_0 ? 8 : 16, x, L, weight);
        for (int j = 0; j < 32; j++)
            U[j] = (uint8_t)L[j];
        kq_put_half(out, kq_half(d));
        if (type == KW_Q4_0)
            kw_pack_32(U, out + 2, NULL);
        else
            kw_pack_32(U, out + 6, out + 2);
    } else {
        uint8_t L[32];
        float neg_min;
        float d = kw_affine(32, type == KW_Q4_1 ? 15 : 31, x, weight, L, &neg_min, -0.9f, 0.05f, 36);
        kq_put_half(out, kq_half(d));
        kq_put_half(out + 2, kq_half(-neg_min));
        if (type == KW_Q4_1)
            kw_pack_32(L, out + 4, NULL);
        else
            kw_pack_32(L, out + 8, out + 4);
    }
}

/* Bytes per block and values per block of a type encoded here with weights; 0 when not one. */
static int kw_layout(int type, int *block)
{
    switch (type) {
    case KW_Q4_0: *block = 32; return 18;
    case KW_Q4_1: *block = 32; return 20;
    case KW_Q5_0: *block = 32; return 22;
    case KW_Q5_1: *block = 32; return 24;
    case KQ_Q2_K: *block = KQ_SUPER; return KQ_Q2_K_BYTES;
    case KQ_Q3_K: *block = KQ_SUPER; return KQ_Q3_K_BYTES;
    case KQ_Q4_K: *block = KQ_SUPER; return KQ_Q4_K_BYTES;
    case KQ_Q5_K: *block = KQ_SUPER; return KQ_Q5_K_BYTES;
    case KQ_Q6_K: *block = KQ_SUPER; return KQ_Q6_K_BYTES;
    default: return 0;
    }
}

/* One row of n values (a multiple of the block) with its n weights. */
static void kw_row(int type, const float *x, const float *qw, int64_t n, uint8_t *out)
{
    int block = 0, bytes = kw_layout(type, &block);
    if (block == 32) {
        float sigma2 = kw_mean_square(x, n, 0);
        for (int64_t b = 0; b < n / 32; b++)
            kw_block_32(type, x + 32 * b, qw + 32 * b, sigma2, out + b * bytes);
        return;
    }
    void (*fn)(const float *, const float *, uint8_t *) =
        type == KQ_Q2_K ? kw_q2_k : type == KQ_Q3_K ? kw_q3_k : type == KQ_Q4_K ? kw_q4_k
        : type == KQ_Q5_K ? kw_q5_k : kw_q6_k;
    for (int64_t b = 0; b < n / KQ_SUPER; b++)
        fn(x + KQ_SUPER * b, qw + KQ_SUPER * b, out + b * bytes);
}

#endif
