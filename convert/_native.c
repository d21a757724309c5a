/* Q8_0 encoder for specconv's converter: the arithmetic of gguf.quants' Q8_0.quantize_blocks
 * (gguf 0.19.0) done in one pass per block of 32, with the GIL released so that several converter
 * threads encode at once.
 *
 * Bit-identity with gguf.quants rests on doing the same IEEE float32 operations in the same order:
 *   amax = max|x|, d = amax / 127, id = (d == 0) ? 0 : 1 / d, v = x * id,
 *   q = sign(v) * (floor(a) + floor(2 (a - floor(a)))) with a = |v|   (np_roundf),
 *   d stored as numpy's float32 -> float16 conversion (round to nearest even).
 * Build without fast-math and with -ffp-contract=off, so no product is fused or reordered.
 * Blocks whose result would depend on numpy's float -> int8 cast of inf/NaN (a non-finite input, or
 * a float32-subnormal d whose reciprocal overflows) are not encoded: the call returns False and the
 * caller asks gguf.quants instead. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#define QK 32
#define BLOCK_BYTES 34

/* float32 bits -> float16 bits, round to nearest even, exactly as numpy's astype(np.float16)
 * for every finite and infinite input (overflow -> inf, float16 subnormals rounded correctly).
 * NaN keeps its top mantissa bits and stays a NaN; the encoder never passes one. */
static uint16_t half_from_float_bits(uint32_t f)
{
    uint16_t sign = (uint16_t)((f >> 16) & 0x8000u);
    uint32_t mag = f & 0x7fffffffu;
    if (mag >= 0x7f800000u) { /* inf or NaN */
        if (mag == 0x7f800000u)
            return sign | 0x7c00u;
        uint16_t nan = (uint16_t)(0x7c00u | ((mag & 0x7fffffu) >> 13));
        return sign | (nan == 0x7c00u ? 0x7e00u : nan);
    }
    if (mag >= 0x477ff000u) /* >= 65520: rounds past 65504 to infinity */
        return sign | 0x7c00u;
    if (mag >= 0x38800000u) { /* normal float16: rebias the exponent 127 -> 15, round 13 bits away */
        uint32_t h = (mag - 0x38000000u) >> 13;
        uint32_t rest = mag & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
            h++; /* a carry into the exponent is the correct next binade */
        return sign | (uint16_t)h;
    }
    if (mag <= 0x33000000u) /* <= 2^-25: half the smallest subnormal, ties go to even (zero) */
        return sign;
    /* float16 subnormal: units of 2^-24; value = mant * 2^(e - 150) */
    uint32_t e = mag >> 23;
    uint32_t mant = (mag & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 .. 24 */
    uint32_t h = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u)))
        h++; /* may become 0x400, the smallest normal: correct */
    return sign | (uint16_t)h;
}

