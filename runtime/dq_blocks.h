/* Block decoders of the native dequantizer (runtime/_dequant.c): GGUF blocks -> float32.
 *
 * Each decoder turns `n` consecutive blocks at `src` into n * block values at `dst`, with the
 * float32 operations, in the order, that runtime/dequant.py documents (and gguf.quants performs),
 * so the results are bit-identical. Built with -ffp-contract=off: a product followed by a sum
 * or difference is never fused. */
#ifndef SPECCONV_DQ_BLOCKS_H
#define SPECCONV_DQ_BLOCKS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*dq_fn)(const uint8_t *src, float *dst, size_t n);

typedef struct {
    int ggml_type;   /* GGMLQuantizationType value */
    int block;       /* values per block */
    int size;        /* bytes per block */
    dq_fn decode;
} dq_type;

/* Whether SPECCONV_NATIVE_PORTABLE=1 asks for the plain C kernels even where AVX2 ones exist
 * (the tests check that both give the same bits). */
int dq_portable(void);

/* The covered type `ggml_type` (its AVX2 decoder where the CPU has AVX2), or NULL. */
const dq_type *dq_find(int ggml_type);

/* IEEE half bits -> float32, exactly (subnormals included); a NaN comes out quiet. */
static inline float dq_half_to_float(uint32_t h)
{
    uint32_t sign = (h & 0x8000u) << 16, em = h & 0x7fffu, bits;
    if (em >= 0x7c00u) {
        bits = (em << 13) | 0x7f800000u | (em > 0x7c00u ? 0x400000u : 0u);
    } else if (em >= 0x400u) {
        bits = (em << 13) + 0x38000000u; /* rebias the exponent 15 -> 127 */
    } else {
        float sub = (float)em * 0x1p-24f; /* em units of 2^-24: exact, and a normal float32 */
        memcpy(&bits, &sub, sizeof bits);
    }
    bits |= sign;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}


/* Every covered type (plain C decoders), terminated by an entry whose decode is NULL. */
extern const dq_type dq_types[];

/* Fused product (dq_dot.c): for rows first .. first+count-1 of a matrix stored as `type` (row r at
 * w + r * row_bytes, n_in values), out[j * out_stride + r] = row r . x_j for the nx activation
 * vectors x_j = x + j * n_in. `row` is scratch space for n_in floats. */
void dq_dot_rows(const dq_type *type, const uint8_t *w, size_t row_bytes, size_t first, size_t count,
                 size_t n_in, const float *x, size_t nx, float *out, size_t out_stride, float *row);

/* AVX2 fused kernels (dq_dot_avx2.c): acc[k][l] += value i * x_k[i] for the values i = l mod 32 of
 * `units` blocks at s (16-bit floats: runs of 32 values) and the nvec (1 or 2) vectors x_k = x +
 * k * x_stride, the values computed as the decoder computes them; NULL where the type has none,
 * the CPU lacks AVX2 or SPECCONV_NATIVE_PORTABLE=1. */
typedef void (*dq_accumulate_fn)(const uint8_t *s, const float *x, size_t x_stride, int nvec, size_t units,
                                 float acc[2][32]);
dq_accumulate_fn dq_accumulate_avx2(int ggml_type);

#endif
