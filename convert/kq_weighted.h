/* Importance-weighted encoders (llama.cpp's quantize with --imatrix): the searches, the 32-value
 * types the K-quant rules fall back to (Q4_0, Q4_1, Q5_0, Q5_1) and the row loop; the Q2_K..Q6_K
 * super-blocks are in kq_wblocks.h (group searches on vector lanes). Bytes equal to the weighted paths of
 * the pinned ggml (ggml/src/ggml-quants.c, the `quantize_row_*_impl` functions that
 * ggml_quantize_chunk takes when it is given quant weights; docs/convert.md, "importance matrix").
 *
 * Scalar float32 code in the reference's order (every product and sum as written there, C's
 * int -> float conversions where it mixes them; built with -ffp-contract=off): one row at a time,
 * the row's weights indexed by column. The K-quants weigh each value by w * sqrt(sigma2 + x^2)
 * with sigma2 the super-block's mean square (Q6_K: by w alone); the 32-value types use the row's
 * mean square. Included by _kquants.c and kq_wblocks.h; convert/kq_weighted.py is the numpy fallback
 * (same bytes). */
#ifndef SPECCONV_KQ_WEIGHTED_H
#define SPECCONV_KQ_WEIGHTED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kq_common.h"

#define KW_EPS 1e-15f /* a group whose largest magnitude is below this is all zeros */
#define KW_FN static __attribute__((unused)) /* each file including this uses some of these */

