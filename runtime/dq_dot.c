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
 * (bounded and measured in tests/test_runtime_dequant_native.py). Q8_0, the hot type, has its own
 * kernels that never write the row out, and so have Q4_K, Q5_K, Q6_K and BF16 on AVX2
 * (dq_dot_avx2.c); the others decode a row into a buffer first. */
#include "dq_blocks.h"

#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#define X86_KERNELS 1
#include <immintrin.h>
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

/* ---- Q8_0: each block's values (q * d, exactly the dequantized weights) go straight into the
 * 32 running sums, without a row buffer. The scales of a group of blocks are widened first, so
 * that the loop over the values holds no scalar work. ----------------------------------------------- */

#define Q8_GROUP 128 /* blocks whose scales are widened at once */

static inline void q8_scales(const uint8_t *s, size_t blocks, float *d)
{
    for (size_t k = 0; k < blocks; k++, s += 34)
        d[k] = dq_half_to_float((uint32_t)s[0] | ((uint32_t)s[1] << 8));
}

/* Add the values of `blocks` Q8_0 blocks at s, times x, into the running sums acc[0..31]. */
static void q8_accumulate_c(const uint8_t *restrict s, const float *restrict x, size_t blocks,
                            const float *restrict d, float acc[32])
{
    for (size_t k = 0; k < blocks; k++, s += 34, x += 32) {
        const int8_t *q = (const int8_t *)(s + 2);
        for (int i = 0; i < 32; i++)
            acc[i] += ((float)q[i] * d[k]) * x[i];
    }
}

#ifdef X86_KERNELS
__attribute__((target("avx2"))) static void q8_accumulate_avx2(const uint8_t *restrict s, const float *restrict x,
                                                               size_t blocks, const float *restrict d,
                                                               float acc[32])
{
    __m256 a[4];
    for (int p = 0; p < 4; p++)
        a[p] = _mm256_loadu_ps(acc + 8 * p);
    for (size_t k = 0; k < blocks; k++, s += 34, x += 32) {
        const __m256 dk = _mm256_broadcast_ss(d + k);
        for (int p = 0; p < 4; p++) { /* values 8p .. 8p+7 into sums 8p .. 8p+7 */
            __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + 2 + 8 * p)));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), dk);
            a[p] = _mm256_add_ps(a[p], _mm256_mul_ps(v, _mm256_loadu_ps(x + 8 * p)));
        }
    }
    for (int p = 0; p < 4; p++)
        _mm256_storeu_ps(acc + 8 * p, a[p]);
}
#endif

typedef void (*q8_accumulate_fn)(const uint8_t *, const float *, size_t, const float *, float *);

static void dots_q8_0(const uint8_t *w, const float *x, size_t n_in, size_t nx, float *out, size_t out_stride,
                      q8_accumulate_fn accumulate)
{
    const size_t blocks = n_in / 32;
    float d[Q8_GROUP];
    for (size_t j = 0; j < nx; j++) {
        float acc[32] = {0};
        for (size_t k = 0; k < blocks; k += Q8_GROUP) {
            size_t n = blocks - k < Q8_GROUP ? blocks - k : Q8_GROUP;
            q8_scales(w + 34 * k, n, d);
            accumulate(w + 34 * k, x + j * n_in + 32 * k, n, d, acc);
        }
        out[j * out_stride] = combine(acc);
    }
}

/* The AVX2 kernel where the CPU has it, unless SPECCONV_NATIVE_PORTABLE=1 asks for the plain one
 * (the tests compare the two: they must give the same bits). */
static q8_accumulate_fn q8_accumulate(void)
{
#ifdef X86_KERNELS
    if (__builtin_cpu_supports("avx2") && !dq_portable())
        return q8_accumulate_avx2;
#endif
    return q8_accumulate_c;
}

void dq_dot_rows(const dq_type *type, const uint8_t *w, size_t row_bytes, size_t first, size_t count,
                 size_t n_in, const float *x, size_t nx, float *out, size_t out_stride, float *row)
{
    if (type->ggml_type == 8) {
        const q8_accumulate_fn accumulate = q8_accumulate();
        for (size_t r = first; r < first + count; r++)
            dots_q8_0(w + r * row_bytes, x, n_in, nx, out + r, out_stride, accumulate);
        return;
    }
    const size_t blocks = n_in / (size_t)type->block;
    const dq_accumulate_fn accumulate = dq_accumulate_avx2(type->ggml_type);
    if (accumulate != NULL) { /* the same sums as decode + dots() below, without the row buffer */
        const size_t units = type->block == 1 ? n_in / 32 : blocks, done = type->block == 1 ? units * 32 : n_in;
        for (size_t r = first; r < first + count; r++) {
            const uint8_t *wr = w + r * row_bytes;
            if (done < n_in) /* a 16-bit float row's last n_in mod 32 values, added in order */
                type->decode(wr + done * (size_t)type->size, row, n_in - done);
            for (size_t j = 0; j < nx; j++) {
                const float *xj = x + j * n_in;
                float acc[32] = {0};
                accumulate(wr, xj, units, acc);
                float sum = combine(acc);
                for (size_t i = done; i < n_in; i++)
                    sum += row[i - done] * xj[i];
                out[j * out_stride + r] = sum;
            }
        }
        return;
    }
    for (size_t r = first; r < first + count; r++) {
        type->decode(w + r * row_bytes, row, blocks);
        dots(row, x, n_in, nx, out + r, out_stride);
    }
}
