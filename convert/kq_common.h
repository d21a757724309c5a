/* Shared pieces of specconv's K-quant encoder (convert/_kquants.c, kq_search.c, kq_blocks.c).
 *
 * Every function here is plain IEEE float32 arithmetic in a fixed order: the module is built with
 * -ffp-contract=off and without fast-math, so no product is fused and no sum is reordered, and the
 * bytes equal llama.cpp's reference quantizer (ggml-quants.c, the path its quantize tool takes
 * without an importance matrix) on the same float32 values. */
#ifndef SPECCONV_KQ_COMMON_H
#define SPECCONV_KQ_COMMON_H

#include <stdint.h>
#include <string.h>

#define KQ_SUPER 256 /* elements per super-block (QK_K) */

/* Bytes of one super-block of each type, by GGML type id. */
#define KQ_Q2_K 10
#define KQ_Q3_K 11
#define KQ_Q4_K 12
#define KQ_Q5_K 13
#define KQ_Q6_K 14
#define KQ_Q2_K_BYTES 84
#define KQ_Q3_K_BYTES 110
#define KQ_Q4_K_BYTES 144
#define KQ_Q5_K_BYTES 176
#define KQ_Q6_K_BYTES 210

static inline uint32_t kq_bits(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float kq_float(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* Round to the nearest integer, ties to even, by adding 1.5 * 2^23 so that the integer lands in
 * the low mantissa bits. This is the rounding ggml's quantizers use; for |v| >= 2^22 it wraps the
 * same way theirs does, so even out-of-range values give the same bytes. */
static inline int kq_round(float v)
{
    uint32_t b = kq_bits(v + 12582912.0f);
    return (int)(b & 0x007fffffu) - 0x00400000;
}

/* float32 -> float16 bits, round to nearest even (finite inputs; overflow gives infinity). */
static inline uint16_t kq_half(float value)
{
    uint32_t f = kq_bits(value);
    uint16_t sign = (uint16_t)((f >> 16) & 0x8000u);
    uint32_t mag = f & 0x7fffffffu;
    if (mag >= 0x477ff000u) /* >= 65520 (or inf): rounds past 65504 */
        return sign | 0x7c00u;
    if (mag >= 0x38800000u) { /* normal half: rebias 127 -> 15, drop 13 bits with rounding */
        uint32_t h = (mag - 0x38000000u) >> 13;
        uint32_t rest = mag & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
            h++;
        return sign | (uint16_t)h;
    }
    if (mag <= 0x33000000u) /* at most half the smallest subnormal: zero (ties to even) */
        return sign;
    uint32_t e = mag >> 23;
    uint32_t mant = (mag & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;
    uint32_t h = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u)))
        h++;
    return sign | (uint16_t)h;
}

/* float16 bits -> float32, exact. */
static inline float kq_unhalf(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu)
        return kq_float(sign | 0x7f800000u | (mant << 13));
    if (exp != 0)
        return kq_float(sign | ((exp + 112u) << 23) | (mant << 13));
    /* subnormal (or zero): mant * 2^-24, exact in float32 */
    float v = (float)mant * 5.9604644775390625e-08f;
    return kq_float(sign | kq_bits(v));
}

static inline void kq_put_half(uint8_t *p, uint16_t h)
{
    p[0] = (uint8_t)(h & 0xffu);
    p[1] = (uint8_t)(h >> 8);
}

static inline uint16_t kq_get_half(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

/* The searches (kq_search.h) take KQ_LANES groups at once: xt[i * KQ_LANES + g] is value i of
 * group g (n <= 32 values per group), levels come back in the same layout. */
#define KQ_LANES 8

/* One super-block of 256 values -> its bytes (kq_blocks.h). The encoders are compiled twice, from
 * the same source: kq_generic.c for any CPU and kq_avx2.c with AVX2 enabled (8 lanes per vector
 * instruction), chosen when the module loads. Both are the same IEEE operations lane by lane. */
#define KQ_BLOCK_DECLS(suffix)                               \
    void kq_block_q2_k##suffix(const float *x, uint8_t *out); \
    void kq_block_q3_k##suffix(const float *x, uint8_t *out); \
    void kq_block_q4_k##suffix(const float *x, uint8_t *out); \
    void kq_block_q5_k##suffix(const float *x, uint8_t *out); \
    void kq_block_q6_k##suffix(const float *x, uint8_t *out); \
    void kq_wblock_q2_k##suffix(const float *x, const float *qw, uint8_t *out); \
    void kq_wblock_q3_k##suffix(const float *x, const float *qw, uint8_t *out); \
    void kq_wblock_q4_k##suffix(const float *x, const float *qw, uint8_t *out); \
    void kq_wblock_q5_k##suffix(const float *x, const float *qw, uint8_t *out); \
    void kq_wblock_q6_k##suffix(const float *x, const float *qw, uint8_t *out);
KQ_BLOCK_DECLS(_generic)
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define KQ_HAVE_AVX2 1
KQ_BLOCK_DECLS(_avx2)
#endif

#endif
