/* The fused kernels of dq_dot_simd.inc at 16 lanes (AVX-512 F/BW/VL + FMA + F16C): where the CPU
 * has them, the first choice (dq_dot.c's dq_fused); and the 8-bit-activation Q8_0 kernel of
 * dq_dot_i8.inc (AVX-512 VNNI). */
#include "dq_blocks.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#include <immintrin.h>

#define LANES 16
#define ISA "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define ENTRY dq_fused_avx512_table
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define CVTPH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define S8_TO_F(q) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)(q)))
#define U8X16_TO_F(q, h) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)(q)))
#define BF16_AT(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define HSUM(v) _mm512_reduce_add_ps(v)
#define SET1(s) _mm512_set1_ps(s)
#define HALF_SPLAT(bits) _mm512_cvtph_ps(_mm256_set1_epi16((short)(bits)))

#include "dq_dot_simd.inc"
#include "dq_dot_i8.inc"

dq_rows_fn dq_fused_avx512(int ggml_type)
{
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")
        || !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq")
        || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return NULL;
    return dq_fused_avx512_table(ggml_type);
}

#else

dq_rows_fn dq_fused_avx512(int ggml_type)
{
    (void)ggml_type;
    return NULL;
}

const dq_i8_kernel *dq_i8_avx512(int ggml_type)
{
    (void)ggml_type;
    return NULL;
}

#endif