static inline float float_from_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t bits_from_float(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

#define GROUP 8 /* blocks whose scales are computed together: the divisions run as one vector */

/* Encode `n` <= GROUP blocks (GROUP * QK values in `bits`, those past n blocks zero); returns 0
 * when one of them must be left to gguf.quants. */
static inline int encode_group(const uint32_t bits[GROUP * QK], uint8_t *out, int n)
{
    /* For finite values the bit pattern of |x| orders like the value, so an integer max finds
     * amax and, at once, any inf/NaN (exponent all ones). */
    uint32_t amax_bits[GROUP];
    for (int b = 0; b < GROUP; b++) {
        uint32_t m = 0;
        for (int i = 0; i < QK; i++) {
            uint32_t x = bits[b * QK + i] & 0x7fffffffu;
            m = x > m ? x : m;
        }
        amax_bits[b] = m;
    }
    float d[GROUP], id[GROUP];
    for (int b = 0; b < GROUP; b++) {
        d[b] = float_from_bits(amax_bits[b]) / 127.0f;
        float r = 1.0f / (d[b] == 0.0f ? 1.0f : d[b]); /* no division by zero, so it vectorises */
        id[b] = d[b] == 0.0f ? 0.0f : r;
    }
    for (int b = 0; b < n; b++)
        if (amax_bits[b] >= 0x7f800000u || !isfinite(id[b]))
            return 0;
    for (int b = 0; b < n; b++) {
        uint8_t *o = out + (size_t)b * BLOCK_BYTES;
        uint16_t dh = half_from_float_bits(bits_from_float(d[b]));
        o[0] = (uint8_t)(dh & 0xffu);
        o[1] = (uint8_t)(dh >> 8);
        for (int i = 0; i < QK; i++) {
            float v = float_from_bits(bits[b * QK + i]) * id[b];
            float a = fabsf(v); /* |v| <= 127.00002 */
            /* np_roundf: floor(a) + floor(2 (a - floor(a))). For 0 <= a < 2^23, floor(a) is the
             * truncation (int)a, a - floor(a) is exact, and floor(2 f) for 0 <= f < 1 is (f >= 0.5);
             * written this way gcc vectorises it without a libm floorf call. */
            int fl = (int)a;
            int q = fl + ((a - (float)fl) >= 0.5f);
            o[2 + i] = (uint8_t)(int8_t)(v < 0.0f ? -q : q); /* -0.0 -> 0 */
        }
    }
    return 1;
}

/* Cloned for AVX2 where the compiler can (picked at load time, so the module still runs on any
 * x86-64): the same IEEE float32 operations, eight lanes at a time instead of four. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static int encode_all(const unsigned char *src, uint8_t *dst, Py_ssize_t blocks, int bf16)
{
    uint32_t bits[GROUP * QK];
    for (Py_ssize_t b = 0; b < blocks; b += GROUP) {
        int n = blocks - b < GROUP ? (int)(blocks - b) : GROUP;
        if (n < GROUP)
            memset(bits, 0, sizeof bits);
        if (bf16) {
            uint16_t h[GROUP * QK];
            memcpy(h, src + (size_t)b * QK * 2, (size_t)n * QK * 2); /* buffers need not be aligned */
            for (int i = 0; i < n * QK; i++)
                bits[i] = (uint32_t)h[i] << 16;
        } else {
            memcpy(bits, src + (size_t)b * QK * 4, (size_t)n * QK * 4);
        }
        if (!encode_group(bits, dst + (size_t)b * BLOCK_BYTES, n))
            return 0;
    }
    return 1;
}

static PyObject *q8_0(PyObject *self, PyObject *args)
{
    PyObject *src_obj, *dst_obj;
    int bf16;
    if (!PyArg_ParseTuple(args, "OOp:q8_0", &src_obj, &dst_obj, &bf16))
        return NULL;
    Py_buffer src, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t width = bf16 ? 2 : 4;
    PyObject *result = NULL;
    if (src.itemsize != width) {
        PyErr_Format(PyExc_ValueError, "q8_0: src items are %zd bytes, expected %zd (%s)",
                     src.itemsize, width, bf16 ? "bfloat16 bits as uint16" : "float32");
    } else if ((src.len / width) % QK != 0) {
        PyErr_Format(PyExc_ValueError, "q8_0: %zd elements is not a multiple of %d",
                     src.len / width, QK);
    } else if (dst.len != src.len / width / QK * BLOCK_BYTES) {
        PyErr_Format(PyExc_ValueError, "q8_0: dst holds %zd bytes, expected %zd",
                     dst.len, src.len / width / QK * BLOCK_BYTES);
    } else {
        int ok;
        Py_ssize_t blocks = src.len / width / QK;
        Py_BEGIN_ALLOW_THREADS
        ok = encode_all((const unsigned char *)src.buf, (uint8_t *)dst.buf, blocks, bf16);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(ok);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"q8_0", q8_0, METH_VARARGS,
     "q8_0(src, dst, bf16) -> bool\n\n"
     "Encode src (C-contiguous float32, or bfloat16 bits as uint16 when bf16 is true; a multiple\n"
     "of 32 elements) as GGML Q8_0 blocks into dst (writable, n/32*34 bytes), bit-identical to\n"
     "gguf.quants. Returns False, dst unspecified, when a block holds inf/NaN or its 1/d\n"
     "overflows; the caller then uses gguf.quants. Releases the GIL while encoding."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Native Q8_0 encoder for specconv's converter (optional; see specconv.convert.native).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
