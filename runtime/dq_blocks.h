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

/* A fused kernel (dq_dot_simd.inc): the same contract as dq_dot_rows (without scratch space), the
 * values computed in vector registers, each weight block decoded once for all nx rows. */
typedef void (*dq_rows_fn)(const uint8_t *w, size_t row_bytes, size_t first, size_t count, size_t n_in,
                           const float *x, size_t nx, float *out, size_t out_stride);
/* The kernel for `ggml_type` at one vector width (dq_dot_avx512.c, dq_dot_avx2.c), or NULL where
 * the type has none or the CPU lacks the instructions. */
dq_rows_fn dq_fused_avx512(int ggml_type);
dq_rows_fn dq_fused_avx2(int ggml_type);
/* The kernel dq_dot_rows uses now: AVX-512, else AVX2 (also under SPECCONV_NATIVE_NO_AVX512=1),
 * else NULL (also under SPECCONV_NATIVE_PORTABLE=1: the plain-C decode-then-multiply). */
dq_rows_fn dq_fused(int ggml_type);
/* Values the fused products have decoded since the module was loaded (all threads): a check that
 * several activation rows share one decoding of each block. */
extern size_t dq_values_decoded;
/* 512 for the AVX-512 kernels, 256 for AVX2, 0 for the plain C path (what dq_fused would pick). */
int dq_fused_width(int ggml_type);

/* Products with 8-bit activations (dq_dot_i8.inc): each activation row quantized to 8-bit blocks
 * (`quantize`, into `row_bytes(n_in)` bytes), then `rows` with the contract of dq_rows_fn but
 * quantized rows xq (row j at xq + j * row_bytes(n_in)) in place of x. */
typedef struct {
    int width; /* vector bits */
    size_t (*row_bytes)(size_t n_in);
    void (*quantize)(const float *x, size_t n_in, uint8_t *xq);
    void (*rows)(const uint8_t *w, size_t row_bytes, size_t first, size_t count, size_t n_in, const uint8_t *xq,
                 size_t nx, float *out, size_t out_stride);
} dq_i8_kernel;
/* The kernel for `ggml_type` with AVX-512 VNNI, or NULL (other types, CPU without them). */
const dq_i8_kernel *dq_i8_avx512(int ggml_type);
/* The one dq_dot.c offers now: NULL also under SPECCONV_NATIVE_PORTABLE=1 or
 * SPECCONV_NATIVE_NO_AVX512=1. */
const dq_i8_kernel *dq_i8(int ggml_type);

#endif
