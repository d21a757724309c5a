/* Block decoders of the native dequantizer: one function per GGUF type, written from the layouts
 * and formulas in runtime/dequant.py's docstring (the reference these must equal bit for bit).
 *
 * Every value is computed with the float32 operations of that formula, in its order:
 *   Q8_0 q * d            Q4_0 (q - 8) * d        Q5_0 (q - 16) * d     (integer shifts first)
 *   Q4_1/Q5_1 q * d + m   Q2_K/Q4_K/Q5_K q * (d * scale) - (dmin * min)
 *   Q3_K (q - 4) * (d * (scale - 32))             Q6_K (q - 32) * (d * scale)
 *   IQ4_NL table[q] * d   IQ4_XS table[q] * (d * (scale - 32))
 * (a product of two floats is the same whichever comes first; what matters is that nothing is
 * fused or regrouped: -ffp-contract=off, no fast-math). The small integer codes convert to float
 * exactly. The inner loops run over whole sub-blocks with constant shifts so that gcc vectorises
 * them; on x86-64 each decoder is also cloned for AVX2 and picked at load time. */
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

static inline float f16_at(const uint8_t *p)
{
    return dq_half_to_float((uint32_t)p[0] | ((uint32_t)p[1] << 8));
}

static const int8_t IQ4_TABLE[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113};

/* ---- emitting a run of values: the only float arithmetic --------------------------------------- */

/* o[i] = c[i] * s for `len` signed codes (len a multiple of 16: the loops vectorise). */
static inline void emit_signed(float *restrict o, const int8_t *restrict c, int len, float s)
{
    for (int i = 0; i < len; i++)
        o[i] = (float)c[i] * s;
}

/* o[i] = c[i] * s + m */
static inline void emit_plus(float *restrict o, const uint8_t *restrict c, int len, float s, float m)
{
    for (int i = 0; i < len; i++)
        o[i] = (float)c[i] * s + m;
}

/* o[i] = c[i] * s - m */
static inline void emit_minus(float *restrict o, const uint8_t *restrict c, int len, float s, float m)
{
    for (int i = 0; i < len; i++)
        o[i] = (float)c[i] * s - m;
}

/* c[i] = low nibbles of q[0..n), then c[n + i] = high nibbles, each minus `bias` */
static inline void nibbles(int8_t *restrict c, const uint8_t *restrict q, int n, int bias)
{
    for (int i = 0; i < n; i++)
        c[i] = (int8_t)((q[i] & 15) - bias);
    for (int i = 0; i < n; i++)
        c[n + i] = (int8_t)((q[i] >> 4) - bias);
}

/* c[i] |= 16 where bit i of the 32 bits in hb[0..3] is set (Q5 fifth bits, little-endian): the
 * word tested against one mask per value, which vectorises (a shift by i would not, without AVX2) */
static const uint32_t BIT_OF[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31,
};

static inline void fifth_bits(uint8_t *restrict c, const uint8_t *restrict hb)
{
    const uint32_t h = (uint32_t)hb[0] | ((uint32_t)hb[1] << 8) | ((uint32_t)hb[2] << 16) | ((uint32_t)hb[3] << 24);
    for (int i = 0; i < 32; i++)
        c[i] = (uint8_t)(c[i] | ((h & BIT_OF[i]) ? 16 : 0));
}

/* c[i] = table[nibble] for the 2n nibbles of q[0..n) (low nibbles first) */
static inline void iq4_codes(int8_t *restrict c, const uint8_t *restrict q, int n)
{
    for (int i = 0; i < n; i++) {
        c[i] = IQ4_TABLE[q[i] & 15];
        c[n + i] = IQ4_TABLE[q[i] >> 4];
    }
}

/* Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins. */
static inline void k_scales_mins(const uint8_t *p, uint8_t sc[8], uint8_t mn[8])
{
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[4 + j] & 63;
        sc[4 + j] = (uint8_t)((p[8 + j] & 15) | ((p[j] >> 2) & 48));
        mn[4 + j] = (uint8_t)((p[8 + j] >> 4) | ((p[4 + j] >> 2) & 48));
    }
}

/* Q4_K/Q5_K nibbles: sub-blocks 2k (low nibbles) and 2k+1 (high) come from qs[32k .. 32k+31] */
static inline void k_nibbles(uint8_t *restrict c, const uint8_t *restrict qs)
{
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 32; i++) {
            c[64 * k + i] = qs[32 * k + i] & 15;
            c[64 * k + 32 + i] = qs[32 * k + i] >> 4;
        }
}

/* ---- the decoders, once with the portable emitters above and once with AVX2 ones ---------------- */

#define UNUSED __attribute__((unused)) /* not every variant is in a table (see TABLE) */

#define DQ(name) dq_##name##_c
#define EMIT_SIGNED emit_signed
#define EMIT_PLUS emit_plus
#define EMIT_MINUS emit_minus
#define IQ4_CODES(c, q) iq4_codes(c, q, 16)
#include "dq_decoders.inc"
#undef DQ
#undef EMIT_SIGNED
#undef EMIT_PLUS
#undef EMIT_MINUS
#undef IQ4_CODES

