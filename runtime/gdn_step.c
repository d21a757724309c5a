/* The gated delta rule for a few tokens (a decode step, the check of k drafts), token by token in
 * cache, for runtime/graphs/gdn.py (docs/reference/model-math.md §2.2). Per value head h and token t,
 * with the state S [dk, dv] of the head:
 *     u = Sᵀ k_t;  δ_t = β_t (v_t − e^{g_t} u);  S ← e^{g_t} S + k_t δ_tᵀ;  o_t = Sᵀ q_t
 * (the recurrent form, e^{g} applied to Sᵀk rather than to S first: the same function, float32
 * rounding of its own). A column of the state needs only itself through the tokens (u_j, δ_j,
 * the update of column j and o_j), so a head is taken 64 columns at a time (32 KB for dk = 128, in
 * L1) through all n tokens: the state is read once and written once per batch, and a token costs
 * one pass over the block in L1 (the update, o and the next token's u together), instead of the ~30
 * tensor operations and state-sized temporaries of the batched torch form. The state before the
 * batch is read from `src` and the state after it written to `dst` (the same address is allowed:
 * each value is read before it is written); δ is returned for gdn.PendingStates, which rebuilds an
 * earlier token's state on a rollback. */
#include "gdn_step.h"

#include <math.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CLONES
#endif

/* products and sums fused where the CPU has FMA (the extension is built without contraction) */
#pragma GCC optimize("fp-contract=fast")

/* 16 columns as one value (a zmm register; two ymm or four xmm in the other clones); a block of
 * four of them keeps its sums in registers while the rows stream */
typedef float v16 __attribute__((vector_size(64)));
enum { JB = 64 };

static inline v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v)
{
    memcpy(p, &v, sizeof v);
}

/* The functions below take a block of columns: S, `out` and o point at its first column (rows
 * `dv` apart), u and d hold just its columns. */

/* u[0 .. 63] = Σ_i k[i] S[i][0 .. 63] */
static inline void column_sums(float *u, const float *k, const float *s, size_t dk, size_t dv)
{
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (size_t i = 0; i < dk; i++) {
        const float *row = s + i * dv;
        a0 += k[i] * load16(row);
        a1 += k[i] * load16(row + 16);
        a2 += k[i] * load16(row + 32);
        a3 += k[i] * load16(row + 48);
    }
    store16(u, a0);
    store16(u + 16, a1);
    store16(u + 32, a2);
    store16(u + 48, a3);
}

/* One token's update of 64 columns: S'[i] = decay S[i] + k[i] d into `out` (which may be `before`:
 * each value is read before it is written), o = Σ_i q[i] S'[i], u = Σ_i k_next[i] S'[i] */
static inline void update_columns(const float *before, float *out, const float *k, const float *q,
                                  const float *k_next, const float *d, float decay, float *o, float *u, size_t dk,
                                  size_t dv)
{
    v16 o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0}, u0 = {0}, u1 = {0}, u2 = {0}, u3 = {0};
    const v16 d0 = load16(d), d1 = load16(d + 16), d2 = load16(d + 32), d3 = load16(d + 48);
    for (size_t i = 0; i < dk; i++) {
        const float *row = before + i * dv;
        float *dst = out + i * dv;
        const float ki = k[i], qi = q[i], kn = k_next[i];
        const v16 x0 = decay * load16(row) + ki * d0, x1 = decay * load16(row + 16) + ki * d1;
        const v16 x2 = decay * load16(row + 32) + ki * d2, x3 = decay * load16(row + 48) + ki * d3;
        store16(dst, x0);
        store16(dst + 16, x1);
        store16(dst + 32, x2);
        store16(dst + 48, x3);
        o0 += qi * x0, o1 += qi * x1, o2 += qi * x2, o3 += qi * x3;
        u0 += kn * x0, u1 += kn * x1, u2 += kn * x2, u3 += kn * x3;
    }
    store16(o, o0), store16(o + 16, o1), store16(o + 32, o2), store16(o + 48, o3);
    store16(u, u0), store16(u + 16, u1), store16(u + 32, u2), store16(u + 48, u3);
}

/* the same for the last dv mod JB columns (w of them), one at a time */
static void column_sums_tail(float *u, const float *k, const float *s, size_t dk, size_t dv, size_t w)
{
    for (size_t j = 0; j < w; j++) {
        float acc = 0.0f;
        for (size_t i = 0; i < dk; i++)
            acc += k[i] * s[i * dv + j];
        u[j] = acc;
    }
}

