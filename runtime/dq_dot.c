/* Fused dequantize-and-multiply for decode and verification: out[j][r] = x_j . row r of a stored
 * matrix, for a few activation rows x_j (a decode step: 1; a speculative check of k drafts: k+1).
 *
 * The float32 matrix never exists; only the stored bytes stream from memory (a quarter or less of
 * the float32 matrix), once whatever the number of activation rows: each block is decoded once and
 * multiplied into every row's sums. Where the CPU has them, the vector kernels of
 * dq_dot_simd.inc do this in registers with FMA (AVX-512, else AVX2; Q8_0, Q4_K, Q5_K, Q6_K, BF16,
 * F16). Everywhere else (other types, no AVX2, SPECCONV_NATIVE_PORTABLE=1) a row is decoded by its
 * type's decoder (dq_blocks.c) into a buffer in cache and multiplied with each activation row here.
 * Q8_0 with AVX-512 VNNI also has a kernel with 8-bit activations (dq_dot_i8.inc, dq_i8 below).
 *
 * The sums are float32 sums in orders of their own (vector lanes, several running sums, FMA in the
 * vector kernels): every path equals x @ dense(W)^T within float32 summation noise, which
 * tests/runtime/test_dequant_native.py bounds for every type, width and row count; the paths do not
 * give the same bits as each other. */
#include "dq_blocks.h"

#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

size_t dq_values_decoded = 0;

static int env_set(const char *name)
{
    const char *value = getenv(name);
    return value != NULL && strcmp(value, "1") == 0;
}

dq_rows_fn dq_fused(int ggml_type)
{
    if (dq_portable())
        return NULL;
    dq_rows_fn fn = env_set("SPECCONV_NATIVE_NO_AVX512") ? NULL : dq_fused_avx512(ggml_type);
    return fn != NULL ? fn : dq_fused_avx2(ggml_type);
}

const dq_i8_kernel *dq_i8(int ggml_type)
{
    return dq_portable() || env_set("SPECCONV_NATIVE_NO_AVX512") ? NULL : dq_i8_avx512(ggml_type);
}

int dq_fused_width(int ggml_type)
{
    dq_rows_fn fn = dq_fused(ggml_type);
    return fn == NULL ? 0 : fn == dq_fused_avx512(ggml_type) ? 512 : 256;
}

/* out[j * out_stride] = w . x_j for j < nx (x_j at x + j * n_in), w already dequantized: 32
 * running sums (plain C; gcc vectorises them), then the last n_in mod 32 products in order */
CLONES static void dots(const float *restrict w, const float *restrict x, size_t n_in, size_t nx,
                        float *restrict out, size_t out_stride)
{
    const size_t whole = n_in - n_in % 32;
    for (size_t j = 0; j < nx; j++) {
        const float *xj = x + j * n_in;
        float acc[32] = {0};
        for (size_t i = 0; i < whole; i += 32)
            for (int l = 0; l < 32; l++)
                acc[l] += w[i + l] * xj[i + l];
        for (int width = 16; width >= 1; width /= 2)
            for (int l = 0; l < width; l++)
                acc[l] += acc[l + width];
        float sum = acc[0];
        for (size_t i = whole; i < n_in; i++)
            sum += w[i] * xj[i];
        out[j * out_stride] = sum;
    }
}

void dq_dot_rows(const dq_type *type, const uint8_t *w, size_t row_bytes, size_t first, size_t count,
                 size_t n_in, const float *x, size_t nx, float *out, size_t out_stride, float *row)
{
    const dq_rows_fn fused = dq_fused(type->ggml_type);
    if (fused != NULL) {
        fused(w, row_bytes, first, count, n_in, x, nx, out, out_stride);
        return;
    }
    const size_t blocks = n_in / (size_t)type->block;
    for (size_t r = first; r < first + count; r++) {
        type->decode(w + r * row_bytes, row, blocks);
        dots(row, x, n_in, nx, out + r, out_stride);
    }
    __atomic_fetch_add(&dq_values_decoded, count * n_in, __ATOMIC_RELAXED);
}
