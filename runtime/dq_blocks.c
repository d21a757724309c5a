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

#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
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
    for (int i = 0; i < n; i++) {
        c[i] = (int8_t)((q[i] & 15) - bias);
        c[n + i] = (int8_t)((q[i] >> 4) - bias);
    }
}

/* c[i] |= 16 where bit i of the 32 bits in hb[0..3] is set (Q5 fifth bits, little-endian) */
static inline void fifth_bits(uint8_t *restrict c, const uint8_t *restrict hb)
{
    for (int i = 0; i < 32; i++)
        c[i] = (uint8_t)(c[i] | (((hb[i >> 3] >> (i & 7)) & 1) << 4));
}

/* ---- 32-value blocks --------------------------------------------------------------------------- */

CLONES static void dq_q8_0(const uint8_t *restrict s, float *restrict y, size_t n)
{
    for (size_t b = 0; b < n; b++, s += 34, y += 32)
        emit_signed(y, (const int8_t *)(s + 2), 32, f16_at(s));
}

CLONES static void dq_q4_0(const uint8_t *restrict s, float *restrict y, size_t n)
{
    int8_t c[32];
    for (size_t b = 0; b < n; b++, s += 18, y += 32) {
        nibbles(c, s + 2, 16, 8);
        emit_signed(y, c, 32, f16_at(s));
    }
}

CLONES static void dq_q4_1(const uint8_t *restrict s, float *restrict y, size_t n)
{
    int8_t c[32];
    for (size_t b = 0; b < n; b++, s += 20, y += 32) {
        nibbles(c, s + 4, 16, 0);
        emit_plus(y, (const uint8_t *)c, 32, f16_at(s), f16_at(s + 2));
    }
}

CLONES static void dq_q5_0(const uint8_t *restrict s, float *restrict y, size_t n)
{
    int8_t c[32];
    for (size_t b = 0; b < n; b++, s += 22, y += 32) {
        nibbles(c, s + 6, 16, 0);
        fifth_bits((uint8_t *)c, s + 2);
        for (int i = 0; i < 32; i++)
            c[i] = (int8_t)(c[i] - 16);
        emit_signed(y, c, 32, f16_at(s));
    }
}

CLONES static void dq_q5_1(const uint8_t *restrict s, float *restrict y, size_t n)
{
    int8_t c[32];
    for (size_t b = 0; b < n; b++, s += 24, y += 32) {
        nibbles(c, s + 8, 16, 0);
        fifth_bits((uint8_t *)c, s + 4);
        emit_plus(y, (const uint8_t *)c, 32, f16_at(s), f16_at(s + 2));
    }
}

/* c[i] = table[nibble] for the 2n nibbles of q[0..n) (low nibbles first) */
static inline void iq4_codes(int8_t *restrict c, const uint8_t *restrict q, int n)
{
    for (int i = 0; i < n; i++) {
        c[i] = IQ4_TABLE[q[i] & 15];
        c[n + i] = IQ4_TABLE[q[i] >> 4];
    }
}

CLONES static void dq_iq4_nl(const uint8_t *restrict s, float *restrict y, size_t n)
{
    int8_t c[32];
    for (size_t b = 0; b < n; b++, s += 18, y += 32) {
        iq4_codes(c, s + 2, 16);
        emit_signed(y, c, 32, f16_at(s));
    }
}

/* ---- 256-value K-quant blocks ------------------------------------------------------------------ */

CLONES static void dq_q2_k(const uint8_t *restrict s, float *restrict y, size_t n)
{
    uint8_t c[256];
    for (size_t b = 0; b < n; b++, s += 84, y += 256) {
        const float d = f16_at(s + 80), dmin = f16_at(s + 82);
        const uint8_t *qs = s + 16;
        for (int h = 0; h < 2; h++)         /* value h*128 + j*32 + i: bits 2j of qs[h*32 + i] */
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 32; i++)
                    c[h * 128 + j * 32 + i] = (qs[h * 32 + i] >> (2 * j)) & 3;
        for (int t = 0; t < 16; t++)        /* 16 sub-blocks of 16 */
            emit_minus(y + 16 * t, c + 16 * t, 16, d * (float)(s[t] & 15), dmin * (float)(s[t] >> 4));
    }
}