static void update_columns_tail(const float *before, float *out, const float *k, const float *q,
                                const float *k_next, const float *d, float decay, float *o, float *u, size_t dk,
                                size_t dv, size_t w)
{
    for (size_t j = 0; j < w; j++) {
        float oa = 0.0f, ua = 0.0f;
        for (size_t i = 0; i < dk; i++) {
            const float x = decay * before[i * dv + j] + k[i] * d[j];
            out[i * dv + j] = x;
            oa += q[i] * x;
            ua += k_next[i] * x;
        }
        o[j] = oa;
        u[j] = ua;
    }
}

/* Columns jb .. jb+w-1 (w ≤ JB) of head h through all n tokens. A column's recurrence needs only
 * that column (u_j = Σ_i k_i S_ij, δ_j, the update of S_·j and o_j), so a block of 64 columns (32 KB
 * of state for dk = 128) stays in L1 for every token: the state is read once and written once per
 * batch. */
CLONES static void head_columns(const gdn_args *a, size_t h, size_t jb, size_t w)
{
    const size_t n = a->n, nv = a->nv, dk = a->dk, dv = a->dv;
    const float *s0 = a->src + h * dk * dv + jb;
    float *s = a->dst + h * dk * dv + jb;
    float u[JB], d[JB];
    if (w == JB)
        column_sums(u, a->k + h * dk, s0, dk, dv); /* u = Sᵀ k_0 over the state before the batch */
    else
        column_sums_tail(u, a->k + h * dk, s0, dk, dv, w);
    for (size_t t = 0; t < n; t++) {
        const size_t th = t * nv + h;
        const float *k = a->k + th * dk, *q = a->q + th * dk, *v = a->v + th * dv + jb;
        /* the last token's "next" is its own k again: that u is not used */
        const float *k_next = t + 1 < n ? a->k + (th + nv) * dk : k;
        const float decay = expf(a->g[th]), beta = a->beta[th];
        for (size_t j = 0; j < w; j++)
            d[j] = beta * (v[j] - decay * u[j]);
        float *o = a->o + th * dv + jb;
        /* one pass: the updated rows, o = Sᵀ q, and the next token's u = Sᵀ k_{t+1} from them */
        if (w == JB)
            update_columns(t ? s : s0, s, k, q, k_next, d, decay, o, u, dk, dv);
        else
            update_columns_tail(t ? s : s0, s, k, q, k_next, d, decay, o, u, dk, dv, w);
        memcpy(a->delta + (h * n + t) * dv + jb, d, w * sizeof(float));
    }
}

void gdn_heads(const void *arg, size_t first, size_t count)
{
    const gdn_args *a = (const gdn_args *)arg;
    for (size_t h = first; h < first + count; h++)
        for (size_t jb = 0; jb < a->dv; jb += JB)
            head_columns(a, h, jb, a->dv - jb < JB ? a->dv - jb : JB);
}

/* ---- the causal conv before the rule --------------------------------------------------------- */

/* row r of the inputs x = [state; m]: the state's rows first */
static inline const float *input_row(const gdn_conv_args *a, size_t r)
{
    return r + 1 < a->kernel ? a->state + r * a->channels : a->m + (r + 1 - a->kernel) * a->channels;
}

/* channels c0 .. c1-1: out[t][c] = Σ_j x[t+j][c] w[c][j], and the windows kept (whole rows) */
CLONES static void conv_channels(const gdn_conv_args *a, size_t c0, size_t c1)
{
    const size_t channels = a->channels, k = a->kernel;
    for (size_t t = 0; t < a->n; t++) {
        float *out = a->out + t * channels;
        for (size_t c = c0; c < c1; c++)
            out[c] = 0.0f;
        for (size_t j = 0; j < k; j++) {
            const float *x = input_row(a, t + j), *w = a->w + j;
            for (size_t c = c0; c < c1; c++)
                out[c] += x[c] * w[c * k];
        }
    }
    for (size_t i = 0; i < a->keep; i++) /* the window after token first + i: rows first+i+1 .. +K-1 */
        for (size_t j = 0; j + 1 < k; j++)
            memcpy(a->states + (i * (k - 1) + j) * channels + c0, input_row(a, a->first + i + 1 + j) + c0,
                   (c1 - c0) * sizeof(float));
}

void gdn_conv_channels(const void *arg, size_t first, size_t count)
{
    conv_channels((const gdn_conv_args *)arg, first, first + count);
}
