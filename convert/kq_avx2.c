/* The K-quant block encoders compiled with AVX2 (see kq_common.h); empty where GCC cannot target it. */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC target("avx2")
#define KQ_NAME(f) f##_avx2
#include "kq_blocks.h"
#else
typedef int kq_avx2_unused; /* ISO C: a translation unit must declare something */
#endif
