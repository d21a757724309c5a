/* One super-block (256 float32 values) -> the bytes of a GGML K-quant block, as llama.cpp's
 * reference quantizer lays them out (ggml-common.h block_q2_K ... block_q6_K):
 *   Q2_K  scales[16] qs[64] d dmin           84 bytes
 *   Q3_K  hmask[32] qs[64] scales[12] d     110 bytes
 *   Q4_K  d dmin scales[12] qs[128]         144 bytes
 *   Q5_K  d dmin scales[12] qh[32] qs[128]  176 bytes
 *   Q6_K  ql[128] qh[64] scales[16] d       210 bytes
 * Each encoder searches per-group scales (kq_search.c), quantizes them against one float16
 * super-scale, then re-derives every level from the stored (rounded) scales. */
#include "kq_search.h"

#include <math.h>

#define L8 KQ_LANES


/* 8 consecutive groups of n values -> the searches' lane layout (value i of group g at i * 8 + g). */
static void transpose_in(const float *x, int n, float *xt)
{
    for (int g = 0; g < L8; g++)
        for (int i = 0; i < n; i++)
            xt[i * L8 + g] = x[g * n + i];
}

static void transpose_out_u8(const uint8_t *lt, int n, uint8_t *levels)
{
    for (int g = 0; g < L8; g++)
        for (int i = 0; i < n; i++)
            levels[g * n + i] = lt[i * L8 + g];
}

static void transpose_out_i8(const int8_t *lt, int n, int8_t *levels)
{
    for (int g = 0; g < L8; g++)
        for (int i = 0; i < n; i++)
            levels[g * n + i] = lt[i * L8 + g];
}

/* 2-bit levels of 4 groups of 32, 128 values per 32 bytes: byte l holds levels l, l+32, l+64, l+96. */
static void pack_2bit(const uint8_t *levels, uint8_t *qs)
{
    for (int half = 0; half < KQ_SUPER; half += 128)
        for (int l = 0; l < 32; l++)
            qs[half / 4 + l] = (uint8_t)(levels[half + l] | (levels[half + l + 32] << 2) |
                                         (levels[half + l + 64] << 4) | (levels[half + l + 96] << 6));
}

void KQ_NAME(kq_block_q2_k)(const float *x, uint8_t *out)
{
    uint8_t *scales = out, *qs = out + 16;
    uint8_t levels[KQ_SUPER];
    float xt[16 * L8], wt[16 * L8], scale[16], neg_min[16];
    uint8_t lt[16 * L8];
    for (int half = 0; half < 2; half++) { /* groups 0..7, then 8..15 */
        transpose_in(x + 128 * half, 16, xt);
        for (int i = 0; i < 16 * L8; i++)
            wt[i] = fabsf(xt[i]);
        affine_search(16, 3, xt, wt, lt, scale + 8 * half, neg_min + 8 * half, -0.5f, 0.1f, 15, 1);
        transpose_out_u8(lt, 16, levels + 128 * half);
    }
    float top_scale = 0, top_min = 0; /* scales and negated minimums are never negative */
    for (int g = 0; g < 16; g++) {
        if (scale[g] > top_scale)
            top_scale = scale[g];
        if (neg_min[g] > top_min)
            top_min = neg_min[g];
    }
    uint16_t d = 0, dmin = 0;
    memset(scales, 0, 16);
    if (top_scale > 0) {
        float inv = 15.0f / top_scale;
        for (int g = 0; g < 16; g++)
            scales[g] = (uint8_t)kq_round(inv * scale[g]);
        d = kq_half(top_scale / 15.0f);
    }
    if (top_min > 0) {
        float inv = 15.0f / top_min;
        for (int g = 0; g < 16; g++)
            scales[g] |= (uint8_t)(kq_round(inv * neg_min[g]) << 4);
        dmin = kq_half(top_min / 15.0f);
    }
    float df = kq_unhalf(d), mf = kq_unhalf(dmin);
    for (int g = 0; g < 16; g++) {
        float step = df * (float)(scales[g] & 0xF);
        if (step == 0)
            continue; /* keep the search's levels */
        float shift = mf * (float)(scales[g] >> 4);
        for (int i = 0; i < 16; i++)
            levels[16 * g + i] = (uint8_t)clamp_int(kq_round((x[16 * g + i] + shift) / step), 0, 3);
    }
    pack_2bit(levels, qs);
    kq_put_half(out + 80, d);
    kq_put_half(out + 82, dmin);
}

