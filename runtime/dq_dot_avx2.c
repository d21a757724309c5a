/* The fused kernels of dq_dot_simd.inc at 8 lanes (AVX2 + FMA + F16C), for CPUs without AVX-512
 * and under SPECCONV_NATIVE_NO_AVX512=1 (so that the tests reach them on any AVX2 machine). */
#include "dq_blocks.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#include <immintrin.h>

#define LANES 8
#define ISA "avx2,fma,f16c"
#define ENTRY dq_fused_avx2_table
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define CVTPH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define S8_TO_F(q) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128((long long)(q))))
#define U8X16_TO_F(q, h) \
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((h) ? _mm_unpackhi_epi64((__m128i)(q), (__m128i)(q)) : (__m128i)(q)))
#define BF16_AT(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define HSUM(v) hsum8(v)
#define SET1(s) _mm256_set1_ps(s)
#define HALF_SPLAT(bits) _mm256_cvtph_ps(_mm_set1_epi16((short)(bits)))

__attribute__((target(ISA))) static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#include "dq_dot_simd.inc"

dq_rows_fn dq_fused_avx2(int ggml_type)
{
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return NULL;
    return dq_fused_avx2_table(ggml_type);
}

#else

dq_rows_fn dq_fused_avx2(int ggml_type)
{
    (void)ggml_type;
    return NULL;
}

#endif