CLONES static void dq_q3_k(const uint8_t *restrict s, float *restrict y, size_t n)
{
    int8_t c[256];
    for (size_t b = 0; b < n; b++, s += 110, y += 256) {
        const uint8_t *hm = s, *qs = s + 32, *sc = s + 96;
        const float d = f16_at(s + 108);
        for (int h = 0; h < 2; h++)   /* value k = h*128 + j*32 + i; its high bit: bit k/32 of hm[i] */
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 32; i++)
                    c[h * 128 + j * 32 + i] = (int8_t)((((qs[h * 32 + i] >> (2 * j)) & 3)
                                                        | (((hm[i] >> (h * 4 + j)) & 1) << 2)) - 4);
        for (int t = 0; t < 16; t++) {
            int low = t < 8 ? (sc[t] & 15) : (sc[t - 8] >> 4);
            int high = (sc[8 + t % 4] >> (2 * (t / 4))) & 3;
            emit_signed(y + 16 * t, c + 16 * t, 16, d * (float)((low | (high << 4)) - 32));
        }
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

/* Q4_K/Q5_K values from their codes: sub-block t (32 values) is c[32t..] * (d * sc[t]) - (dmin * mn[t]) */
static inline void k_emit(float *restrict y, const uint8_t *restrict c, const uint8_t *p, float d, float dmin)
{
    uint8_t sc[8], mn[8];
    k_scales_mins(p, sc, mn);
    for (int t = 0; t < 8; t++)
        emit_minus(y + 32 * t, c + 32 * t, 32, d * (float)sc[t], dmin * (float)mn[t]);
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

CLONES static void dq_q4_k(const uint8_t *restrict s, float *restrict y, size_t n)
{
    uint8_t c[256];
    for (size_t b = 0; b < n; b++, s += 144, y += 256) {
        k_nibbles(c, s + 16);
        k_emit(y, c, s + 4, f16_at(s), f16_at(s + 2));
    }
}

CLONES static void dq_q5_k(const uint8_t *restrict s, float *restrict y, size_t n)
{
    uint8_t c[256];
    for (size_t b = 0; b < n; b++, s += 176, y += 256) {
        const uint8_t *qh = s + 16;
        k_nibbles(c, s + 48);
        for (int t = 0; t < 8; t++)   /* sub-block t's fifth bits: bit t of qh[0..31] */
            for (int i = 0; i < 32; i++)
                c[32 * t + i] = (uint8_t)(c[32 * t + i] | (((qh[i] >> t) & 1) << 4));
        k_emit(y, c, s + 4, f16_at(s), f16_at(s + 2));
    }
}

CLONES static void dq_q6_k(const uint8_t *restrict s, float *restrict y, size_t n)
{
    int8_t c[256];
    for (size_t b = 0; b < n; b++, s += 210, y += 256) {
        const uint8_t *ql = s, *qh = s + 128;
        const int8_t *sc = (const int8_t *)(s + 192);
        const float d = f16_at(s + 208);
        /* value h*128 + j*32 + i: nibble j/2 of ql[h*64 + (j%2)*32 + i], bits 2j of qh[h*32 + i] */
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 32; i++)
                    c[h * 128 + j * 32 + i] = (int8_t)((((ql[h * 64 + (j % 2) * 32 + i] >> ((j / 2) * 4)) & 15)
                                                        | (((qh[h * 32 + i] >> (2 * j)) & 3) << 4)) - 32);
        for (int t = 0; t < 16; t++)
            emit_signed(y + 16 * t, c + 16 * t, 16, d * (float)sc[t]);
    }
}

CLONES static void dq_iq4_xs(const uint8_t *restrict s, float *restrict y, size_t n)
{
    int8_t c[256];
    for (size_t b = 0; b < n; b++, s += 136, y += 256) {
        const float d = f16_at(s);
        const uint32_t sh = (uint32_t)s[2] | ((uint32_t)s[3] << 8);
        const uint8_t *sl = s + 4;
        for (int t = 0; t < 8; t++)
            iq4_codes(c + 32 * t, s + 8 + 16 * t, 16);
        for (int t = 0; t < 8; t++) {
            int ls = ((sl[t / 2] >> (4 * (t % 2))) & 15) | (int)(((sh >> (2 * t)) & 3u) << 4);
            emit_signed(y + 32 * t, c + 32 * t, 32, d * (float)(ls - 32));
        }
    }
}

/* ---- 16-bit floats ----------------------------------------------------------------------------- */

static void f16_scalar(const uint8_t *restrict s, float *restrict y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = f16_at(s + 2 * i);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#include <immintrin.h>
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
const dq_type dq_types[] = {
    {1, 1, 2, dq_f16},     {30, 1, 2, dq_bf16},
    {8, 32, 34, dq_q8_0},  {2, 32, 18, dq_q4_0},   {3, 32, 20, dq_q4_1},
    {6, 32, 22, dq_q5_0},  {7, 32, 24, dq_q5_1},   {20, 32, 18, dq_iq4_nl},
    {10, 256, 84, dq_q2_k}, {11, 256, 110, dq_q3_k}, {12, 256, 144, dq_q4_k},
    {13, 256, 176, dq_q5_k}, {14, 256, 210, dq_q6_k}, {23, 256, 136, dq_iq4_xs},
    {-1, 0, 0, NULL},
};

const dq_type *dq_find(int ggml_type)
{
    for (const dq_type *t = dq_types; t->decode; t++)
        if (t->ggml_type == ggml_type)
            return t;
    return NULL;
}