#ifdef X86_KERNELS
#pragma GCC push_options
#pragma GCC target("avx2")

/* The same operations as emit_signed / emit_plus / emit_minus, eight values at a time: the codes
 * widened straight from memory (gcc's own vectorisation of those loops shuffles far more). */
static inline void emit_signed_avx2(float *restrict o, const int8_t *restrict c, int len, float s)
{
    const __m256 sv = _mm256_set1_ps(s);
    for (int i = 0; i < len; i += 8) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + i))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(v, sv));
    }
}

static inline void emit_plus_avx2(float *restrict o, const uint8_t *restrict c, int len, float s, float m)
{
    const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
    for (int i = 0; i < len; i += 8) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + i))));
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(v, sv), mv));
    }
}

static inline void emit_minus_avx2(float *restrict o, const uint8_t *restrict c, int len, float s, float m)
{
    const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
    for (int i = 0; i < len; i += 8) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + i))));
        _mm256_storeu_ps(o + i, _mm256_sub_ps(_mm256_mul_ps(v, sv), mv));
    }
}

/* iq4_codes(c, q, 16) with one byte shuffle per 16 nibbles: the table is exactly 16 bytes */
static inline void iq4_codes_avx2(int8_t *restrict c, const uint8_t *restrict q)
{
    const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_TABLE), low4 = _mm_set1_epi8(15);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    _mm_storeu_si128((__m128i *)c, _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4)));
    _mm_storeu_si128((__m128i *)(c + 16), _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
}

#define DQ(name) dq_##name##_avx2
#define EMIT_SIGNED emit_signed_avx2
#define EMIT_PLUS emit_plus_avx2
#define EMIT_MINUS emit_minus_avx2
#define IQ4_CODES iq4_codes_avx2
#include "dq_decoders.inc"
#undef DQ
#undef EMIT_SIGNED
#undef EMIT_PLUS
#undef EMIT_MINUS
#undef IQ4_CODES

#pragma GCC pop_options
#endif

/* ---- 16-bit floats ----------------------------------------------------------------------------- */

static void f16_scalar(const uint8_t *restrict s, float *restrict y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = f16_at(s + 2 * i);
}

#ifdef X86_KERNELS
/* vcvtph2ps: the exact conversion (subnormals widened, a NaN made quiet, as dq_half_to_float) */
__attribute__((target("avx2,f16c"))) static void f16_f16c(const uint8_t *restrict s, float *restrict y, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * i))));
    f16_scalar(s + 2 * i, y + i, n - i);
}

static void dq_f16(const uint8_t *restrict s, float *restrict y, size_t n)
{
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        f16_f16c(s, y, n);
    else
        f16_scalar(s, y, n);
}
#else
static void dq_f16(const uint8_t *restrict s, float *restrict y, size_t n)
{
    f16_scalar(s, y, n);
}
#endif

CLONES static void dq_bf16(const uint8_t *restrict s, float *restrict y, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, sizeof h); /* little-endian host (x86-64, aarch64) */
        uint32_t bits = (uint32_t)h << 16;
        memcpy(&y[i], &bits, sizeof bits);
    }
}

/* GGMLQuantizationType values (gguf 0.19.0). */
/* `v`: the variant of the types where the AVX2 one is faster; the legacy nibble types (Q4_0/1,
 * Q5_0/1) always take the plain decoders, which gcc compiles better for them (measured). */
#define TABLE(v)                                                                                         \
    {                                                                                                  \
        {1, 1, 2, dq_f16}, {30, 1, 2, dq_bf16}, {8, 32, 34, dq_q8_0_##v}, {2, 32, 18, dq_q4_0_c},         \
        {3, 32, 20, dq_q4_1_c}, {6, 32, 22, dq_q5_0_c}, {7, 32, 24, dq_q5_1_c},                           \
        {20, 32, 18, dq_iq4_nl_##v}, {10, 256, 84, dq_q2_k_##v}, {11, 256, 110, dq_q3_k_##v},             \
        {12, 256, 144, dq_q4_k_##v}, {13, 256, 176, dq_q5_k_##v}, {14, 256, 210, dq_q6_k_##v},            \
        {23, 256, 136, dq_iq4_xs_##v}, {-1, 0, 0, NULL},                                                  \
    }

const dq_type dq_types[] = TABLE(c);
#ifdef X86_KERNELS
static const dq_type dq_types_avx2[] = TABLE(avx2);
#endif

int dq_portable(void)
{
    const char *portable = getenv("SPECCONV_NATIVE_PORTABLE");
    return portable != NULL && strcmp(portable, "1") == 0;
}

const dq_type *dq_find(int ggml_type)
{
    const dq_type *table = dq_types;
#ifdef X86_KERNELS
    if (__builtin_cpu_supports("avx2") && !dq_portable())
        table = dq_types_avx2;
#endif
    for (const dq_type *t = table; t->decode; t++)
        if (t->ggml_type == ggml_type)
            return t;
    return NULL;
}
