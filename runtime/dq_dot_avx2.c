/* AVX2 fused kernels for Q8_0, the hot K-quant types, BF16 and F16 (see dq_dot.c): the values of a row are
 * computed in registers with exactly the float32 operations of dq_blocks.c's decoders, and added
 * into the same 32 running sums (sum l takes the values i = l mod 32 of the row) as dq_dot.c's
 * dots() adds a decoded row into. So each kernel gives the same bits as decode-then-dots, which is
 * what runs where AVX2 is missing or SPECCONV_NATIVE_PORTABLE=1 (the tests compare the two).
 *
 * Each kernel: acc[0..31] += row values (blocks of them) times x, one 8-lane register per sums
 * 8p .. 8p+7; a K-quant sub-block of 32 values starts at a multiple of 32, so its value j goes to
 * sum j; Q6_K's sub-blocks of 16 are halves of such a run. */
#include "dq_blocks.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256i bytes8(const uint8_t *p) /* 8 bytes widened to 8 int32 */
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Every kernel takes one or two activation vectors (nv, a constant in each specialisation: the
 * values computed once serve both) and their running sums a[k][p] (sums 8p .. 8p+7 of vector k). */
#define INLINE __attribute__((always_inline)) inline

AVX2 static INLINE void load_acc(__m256 a[2][4], float acc[2][32], const int nv)
{
    for (int k = 0; k < nv; k++)
        for (int p = 0; p < 4; p++)
            a[k][p] = _mm256_loadu_ps(acc[k] + 8 * p);
}

AVX2 static INLINE void store_acc(__m256 a[2][4], float acc[2][32], const int nv)
{
    for (int k = 0; k < nv; k++)
        for (int p = 0; p < 4; p++)
            _mm256_storeu_ps(acc[k] + 8 * p, a[k][p]);
}

/* sums 8p .. 8p+7 of each vector += v times the vector's values at `at` */
AVX2 static INLINE void add_times(__m256 a[2][4], int p, __m256 v, const float *x, size_t xs, size_t at, const int nv)
{
    a[0][p] = _mm256_add_ps(a[0][p], _mm256_mul_ps(v, _mm256_loadu_ps(x + at)));
    if (nv == 2)
        a[1][p] = _mm256_add_ps(a[1][p], _mm256_mul_ps(v, _mm256_loadu_ps(x + xs + at)));
}

/* the exported kernel `name`: its body specialised for one and for two vectors */
#define KERNEL(name, isa)                                                                              \
    __attribute__((target(isa))) static void name##_kernel(const uint8_t *s, const float *x, size_t xs, int nvec, \
                                                           size_t units, float acc[2][32])             \
    {                                                                                                  \
        if (nvec == 2)                                                                                 \
            name##_body(s, x, xs, units, acc, 2);                                                      \
        else                                                                                           \
            name##_body(s, x, xs, units, acc, 1);                                                      \
    }

static inline float half_at(const uint8_t *p)
{
    return dq_half_to_float((uint32_t)p[0] | ((uint32_t)p[1] << 8));
}

/* Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (as dq_blocks.c) */
static inline void scales_mins(const uint8_t *p, uint8_t sc[8], uint8_t mn[8])
{
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[4 + j] & 63;
        sc[4 + j] = (uint8_t)((p[8 + j] & 15) | ((p[j] >> 2) & 48));
        mn[4 + j] = (uint8_t)((p[8 + j] >> 4) | ((p[4 + j] >> 2) & 48));
    }
}

/* Q8_0: value = q * d; the scales of a group of blocks are widened first, so that the loop over the
 * values holds no scalar work */
AVX2 static INLINE void q8_0_body(const uint8_t *s, const float *x, size_t xs, size_t blocks, float acc[2][32],
                                  const int nv)
{
    enum { GROUP = 128 };
    __m256 a[2][4];
    load_acc(a, acc, nv);
    float d[GROUP];
    for (size_t k0 = 0; k0 < blocks; k0 += GROUP) {
        const size_t n = blocks - k0 < GROUP ? blocks - k0 : GROUP;
        for (size_t k = 0; k < n; k++)
            d[k] = half_at(s + 34 * (k0 + k));
        const uint8_t *b = s + 34 * k0;
        const float *xb = x + 32 * k0;
        for (size_t k = 0; k < n; k++, b += 34, xb += 32) {
            const __m256 dk = _mm256_broadcast_ss(d + k);
            for (int p = 0; p < 4; p++) {
                __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * p)));
                add_times(a, p, _mm256_mul_ps(_mm256_cvtepi32_ps(q), dk), xb, xs, 8 * p, nv);
            }
        }
    }
    store_acc(a, acc, nv);
}
KERNEL(q8_0, "avx2")

/* Q4_K: the nibbles of a block split into one byte per value first (as the decoder does), then
 * widened eight at a time */
AVX2 static INLINE void q4_k_body(const uint8_t *s, const float *x, size_t xs, size_t blocks, float acc[2][32],
                                  const int nv)
{
    __m256 a[2][4];
    load_acc(a, acc, nv);
    uint8_t c[256];
    for (size_t b = 0; b < blocks; b++, s += 144, x += 256) {
        const float d = half_at(s), dmin = half_at(s + 2);
        uint8_t sc[8], mn[8];
        scales_mins(s + 4, sc, mn);
        const uint8_t *qs = s + 16;
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 32; i++) {
                c[64 * k + i] = qs[32 * k + i] & 15;
                c[64 * k + 32 + i] = qs[32 * k + i] >> 4;
            }
        for (int t = 0; t < 8; t++) {
            const __m256 st = _mm256_set1_ps(d * (float)sc[t]), mt = _mm256_set1_ps(dmin * (float)mn[t]);
            for (int p = 0; p < 4; p++) {
                __m256 v = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(bytes8(c + 32 * t + 8 * p)), st), mt);
                add_times(a, p, v, x, xs, 32 * t + 8 * p, nv);
            }
        }
    }
    store_acc(a, acc, nv);
}
KERNEL(q4_k, "avx2")

