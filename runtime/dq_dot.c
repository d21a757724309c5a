/* Fused dequantize-and-multiply for the decode hot path: out[j][r] = x_j . row r of a stored matrix.
 *
 * Each row is dequantized by its type's decoder (dq_blocks.c, so the weights are exactly the
 * values runtime/dequant.py gives) into a small buffer that stays in the L1/L2 cache, and is
 * multiplied at once with each of the few activation vectors. The float32 matrix never exists;
 * only the stored bytes stream from memory (a quarter or less of the float32 matrix).
 *
 * The dot products are sums in a fixed order: 32 running sums (sum l takes elements i = l mod 32,
 * products rounded, then added; no fused multiply-add), combined pairwise at the end (combine()),
 * then the remaining (n_in mod 32) products in order. The AVX2 clones and the plain ones keep these
 * same 32 sums, so the result is the same on every machine; but the summation order
 * differs from the BLAS product x @ W^T: the two agree within float32 summation-order noise
 * (bounded and measured in tests/test_runtime_dequant_native.py). On AVX2, Q8_0, Q4_K, Q5_K, Q6_K, BF16 and
 * F16 have kernels that compute the values in registers, for two activation vectors at a time
 * (dq_dot_avx2.c); the other types, and every type without AVX2, decode a row into a buffer first. */
#include "dq_blocks.h"

#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p)
{
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The 32 running sums acc[0..31] of a dot product, combined in one fixed pairwise order. */
static float combine(const float acc[32])
{
    float u[16], t[8];
    for (int l = 0; l < 16; l++)
        u[l] = acc[l] + acc[l + 16];
    for (int l = 0; l < 8; l++)
        t[l] = u[l] + u[l + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

static float combine4(v8 a, v8 b, v8 c, v8 d)
{
    float acc[32];
    memcpy(acc, &a, 32);
    memcpy(acc + 8, &b, 32);
    memcpy(acc + 16, &c, 32);
    memcpy(acc + 24, &d, 32);
    return combine(acc);
}

/* out[j * out_stride] = w . x_j for j < nx (x_j at x + j * n_in), w already dequantized */
CLONES static void dots(const float *restrict w, const float *restrict x, size_t n_in, size_t nx,
                        float *restrict out, size_t out_stride)
{
    const size_t whole = n_in - n_in % 32;
    for (size_t j = 0; j < nx; j++) {
        const float *xj = x + j * n_in;
        v8 a = {0}, b = {0}, c = {0}, d = {0};
        for (size_t i = 0; i < whole; i += 32) {
            a += load8(w + i) * load8(xj + i);
            b += load8(w + i + 8) * load8(xj + i + 8);
            c += load8(w + i + 16) * load8(xj + i + 16);
            d += load8(w + i + 24) * load8(xj + i + 24);
        }
        float sum = combine4(a, b, c, d);
        for (size_t i = whole; i < n_in; i++)
            sum += w[i] * xj[i];
        out[j * out_stride] = sum;
    }
}

void dq_dot_rows(const dq_type *type, const uint8_t *w, size_t row_bytes, size_t first, size_t count,
                 size_t n_in, const float *x, size_t nx, float *out, size_t out_stride, float *row)
{
    const size_t blocks = n_in / (size_t)type->block;
    const dq_accumulate_fn accumulate = dq_accumulate_avx2(type->ggml_type);
    if (accumulate != NULL) { /* the same sums as decode + dots() below, without the row buffer */
        const size_t units = type->block == 1 ? n_in / 32 : blocks, done = type->block == 1 ? units * 32 : n_in;
        for (size_t r = first; r < first + count; r++) {
            const uint8_t *wr = w + r * row_bytes;
            if (done < n_in) /* a 16-bit float row's last n_in mod 32 values, added in order */
                type->decode(wr + done * (size_t)type->size, row, n_in - done);
            for (size_t j = 0; j < nx; j += 2) { /* two vectors per pass: the values computed once */
                const int nvec = nx - j >= 2 ? 2 : 1;
                float acc[2][32] = {{0}};
                accumulate(wr, x + j * n_in, n_in, nvec, units, acc);
                for (int k = 0; k < nvec; k++) {
                    const float *xk = x + (j + k) * n_in;
                    float sum = combine(acc[k]);
                    for (size_t i = done; i < n_in; i++)
                        sum += row[i - done] * xk[i];
                    out[(j + k) * out_stride + r] = sum;
                }
            }
        }
        return;
    }
    for (size_t r = first; r < first + count; r++) {
        type->decode(w + r * row_bytes, row, blocks);
        dots(row, x, n_in, nx, out + r, out_stride);
    }
}
