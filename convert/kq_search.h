/* Scale searches of the K-quant encoder: for groups of 16 or 32 values, the scale (and minimum)
 * that the reference quantizer picks, with the same float32 operations in the same order.
 *
 * Eight groups are searched at once, one per vector lane (GCC vector types: `vf` holds one float
 * per group): the values are given transposed (xt[i * 8 + g] is value i of group g), every vector
 * operation is the reference's operation for each group independently, and sums are accumulated
 * one term at a time from 0 in the reference's order, lane by lane. Lanes never mix, so each
 * group's result is the scalar result bit for bit; with AVX2 one instruction does all 8 groups.
 * Included by kq_generic.c and kq_avx2.c: compiled once per instruction set (see kq_common.h). */
#include "kq_common.h"

#include <math.h>

#define G KQ_LANES

static inline int clamp_int(int v, int lo, int hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

/* 8 float32 / int32 lanes as GCC vector types (two SSE registers each without AVX2). */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

static inline vf vload(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf vsplat(float f)
{
    return (vf){f, f, f, f, f, f, f, f};
}

static inline vf vsel(vi mask, vf a, vf b) /* mask lanes are all ones or zero */
{
    return (vf)((mask & (vi)a) | (~mask & (vi)b));
}

static inline vf vabs(vf a)
{
    return (vf)((vi)a & 0x7fffffff);
}

static inline vf vtof(vi a)
{
    return __builtin_convertvector(a, vf);
}

static inline vi vround(vf v) /* kq_round, lane-wise */
{
    vi bits = (vi)(v + vsplat(12582912.0f));
    return (bits & 0x007fffff) - 0x00400000;
}

static inline vi vclamp(vi v, int lo, int hi)
{
    vi vlo = v < lo, vhi = v > hi;
    v = (vlo & lo) | (~vlo & v);
    return (vhi & hi) | (~vhi & v);
}

/* Affine levels 0..nmax with x ~ scale * l - neg_min (Q2_K, Q4_K, Q5_K). Starts from the min/max
 * fit, then tries nstep + 1 stretched grids, each solved by weighted least squares for scale and
 * minimum, keeping the grid with the smallest weighted error (absolute error when use_mad). A
 * better grid moves the minimum, and the grids after it are laid from the new minimum. */
static void affine_search(int n, int nmax, const float *xt, const float *wt, uint8_t *lt, float *scale_out,
                          float *neg_min, float rmin, float rdelta, int nstep, int use_mad)
{
    /* GCC vector types: one value per group, every operation lane-wise IEEE float32 (or int32) */
    vf lo = vload(xt), hi = lo, sum_w = vload(wt), sum_x = sum_w * lo;
    for (int i = 1; i < n; i++) {
        vf x = vload(xt + i * G), w = vload(wt + i * G);
        lo = vsel(x < lo, x, lo);
        hi = vsel(x > hi, x, hi);
        sum_w += w;
        sum_x += w * x;
    }
    const vf zero = vsplat(0.0f), fnmax = vsplat((float)nmax);
    lo = vsel(lo > zero, zero, lo);
    const vf lo0 = lo;
    vf inv = fnmax / (hi - lo); /* a flat group divides by 0 here; it is reset at the end */
    vf scale = vsplat(1.0f) / inv, best = zero;
    vi lv[32], trial[32];
    for (int i = 0; i < n; i++) {
        vf x = vload(xt + i * G);
        vi l = vclamp(vround(inv * (x - lo)), 0, nmax);
        lv[i] = l;
        vf err = scale * vtof(l) + lo - x;
        err = use_mad ? vabs(err) : err * err;
        best += vload(wt + i * G) * err;
    }
    for (int step = 0; step <= nstep; step++) {
        inv = vsplat(rmin + rdelta * (float)step + (float)nmax) / (hi - lo);
        vf s_l = zero, s_l2 = zero, s_xl = zero;
        for (int i = 0; i < n; i++) {
            vf x = vload(xt + i * G), w = vload(wt + i * G);
            vi l = vclamp(vround(inv * (x - lo)), 0, nmax);
            trial[i] = l;
            vf fl = vtof(l);
            s_l += w * fl;
            s_l2 += w * fl * fl;
            s_xl += w * fl * x;
        }
        vf det = sum_w * s_l2 - s_l * s_l;
        vf a = (sum_w * s_xl - sum_x * s_l) / det;
        vf b = (s_l2 * sum_x - s_l * s_xl) / det;
        vi positive = b > zero;
        vf t_scale = vsel(positive, s_xl / s_l2, a);
        vf t_min = vsel(positive, zero, b);
        vf err_sum = zero;
        for (int i = 0; i < n; i++) {
            vf err = t_scale * vtof(trial[i]) + t_min - vload(xt + i * G);
            err = use_mad ? vabs(err) : err * err;
            err_sum += vload(wt + i * G) * err;
        }
        vi take = (det > zero) & (err_sum < best);
        best = vsel(take, err_sum, best);
        scale = vsel(take, t_scale, scale);
        lo = vsel(take, t_min, lo);
        for (int i = 0; i < n; i++)
            lv[i] = (take & trial[i]) | (~take & lv[i]);
    }
    vi flat = hi == lo0;
    vf s_out = vsel(flat, zero, scale), m_out = -vsel(flat, lo0, lo);
    memcpy(scale_out, &s_out, sizeof s_out);
    memcpy(neg_min, &m_out, sizeof m_out);
    for (int i = 0; i < n; i++) {
        vi l = ~flat & lv[i];
        for (int g = 0; g < G; g++)
            lt[i * G + g] = (uint8_t)l[g];
    }
}

/* Per lane: the first value of largest magnitude, and whether it is below 1e-15 (all "zero"). */
static inline vf signed_peak(int n, const float *xt, vi *zero)
{
    vf peak = vsplat(0.0f), peak_abs = peak;
    for (int i = 0; i < n; i++) {
        vf x = vload(xt + i * G), a = vabs(x);
        vi bigger = a > peak_abs;
        peak_abs = vsel(bigger, a, peak_abs);
        peak = vsel(bigger, x, peak);
    }
    *zero = peak_abs < vsplat(1e-15f);
    return peak;
}

/* Symmetric levels -nmax..nmax-1 (stored + nmax), weights x^2 (Q6_K) or wt (same layout as xt:
 * the importance-weighted Q3_K / Q6_K): the grid through the peak, then 18 grids with the peak
 * mapped to -(nmax + 0.1 k), keeping the best least-squares fit. */
static void signed_search(int n, int nmax, const float *xt, int8_t *lt, float *scale_out, const float *wt)
{
    vi zero_lane;
    const vf zero = vsplat(0.0f);
    vf peak = signed_peak(n, xt, &zero_lane);
    vf inv = vsplat((float)(-nmax)) / peak, s_xl = zero, s_l2 = zero;
    vi lv[32];
    for (int i = 0; i < n; i++) {
        vf x = vload(xt + i * G);
        vi l = vclamp(vround(inv * x), -nmax, nmax - 1);
        lv[i] = l;
        vf w = wt ? vload(wt + i * G) : x * x, fl = vtof(l);
        s_xl += w * x * fl;
        s_l2 += w * fl * fl;
    }
    vf scale = vsel(s_l2 != zero, s_xl / s_l2, zero);
    vf best = scale * s_xl;
    for (int k = -9; k <= 9; k++) {
        if (k == 0)
            continue;
        inv = -vsplat((float)nmax + 0.1f * (float)k) / peak;
        vi trial[32];
        s_xl = s_l2 = zero;
        for (int i = 0; i < n; i++) {
            vf x = vload(xt + i * G);
            vi l = vclamp(vround(inv * x), -nmax, nmax - 1);
            trial[i] = l;
            vf w = wt ? vload(wt + i * G) : x * x, fl = vtof(l);
            s_xl += w * x * fl;
            s_l2 += w * fl * fl;
        }
        vi take = (s_l2 > zero) & (s_xl * s_xl > best * s_l2);
        vf s = s_xl / s_l2;
        scale = vsel(take, s, scale);
        best = vsel(take, s * s_xl, best);
        for (int i = 0; i < n; i++)
            lv[i] = (take & trial[i]) | (~take & lv[i]);
    }
    vf s_out = vsel(zero_lane, zero, scale);
    memcpy(scale_out, &s_out, sizeof s_out);
    for (int i = 0; i < n; i++) {
        vi l = ~zero_lane & (lv[i] + nmax);
        for (int g = 0; g < G; g++)
            lt[i * G + g] = (int8_t)l[g];
    }
}

/* Symmetric levels (Q3_K): the grid through the peak, then up to 5 sweeps that move one level at
 * a time whenever that raises (sum w x l)^2 / (sum w l^2), weights x^2. Levels stored + nmax. A
 * lane whose sweep moved nothing would move nothing in the next one, so the lanes sweep together. */
static void signed_refine(int n, int nmax, const float *xt, int8_t *lt, float *scale_out)
{
    vi zero_lane;
    const vf zero = vsplat(0.0f);
    vf peak = signed_peak(n, xt, &zero_lane);
    vf inv = vsplat((float)(-nmax)) / peak, s_xl = zero, s_l2 = zero;
    vi lv[32];
    for (int i = 0; i < n; i++) {
        vf x = vload(xt + i * G);
        vi l = vclamp(vround(inv * x), -nmax, nmax - 1);
        lv[i] = l;
        vf w = x * x, fl = vtof(l);
        s_xl += w * x * fl;
        s_l2 += w * fl * fl;
    }
    for (int sweep = 0; sweep < 5; sweep++) {
        vi moved = {0};
        for (int i = 0; i < n; i++) {
            vf x = vload(xt + i * G), w = x * x, cur = vtof(lv[i]);
            vf xl = s_xl - w * x * cur;
            vf l2 = s_l2 - w * cur * cur;
            vi cand = vclamp(vround(x * l2 / xl), -nmax, nmax - 1);
            vf fc = vtof(cand);
            vf xl2 = xl + w * x * fc;
            vf l2b = l2 + w * fc * fc;
            vi take = ~zero_lane & (xl > zero) & (cand != lv[i]) & (l2b > zero) &
                      (xl2 * xl2 * s_l2 > s_xl * s_xl * l2b);
            lv[i] = (take & cand) | (~take & lv[i]);
            s_xl = vsel(take, xl2, s_xl);
            s_l2 = vsel(take, l2b, s_l2);
            moved |= take;
        }
        int any = 0;
        for (int g = 0; g < G; g++)
            any |= moved[g];
        if (!any)
            break;
    }
    vf s_out = vsel(zero_lane, zero, vsel(s_l2 > zero, s_xl / s_l2, zero));
    memcpy(scale_out, &s_out, sizeof s_out);
    for (int i = 0; i < n; i++) {
        vi l = ~zero_lane & (lv[i] + nmax);
        for (int g = 0; g < G; g++)
            lt[i * G + g] = (int8_t)l[g];
    }
}
