/* Importance-weighted K-quant super-blocks (llama.cpp's quantize with --imatrix; the searches of
 * convert/kq_weighted.h), with the group searches on 8 vector lanes (kq_search.h: one lane per
 * group, each lane the scalar computation, so the bytes are the scalar ones). Included at the end
 * of kq_blocks.h: compiled for any CPU and for AVX2 like the unweighted encoders. qw: the 256
 * weights of this super-block's columns. */
#include "kq_weighted.h"

/* Per value: w * sqrt(sigma2 + x^2), transposed like xt; sw[g]: each group's weights summed in order. */
static void weigh(const float *xt, const float *qw, int n, float sigma2, float *wt, float *sw)
{
    for (int g = 0; g < L8; g++)
        sw[g] = 0;
    for (int i = 0; i < n; i++)
        for (int g = 0; g < L8; g++) {
            float x = xt[i * L8 + g];
            wt[i * L8 + g] = qw[g * n + i] * sqrtf(sigma2 + x * x);
            sw[g] += wt[i * L8 + g];
        }
}

void KQ_NAME(kq_wblock_q2_k)(const float *x, const float *qw, uint8_t *out)
{
    uint8_t L[KQ_SUPER], Ls[16], Lm[16], lt[16 * L8];
    float xt[16 * L8], wt[16 * L8], scale[16], neg_min[16], sw[16];
    float sigma2 = kw_mean_square(x, KQ_SUPER, 0);
    for (int half = 0; half < 2; half++) {
        transpose_in(x + 128 * half, 16, xt);
        weigh(xt, qw + 128 * half, 16, sigma2, wt, sw + 8 * half);
        affine_search(16, 3, xt, wt, lt, scale + 8 * half, neg_min + 8 * half, -0.9f, 0.05f, 36, 0);
        transpose_out_u8(lt, 16, L + 128 * half);
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

void KQ_NAME(kq_wblock_q3_k)(const float *x, const float *qw, uint8_t *out)
{
    int8_t L[KQ_SUPER], Ls[16], lt[16 * L8];
    float xt[16 * L8], wt[16 * L8], scale[16], sw[16];
    float sigma2 = kw_mean_square(x, KQ_SUPER, 1);
    for (int half = 0; half < 2; half++) {
        transpose_in(x + 128 * half, 16, xt);
        weigh(xt, qw + 128 * half, 16, sigma2, wt, sw + 8 * half);
        signed_search(16, 4, xt, lt, scale + 8 * half, wt);
        transpose_out_i8(lt, 16, L + 128 * half);
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
static void waffine_k(const float *x, const float *qw, uint8_t *out, uint8_t *L, int nmax, int clamp63)
{
    uint8_t Ls[8], Lm[8], lt[32 * L8];
    float xt[32 * L8], wt[32 * L8], scale[8], neg_min[8], sw[8];
    float sigma2 = kw_mean_square(x, KQ_SUPER, 1);
    transpose_in(x, 32, xt);
    weigh(xt, qw, 32, sigma2, wt, sw);
    affine_search(32, nmax, xt, wt, lt, scale, neg_min, -0.9f, 0.05f, 36, 0);
    transpose_out_u8(lt, 32, L);
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
        unpack_scale_k4(g, sc, &s, &m);
        float step = df * (float)s;
        if (step == 0)
            continue;
        float shift = mf * (float)m;
        for (int i = 0; i < 32; i++)
            L[32 * g + i] = (uint8_t)kw_clamp(kq_round((x[32 * g + i] + shift) / step), 0, nmax);
    }
}

void KQ_NAME(kq_wblock_q4_k)(const float *x, const float *qw, uint8_t *out)
{
    uint8_t L[KQ_SUPER];
    waffine_k(x, qw, out, L, 15, 0);
    uint8_t *qs = out + 16;
    for (int q = 0; q < 4; q++)
        for (int l = 0; l < 32; l++)
            qs[32 * q + l] = (uint8_t)(L[64 * q + l] | (L[64 * q + l + 32] << 4));
}

void KQ_NAME(kq_wblock_q5_k)(const float *x, const float *qw, uint8_t *out)
{
    uint8_t L[KQ_SUPER];
    waffine_k(x, qw, out, L, 31, 1);
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

void KQ_NAME(kq_wblock_q6_k)(const float *x, const float *qw, uint8_t *out)
{
    int8_t L[KQ_SUPER], lt[16 * L8];
    float xt[16 * L8], wt[16 * L8], scale[16], peak = 0, peak_abs = 0;
    for (int half = 0; half < 2; half++) {
        transpose_in(x + 128 * half, 16, xt);
        transpose_in(qw + 128 * half, 16, wt); /* weights: w alone */
        signed_search(16, 32, xt, lt, scale + 8 * half, wt);
        transpose_out_i8(lt, 16, L + 128 * half);
    }
    for (int g = 0; g < 16; g++) {
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
