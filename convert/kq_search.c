/* Scale searches of the K-quant encoder: for a group of 16 or 32 values, the scale (and minimum)
 * that the reference quantizer picks, with the same float32 operations in the same order.
 * Sums are accumulated one term at a time from 0, left to right, as the reference does. */
#include "kq_common.h"

#include <math.h>

static inline int clamp_int(int v, int lo, int hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

/* Affine levels 0..nmax with x ~ scale * l - neg_min (Q2_K, Q4_K, Q5_K). Starts from the min/max
 * fit, then tries nstep + 1 stretched grids, each solved by weighted least squares for scale and
 * minimum, keeping the grid with the smallest weighted error (absolute error when use_mad). */
float kq_affine_search(int n, int nmax, const float *x, const float *w, uint8_t *levels, float *neg_min,
                       float rmin, float rdelta, int nstep, int use_mad)
{
    float lo = x[0], hi = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
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
    if (hi == lo) {
        memset(levels, 0, (size_t)n);
        *neg_min = -lo;
        return 0.0f;
    }
    float inv = (float)nmax / (hi - lo);
    float scale = 1 / inv;
    float best = 0;
    for (int i = 0; i < n; i++) {
        int l = clamp_int(kq_round(inv * (x[i] - lo)), 0, nmax);
        levels[i] = (uint8_t)l;
        float err = scale * (float)l + lo - x[i];
        err = use_mad ? fabsf(err) : err * err;
        best += w[i] * err;
    }
    if (nstep < 1) {
        *neg_min = -lo;
        return scale;
    }
    uint8_t trial[32];
    for (int step = 0; step <= nstep; step++) {
        inv = (rmin + rdelta * (float)step + (float)nmax) / (hi - lo);
        float s_l = 0, s_l2 = 0, s_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = clamp_int(kq_round(inv * (x[i] - lo)), 0, nmax);
            trial[i] = (uint8_t)l;
            float fl = (float)l;
            s_l += w[i] * fl;
            s_l2 += w[i] * fl * fl;
            s_xl += w[i] * fl * x[i];
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
        float err_sum = 0;
        for (int i = 0; i < n; i++) {
            float err = t_scale * (float)trial[i] + t_min - x[i];
            err = use_mad ? fabsf(err) : err * err;
            err_sum += w[i] * err;
        }
        if (err_sum < best) {
            memcpy(levels, trial, (size_t)n);
            best = err_sum;
            scale = t_scale;
            lo = t_min;
        }
    }
    *neg_min = -lo;
    return scale;
}

/* The element of largest magnitude (the first one on ties), or 0 when all are below 1e-15. */
static float signed_peak(int n, const float *x)
{
    float peak = 0, peak_abs = 0;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > peak_abs) {
            peak_abs = a;
            peak = x[i];
        }
    }
    return peak_abs < 1e-15f ? 0.0f : peak;
}

/* Symmetric levels -nmax..nmax-1 (stored + nmax), weights x^2 (Q6_K): the grid through the peak,
 * then 18 grids with the peak mapped to -(nmax +- 0.1 k), keeping the best least-squares fit. */
float kq_signed_search(int n, int nmax, const float *x, int8_t *levels)
{
    float peak = signed_peak(n, x);
    if (peak == 0) {
        memset(levels, 0, (size_t)n);
        return 0.0f;
    }
    float inv = (float)(-nmax) / peak;
    float s_xl = 0, s_l2 = 0;
    for (int i = 0; i < n; i++) {
        int l = clamp_int(kq_round(inv * x[i]), -nmax, nmax - 1);
        levels[i] = (int8_t)(l + nmax);
        float wt = x[i] * x[i];
        s_xl += wt * x[i] * (float)l;
        s_l2 += wt * (float)l * (float)l;
    }
    float scale = s_l2 != 0 ? s_xl / s_l2 : 0.0f;
    float best = scale * s_xl;
    for (int k = -9; k <= 9; k++) {
        if (k == 0)
            continue;
        inv = -((float)nmax + 0.1f * (float)k) / peak;
        float t_xl = 0, t_l2 = 0;
        for (int i = 0; i < n; i++) {
            float l = (float)clamp_int(kq_round(inv * x[i]), -nmax, nmax - 1);
            float wt = x[i] * x[i];
            t_xl += wt * x[i] * l;
            t_l2 += wt * l * l;
        }
        if (t_l2 > 0 && t_xl * t_xl > best * t_l2) {
            for (int i = 0; i < n; i++)
                levels[i] = (int8_t)(clamp_int(kq_round(inv * x[i]), -nmax, nmax - 1) + nmax);
            scale = t_xl / t_l2;
            best = scale * t_xl;
        }
    }
    return scale;
}

/* Symmetric levels (Q3_K): the grid through the peak, then up to 5 sweeps that move one level at
 * a time whenever that raises (sum w x l)^2 / (sum w l^2), weights x^2. Levels stored + nmax. */
float kq_signed_refine(int n, int nmax, const float *x, int8_t *levels)
{
    float peak = signed_peak(n, x);
    if (peak == 0) {
        memset(levels, 0, (size_t)n);
        return 0.0f;
    }
    float inv = (float)(-nmax) / peak;
    int lv[32];
    float s_xl = 0, s_l2 = 0;
    for (int i = 0; i < n; i++) {
        lv[i] = clamp_int(kq_round(inv * x[i]), -nmax, nmax - 1);
        float wt = x[i] * x[i];
        s_xl += wt * x[i] * (float)lv[i];
        s_l2 += wt * (float)lv[i] * (float)lv[i];
    }
    for (int sweep = 0; sweep < 5; sweep++) {
        int moved = 0;
        for (int i = 0; i < n; i++) {
            float wt = x[i] * x[i];
            float fl = (float)lv[i];
            float xl = s_xl - wt * x[i] * fl;
            if (!(xl > 0))
                continue;
            float l2 = s_l2 - wt * fl * fl;
            int cand = clamp_int(kq_round(x[i] * l2 / xl), -nmax, nmax - 1);
            if (cand == lv[i])
                continue;
            float fc = (float)cand;
            xl += wt * x[i] * fc;
            l2 += wt * fc * fc;
            if (l2 > 0 && xl * xl * s_l2 > s_xl * s_xl * l2) {
                lv[i] = cand;
                s_xl = xl;
                s_l2 = l2;
                moved++;
            }
        }
        if (!moved)
            break;
    }
    for (int i = 0; i < n; i++)
        levels[i] = (int8_t)(lv[i] + nmax);
    return s_l2 > 0 ? s_xl / s_l2 : 0.0f;
}
