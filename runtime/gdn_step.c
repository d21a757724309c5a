/* The gated delta rule for a few tokens (a decode step, the check of k drafts), token by token in
 * cache, for runtime/graphs/gdn.py (docs/reference/model-math.md §2.2). Per value head h and token t,
 * with the state S [dk, dv] of the head:
 *     u = Sᵀ k_t;  δ_t = β_t (v_t − e^{g_t} u);  S ← e^{g_t} S + k_t δ_tᵀ;  o_t = Sᵀ q_t
 * (the recurrent form, e^{g} applied to Sᵀk rather than to S first: the same function, float32
 * rounding of its own). A head's state is 64 KB for dk = dv = 128: it stays in L2 while the n
 * tokens pass over it once each (the update, o and the next token's u in one pass; one more pass
 * for the first u), instead of the ~30 tensor operations and state-sized temporaries of the batched
 * torch form. The state before the batch is read from `src` and the state after it written
 * to `dst` (the same address is allowed: each row is read before it is written); δ is returned
 * for gdn.PendingStates, which rebuilds an earlier token's state on a rollback. */
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

/* acc[j] += a * row[j] */
static inline void axpy(float *restrict acc, float a, const float *restrict row, size_t dv)
{
    for (size_t j = 0; j < dv; j++)
        acc[j] += a * row[j];
}

CLONES static void one_head(const gdn_args *a, size_t h)
{
    const size_t n = a->n, nv = a->nv, dk = a->dk, dv = a->dv;
    const float *s0 = a->src + h * dk * dv;
    float *s = a->dst + h * dk * dv;
    float u[GDN_MAX_DV], d[GDN_MAX_DV], o[GDN_MAX_DV];
    memset(u, 0, dv * sizeof(float)); /* u = Sᵀ k_0 over the state before the batch */
    for (size_t i = 0; i < dk; i++)
        axpy(u, a->k[h * dk + i], s0 + i * dv, dv);
    for (size_t t = 0; t < n; t++) {
        const float *before = t ? s : s0; /* the state before token t */
        const size_t th = t * nv + h;
        const float *k = a->k + th * dk, *q = a->q + th * dk, *v = a->v + th * dv;
        const float *k_next = t + 1 < n ? a->k + (th + nv) * dk : NULL;
        const float decay = expf(a->g[th]), beta = a->beta[th];
        for (size_t j = 0; j < dv; j++)
            d[j] = beta * (v[j] - decay * u[j]);
        memset(o, 0, dv * sizeof(float));
        memset(u, 0, dv * sizeof(float));
        /* one pass: the updated rows, o = Sᵀ q, and the next token's u = Sᵀ k_{t+1} from them */
        for (size_t i = 0; i < dk; i++) {
            const float *row = before + i * dv, ki = k[i], qi = q[i], kn = k_next ? k_next[i] : 0.0f;
            float *out = s + i * dv;
            for (size_t j = 0; j < dv; j++) {
                const float x = decay * row[j] + ki * d[j];
                out[j] = x;
                o[j] += qi * x;
                u[j] += kn * x;
            }
        }
        memcpy(a->o + th * dv, o, dv * sizeof(float));
        memcpy(a->delta + (h * n + t) * dv, d, dv * sizeof(float));
    }
}

void gdn_heads(const void *arg, size_t first, size_t count)
{
    for (size_t h = first; h < first + count; h++)
        one_head((const gdn_args *)arg, h);
}