KW_FN inline int kw_clamp(int v, int lo, int hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

/* Affine levels 0..nmax, x ~ scale * l + min (min <= 0 returned negated in *neg_min): the min/max
 * grid, then nstep + 1 stretched grids solved by weighted least squares, keeping the smallest
 * weighted squared error. */
KW_FN float kw_affine(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min, float rmin,
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
KW_FN float kw_signed(int n, int nmax, const float *x, int8_t *L, const float *w)
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
KW_FN float kw_positive(int n, int nmax, const float *x, uint8_t *L, const float *w)
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

KW_FN float kw_mean_square(const float *x, int64_t n, int twice)
{
    float sum = 0;
    for (int64_t i = 0; i < n; i++)
        sum += x[i] * x[i];
    return twice ? 2 * sum / (float)n : sum / (float)n;
}

KW_FN void kw_pack_2bit(const uint8_t *levels, uint8_t *qs)
{
    for (int half = 0; half < KQ_SUPER; half += 128)
        for (int l = 0; l < 32; l++)
            qs[half / 4 + l] = (uint8_t)(levels[half + l] | (levels[half + l + 32] << 2) |
                                         (levels[half + l + 64] << 4) | (levels[half + l + 96] << 6));
}

/* ------------------------------------------------------------ 32-value blocks, sigma2 of the row */

#define KW_Q4_0 2
#define KW_Q4_1 3
#define KW_Q5_0 6
#define KW_Q5_1 7

KW_FN void kw_pack_32(const uint8_t *L, uint8_t *qs, uint8_t *qh) /* qh: NULL for 4-bit types */
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

KW_FN void kw_block_32(int type, const float *x, const float *qw, float sigma2, uint8_t *out)
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

/* ------------------------------------------- IQ4_NL (32 values) and IQ4_XS (256): non-linear levels */

#define KW_IQ4_NL 20
#define KW_IQ4_XS 23
static const int8_t kw_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* The level nearest to v (ties to the upper one), by bisection as the reference finds it. */
KW_FN int kw_iq4_index(float v)
{
    const int8_t *val = kw_iq4_values;
    if (v <= val[0])
        return 0;
    if (v >= val[15])
        return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (v < val[mid])
            hi = mid;
        else
            lo = mid;
    }
    return v - val[hi - 1] < val[hi] - v ? hi - 1 : hi;
}

/* One IQ4_NL block (n = 32) or IQ4_XS super-block (n = 256) of sub-blocks of 32: per sub-block the
 * scale through the peak then 15 neighbours by weighted least squares (weights w * sqrt(sigma2 + x^2)
 * with an imatrix, x^2 without: qw NULL); IQ4_XS stores 6-bit sub-block scales against a float16
 * super-scale. out: d, [scales_h, scales_l[4]], qs. */
KW_FN void kw_iq4(int n, const float *x, const float *qw, uint8_t *out)
{
    uint8_t L[KQ_SUPER];
    float scale[8], weight[32];
    float sigma2 = 0;
    for (int j = 0; j < n; j++)
        sigma2 += x[j] * x[j];
    sigma2 *= 2.f / (float)n;
    float top = 0, top_abs = 0;
    int nb = n / 32;
    for (int ib = 0; ib < nb; ib++) {
        const float *xb = x + 32 * ib;
        uint8_t *Lb = L + 32 * ib;
        for (int j = 0; j < 32; j++)
            weight[j] = qw ? qw[32 * ib + j] * sqrtf(sigma2 + xb[j] * xb[j]) : xb[j] * xb[j];
        float peak = 0, peak_abs = 0;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(xb[j]);
            if (a > peak_abs) {
                peak_abs = a;
                peak = xb[j];
            }
        }
        if (peak_abs < KW_EPS) {
            scale[ib] = 0;
            continue;
        }
        float d = -peak / (float)kw_iq4_values[0], id = 1 / d, s_qx = 0, s_q2 = 0;
        for (int j = 0; j < 32; j++) {
            int l = kw_iq4_index(id * xb[j]);
            Lb[j] = (uint8_t)l;
            float q = (float)kw_iq4_values[l];
            s_qx += weight[j] * q * xb[j];
            s_q2 += weight[j] * q * q;
        }
        d = s_q2 > 0 ? s_qx / s_q2 : 0.f;
        float best = d * s_qx;
        for (int k = -7; k <= 7; k++) {
            id = (float)(k + kw_iq4_values[0]) / peak;
            s_qx = s_q2 = 0;
            for (int j = 0; j < 32; j++) {
                float q = (float)kw_iq4_values[kw_iq4_index(id * xb[j])];
                s_qx += weight[j] * q * xb[j];
                s_q2 += weight[j] * q * q;
            }
            if (s_q2 > 0 && s_qx * s_qx > best * s_q2) {
                d = s_qx / s_q2;
                best = d * s_qx;
            }
        }
        scale[ib] = d;
        if (fabsf(d) > top_abs) {
            top_abs = fabsf(d);
            top = d;
        }
    }
    uint8_t *qs;
    if (nb > 1) {
        uint16_t high = 0;
        uint8_t *low = out + 4;
        memset(low, 0, 4);
        float d = -top / 32.f, id = d ? 1 / d : 0.f;
        kq_put_half(out, kq_half(d));
        for (int ib = 0; ib < nb; ib++) {
            int l = kw_clamp(kq_round(id * scale[ib]), -32, 31);
            float dl = d * (float)l, idl = dl ? 1 / dl : 0.f;
            for (int j = 0; j < 32; j++)
                L[32 * ib + j] = (uint8_t)kw_iq4_index(idl * x[32 * ib + j]);
            l += 32;
            low[ib / 2] |= (uint8_t)((l & 0xF) << (4 * (ib % 2)));
            high |= (uint16_t)((l >> 4) << (2 * (ib % 8)));
        }
        out[2] = (uint8_t)(high & 0xFF);
        out[3] = (uint8_t)(high >> 8);
        qs = out + 8;
    } else {
        kq_put_half(out, kq_half(scale[0]));
        float id = scale[0] ? 1 / scale[0] : 0;
        for (int j = 0; j < 32; j++)
            L[j] = (uint8_t)kw_iq4_index(id * x[j]);
        qs = out + 2;
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < 16; j++)
            qs[16 * i + j] = (uint8_t)(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
}

/* Bytes per block and values per block of a type encoded here with weights; 0 when not one. */
KW_FN int kw_layout(int type, int *block)
{
    switch (type) {
    case KW_Q4_0: *block = 32; return 18;
    case KW_Q4_1: *block = 32; return 20;
    case KW_Q5_0: *block = 32; return 22;
    case KW_Q5_1: *block = 32; return 24;
    case KW_IQ4_NL: *block = 32; return 18;
    case KW_IQ4_XS: *block = KQ_SUPER; return 136;
    case KQ_Q2_K: *block = KQ_SUPER; return KQ_Q2_K_BYTES;
    case KQ_Q3_K: *block = KQ_SUPER; return KQ_Q3_K_BYTES;
    case KQ_Q4_K: *block = KQ_SUPER; return KQ_Q4_K_BYTES;
    case KQ_Q5_K: *block = KQ_SUPER; return KQ_Q5_K_BYTES;
    case KQ_Q6_K: *block = KQ_SUPER; return KQ_Q6_K_BYTES;
    default: return 0;
    }
}

/* One row of n values (a multiple of the block) with its n weights; kblock encodes one weighted
 * K-quant super-block (kq_wblocks.h, for this CPU). */
KW_FN void kw_row(int type, const float *x, const float *qw, int64_t n, uint8_t *out,
                  void (*kblock)(const float *, const float *, uint8_t *))
{
    int block = 0, bytes = kw_layout(type, &block);
    if (type == KW_IQ4_NL || type == KW_IQ4_XS) { /* qw may be NULL: the tool's path without an imatrix */
        for (int64_t b = 0; b < n / block; b++)
            kw_iq4(block, x + block * b, qw ? qw + block * b : NULL, out + b * bytes);
        return;
    }
    if (block == 32) {
        float sigma2 = kw_mean_square(x, n, 0);
        for (int64_t b = 0; b < n / 32; b++)
            kw_block_32(type, x + 32 * b, qw + 32 * b, sigma2, out + b * bytes);
        return;
    }
    for (int64_t b = 0; b < n / KQ_SUPER; b++)
        kblock(x + KQ_SUPER * b, qw + KQ_SUPER * b, out + b * bytes);
}

#endif