void KQ_NAME(kq_block_q3_k)(const float *x, uint8_t *out)
{
    uint8_t *hmask = out, *qs = out + 32, *sc = out + 96;
    int8_t raw[KQ_SUPER], lt[16 * L8];
    float xt[16 * L8], scale[16];
    for (int half = 0; half < 2; half++) {
        transpose_in(x + 128 * half, 16, xt);
        signed_refine(16, 4, xt, lt, scale + 8 * half);
        transpose_out_i8(lt, 16, raw + 128 * half);
    }
    float peak = 0, peak_abs = 0;
    for (int g = 0; g < 16; g++) {
        if (fabsf(scale[g]) > peak_abs) {
            peak_abs = fabsf(scale[g]);
            peak = scale[g];
        }
    }
    memset(sc, 0, 12);
    uint16_t d = 0;
    if (peak != 0) {
        float inv = -32.0f / peak;
        for (int g = 0; g < 16; g++) {
            /* 6-bit scale: low nibbles in bytes 0..7, top two bits in bytes 8..11 */
            int l = clamp_int((int8_t)kq_round(inv * scale[g]), -32, 31) + 32;
            if (g < 8)
                sc[g] = (uint8_t)(l & 0xF);
            else
                sc[g - 8] |= (uint8_t)((l & 0xF) << 4);
            sc[8 + g % 4] |= (uint8_t)((l >> 4) << (2 * (g / 4)));
        }
        d = kq_half(1 / inv);
    }
    float df = kq_unhalf(d);
    uint8_t levels[KQ_SUPER];
    for (int i = 0; i < KQ_SUPER; i++)
        levels[i] = (uint8_t)raw[i];
    for (int g = 0; g < 16; g++) {
        int low = g < 8 ? (sc[g] & 0xF) : (sc[g - 8] >> 4);
        int s = (low | (((sc[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32;
        float step = df * (float)s;
        if (step == 0)
            continue;
        for (int i = 0; i < 16; i++)
            levels[16 * g + i] = (uint8_t)(clamp_int(kq_round(x[16 * g + i] / step), -4, 3) + 4);
    }
    /* the third bit of value 32 k + l goes to bit k of hmask byte l (branch-free: it vectorises) */
    memset(hmask, 0, 32);
    for (int k = 0; k < 8; k++) {
        for (int l = 0; l < 32; l++) {
            uint8_t high = levels[32 * k + l] > 3;
            hmask[l] |= (uint8_t)(high << k);
            levels[32 * k + l] -= (uint8_t)(high << 2);
        }
    }
    pack_2bit(levels, qs);
    kq_put_half(out + 108, d);
}

/* Q4_K / Q5_K: 8 groups of 32, 6-bit scales and minimums packed in 12 bytes. */
static void pack_scales_k4(const uint8_t *ls, const uint8_t *lm, uint8_t *sc)
{
    for (int g = 0; g < 8; g++) {
        if (g < 4) {
            sc[g] = ls[g];
            sc[g + 4] = lm[g];
        } else {
            sc[g + 4] = (uint8_t)((ls[g] & 0xF) | ((lm[g] & 0xF) << 4));
            sc[g - 4] |= (uint8_t)((ls[g] >> 4) << 6);
            sc[g] |= (uint8_t)((lm[g] >> 4) << 6);
        }
    }
}

static void unpack_scale_k4(int g, const uint8_t *sc, int *s, int *m)
{
    if (g < 4) {
        *s = sc[g] & 63;
        *m = sc[g + 4] & 63;
    } else {
        *s = (sc[g + 4] & 0xF) | ((sc[g - 4] >> 6) << 4);
        *m = (sc[g + 4] >> 4) | ((sc[g] >> 6) << 4);
    }
}

/* The shared part of Q4_K and Q5_K: levels 0..nmax in `levels`, header (d, dmin, scales) in `out`. */
static void affine_k(const float *x, uint8_t *out, uint8_t *levels, int nmax, float rmin, int nstep)
{
    float xt[32 * L8], wt[32 * L8], sq[L8], rms[L8], scale[8], neg_min[8];
    uint8_t lt[32 * L8];
    transpose_in(x, 32, xt);
    for (int g = 0; g < L8; g++)
        sq[g] = 0;
    for (int i = 0; i < 32; i++)
        for (int g = 0; g < L8; g++)
            sq[g] += xt[i * L8 + g] * xt[i * L8 + g];
    for (int g = 0; g < L8; g++)
        rms[g] = sqrtf(sq[g] / 32);
    for (int i = 0; i < 32; i++)
        for (int g = 0; g < L8; g++)
            wt[i * L8 + g] = rms[g] + fabsf(xt[i * L8 + g]);
    affine_search(32, nmax, xt, wt, lt, scale, neg_min, rmin, 0.1f, nstep, 0);
    transpose_out_u8(lt, 32, levels);
    float top_scale = 0, top_min = 0;
    for (int g = 0; g < 8; g++) {
        if (scale[g] > top_scale)
            top_scale = scale[g];
        if (neg_min[g] > top_min)
            top_min = neg_min[g];
    }
    float inv_s = top_scale > 0 ? 63.0f / top_scale : 0.0f;
    float inv_m = top_min > 0 ? 63.0f / top_min : 0.0f;
    uint8_t ls[8], lm[8];
    for (int g = 0; g < 8; g++) {
        uint8_t s = (uint8_t)kq_round(inv_s * scale[g]);
        uint8_t m = (uint8_t)kq_round(inv_m * neg_min[g]);
        ls[g] = s < 63 ? s : 63;
        lm[g] = m < 63 ? m : 63;
    }
    uint8_t *sc = out + 4;
    pack_scales_k4(ls, lm, sc);
    uint16_t d = kq_half(top_scale / 63.0f), dmin = kq_half(top_min / 63.0f);
    kq_put_half(out, d);
    kq_put_half(out + 2, dmin);
    float df = kq_unhalf(d), mf = kq_unhalf(dmin);
    for (int g = 0; g < 8; g++) {
        int s, m;
        unpack_scale_k4(g, sc, &s, &m);
        float step = df * (float)s;
        if (step == 0)
            continue;
        float shift = mf * (float)m;
        for (int i = 0; i < 32; i++)
            levels[32 * g + i] = (uint8_t)clamp_int(kq_round((x[32 * g + i] + shift) / step), 0, nmax);
    }
}

void KQ_NAME(kq_block_q4_k)(const float *x, uint8_t *out)
{
    uint8_t levels[KQ_SUPER];
    affine_k(x, out, levels, 15, -1.0f, 20);
    uint8_t *qs = out + 16;
    for (int q = 0; q < 4; q++) /* 64 values per 32 bytes: low nibble l, high nibble l + 32 */
        for (int l = 0; l < 32; l++)
            qs[32 * q + l] = (uint8_t)(levels[64 * q + l] | (levels[64 * q + l + 32] << 4));
}

void KQ_NAME(kq_block_q5_k)(const float *x, uint8_t *out)
{
    uint8_t levels[KQ_SUPER];
    affine_k(x, out, levels, 31, -0.5f, 15);
    uint8_t *qh = out + 16, *qs = out + 48;
    memset(qh, 0, 32);
    for (int q = 0; q < 4; q++) {
        for (int l = 0; l < 32; l++) {
            int a = levels[64 * q + l], b = levels[64 * q + l + 32];
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

void KQ_NAME(kq_block_q6_k)(const float *x, uint8_t *out)
{
    uint8_t *ql = out, *qh = out + 128;
    int8_t *sc = (int8_t *)(out + 192);
    int8_t levels[KQ_SUPER], lt[16 * L8];
    float xt[16 * L8], scale[16];
    for (int half = 0; half < 2; half++) {
        transpose_in(x + 128 * half, 16, xt);
        signed_search(16, 32, xt, lt, scale + 8 * half, NULL);
        transpose_out_i8(lt, 16, levels + 128 * half);
    }
    float peak = 0, peak_abs = 0;
    for (int g = 0; g < 16; g++) {
        if (fabsf(scale[g]) > peak_abs) {
            peak_abs = fabsf(scale[g]);
            peak = scale[g];
        }
    }
    if (peak_abs < 1e-15f) {
        memset(out, 0, KQ_Q6_K_BYTES);
        return;
    }
    float inv = -128.0f / peak;
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
            levels[16 * g + i] = (int8_t)(clamp_int(kq_round(x[16 * g + i] / step), -32, 31) + 32);
    }
    for (int half = 0; half < 2; half++) {
        const int8_t *lv = levels + 128 * half;
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

#include "kq_wblocks.h" /* the importance-weighted encoders, built from the same searches */