/* Q5_K: the codes of a block put together first with byte operations (as the decoder does), then
 * widened eight at a time */
AVX2 static INLINE void q5_k_body(const uint8_t *s, const float *x, size_t xs, size_t blocks, float acc[2][32],
                                  const int nv)
{
    __m256 a[2][4];
    load_acc(a, acc, nv);
    uint8_t c[256];
    for (size_t b = 0; b < blocks; b++, s += 176, x += 256) {
        const float d = half_at(s), dmin = half_at(s + 2);
        uint8_t sc[8], mn[8];
        scales_mins(s + 4, sc, mn);
        const uint8_t *qh = s + 16, *qs = s + 48;
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 32; i++) {
                c[64 * k + i] = (uint8_t)((qs[32 * k + i] & 15) | (((qh[i] >> (2 * k)) & 1) << 4));
                c[64 * k + 32 + i] = (uint8_t)((qs[32 * k + i] >> 4) | (((qh[i] >> (2 * k + 1)) & 1) << 4));
            }
        for (int t = 0; t < 8; t++) {
            const __m256 st = _mm256_set1_ps(d * (float)sc[t]), mt = _mm256_set1_ps(dmin * (float)mn[t]);
            for (int p = 0; p < 4; p++) {
                __m256 v = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(bytes8(c + 32 * t + 8 * p)), st), mt);
                add_times(a, p, v, x, xs, 32 * t + 8 * p, nv);
            }
        }
    }
    store_acc(a, acc, nv);
}
KERNEL(q5_k, "avx2")

/* Q6_K: value h*128 + j*32 + i = (q - 32) * (d * sc[h*8 + 2j + i/16]) with q = nibble j/2 of
 * ql[h*64 + (j%2)*32 + i] | (bits 2j of qh[h*32 + i]) << 4. The codes q - 32 of a block are put
 * together first with byte operations (as the decoder does), then widened eight at a time. */
AVX2 static INLINE void q6_k_body(const uint8_t *s, const float *x, size_t xs, size_t blocks, float acc[2][32],
                                  const int nv)
{
    __m256 a[2][4];
    load_acc(a, acc, nv);
    int8_t c[256];
    for (size_t b = 0; b < blocks; b++, s += 210, x += 256) {
        const uint8_t *ql = s, *qh = s + 128;
        const int8_t *sc = (const int8_t *)(s + 192);
        const float d = half_at(s + 208);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 32; i++)
                    c[h * 128 + j * 32 + i] = (int8_t)((((ql[h * 64 + (j % 2) * 32 + i] >> ((j / 2) * 4)) & 15)
                                                        | (((qh[h * 32 + i] >> (2 * j)) & 3) << 4)) - 32);
        for (int t = 0; t < 16; t++) { /* sub-block t: values 16t .. 16t+15, sums 16(t%2) .. */
            const __m256 st = _mm256_set1_ps(d * (float)sc[t]);
            for (int p = 0; p < 2; p++) {
                __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 16 * t + 8 * p)));
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), st);
                add_times(a, (t % 2) * 2 + p, v, x, xs, 16 * t + 8 * p, nv);
            }
        }
    }
    store_acc(a, acc, nv);
}
KERNEL(q6_k, "avx2")

/* BF16: whole runs of 32 values (the caller adds the remaining n mod 32 in order) */
AVX2 static INLINE void bf16_body(const uint8_t *s, const float *x, size_t xs, size_t runs, float acc[2][32],
                                  const int nv)
{
    __m256 a[2][4];
    load_acc(a, acc, nv);
    for (size_t r = 0; r < runs; r++, s += 64, x += 32)
        for (int p = 0; p < 4; p++) {
            __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 16 * p))), 16);
            add_times(a, p, _mm256_castsi256_ps(w), x, xs, 8 * p, nv);
        }
    store_acc(a, acc, nv);
}
KERNEL(bf16, "avx2")

/* F16: whole runs of 32 values, widened by vcvtph2ps (exact, as the decoder's conversion) */
__attribute__((target("avx2,f16c"))) static INLINE void f16_body(const uint8_t *s, const float *x, size_t xs,
                                                                 size_t runs, float acc[2][32], const int nv)
{
    __m256 a[2][4];
    load_acc(a, acc, nv);
    for (size_t r = 0; r < runs; r++, s += 64, x += 32)
        for (int p = 0; p < 4; p++)
            add_times(a, p, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16 * p))), x, xs, 8 * p, nv);
    store_acc(a, acc, nv);
}
KERNEL(f16, "avx2,f16c")

dq_accumulate_fn dq_accumulate_avx2(int ggml_type)
{
    if (!__builtin_cpu_supports("avx2") || dq_portable())
        return NULL;
    if (ggml_type == 1)
        return __builtin_cpu_supports("f16c") ? f16_kernel : NULL;
    switch (ggml_type) {
    case 8: return q8_0_kernel;
    case 12: return q4_k_kernel;
    case 13: return q5_k_kernel;
    case 14: return q6_k_kernel;
    case 30: return bf16_kernel;
    default: return NULL;
    }
}

#else

dq_accumulate_fn dq_accumulate_avx2(int ggml_type)
{
    (void)ggml_type;
    return NULL;
}

#endif
