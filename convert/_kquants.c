/* Native K-quant encoder for specconv's converter (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): bytes equal to
 * llama.cpp's quantize tool without an importance matrix, with the GIL released so that the
 * converter's worker threads encode chunks of a tensor at once. The block encoders are in
 * kq_blocks.h and kq_search.h (built for any CPU and for AVX2); this file is the Python entry point. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>

#include "kq_common.h"

typedef void (*block_fn)(const float *, uint8_t *);

static block_fn encoders[5]; /* Q2_K..Q6_K, for this CPU: set when the module loads */
static const char *isa_name = "generic";

static void choose_encoders(void)
{
    block_fn generic[5] = {kq_block_q2_k_generic, kq_block_q3_k_generic, kq_block_q4_k_generic,
                           kq_block_q5_k_generic, kq_block_q6_k_generic};
    memcpy(encoders, generic, sizeof encoders);
#ifdef KQ_HAVE_AVX2
    const char *off = getenv("SPECCONV_NO_AVX2"); /* tests run the generic build on AVX2 machines too */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && !(off && strcmp(off, "1") == 0)) {
        isa_name = "avx2";
        block_fn avx2[5] = {kq_block_q2_k_avx2, kq_block_q3_k_avx2, kq_block_q4_k_avx2, kq_block_q5_k_avx2,
                            kq_block_q6_k_avx2};
        memcpy(encoders, avx2, sizeof encoders);
    }
#endif
}

static int block_bytes(int type, block_fn *fn)
{
    static const int bytes[5] = {KQ_Q2_K_BYTES, KQ_Q3_K_BYTES, KQ_Q4_K_BYTES, KQ_Q5_K_BYTES, KQ_Q6_K_BYTES};
    if (type < KQ_Q2_K || type > KQ_Q6_K)
        return 0;
    *fn = encoders[type - KQ_Q2_K];
    return bytes[type - KQ_Q2_K];
}

/* Returns 0 at the first super-block holding an infinity or NaN (llama.cpp's quantize refuses
 * those tensors: its row validation fails), 1 when every block was written. */
static int encode_all(const unsigned char *src, uint8_t *dst, Py_ssize_t blocks, int bf16, block_fn fn,
                      int nbytes)
{
    float x[KQ_SUPER];
    for (Py_ssize_t b = 0; b < blocks; b++) {
        uint32_t all = 0;
        if (bf16) {
            const unsigned char *p = src + (size_t)b * KQ_SUPER * 2;
            for (int i = 0; i < KQ_SUPER; i++) {
                uint32_t bits = (uint32_t)(p[2 * i] | (p[2 * i + 1] << 8)) << 16;
                x[i] = kq_float(bits);
                all |= (bits & 0x7f800000u) == 0x7f800000u;
            }
        } else {
            memcpy(x, src + (size_t)b * KQ_SUPER * 4, sizeof x);
            for (int i = 0; i < KQ_SUPER; i++)
                all |= (kq_bits(x[i]) & 0x7f800000u) == 0x7f800000u;
        }
        if (all)
            return 0;
        fn(x, dst + (size_t)b * nbytes);
    }
    return 1;
}

static PyObject *encode(PyObject *self, PyObject *args)
{
    int type, bf16;
    PyObject *src_obj, *dst_obj;
    if (!PyArg_ParseTuple(args, "iOOp:encode", &type, &src_obj, &dst_obj, &bf16))
        return NULL;
    block_fn fn = NULL;
    int nbytes = block_bytes(type, &fn);
    if (!nbytes) {
        PyErr_Format(PyExc_ValueError, "encode: GGML type %d is not a K-quant this module encodes", type);
        return NULL;
    }
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
        PyErr_Format(PyExc_ValueError, "encode: src items are %zd bytes, expected %zd (%s)", src.itemsize, width,
                     bf16 ? "bfloat16 bits as uint16" : "float32");
    } else if ((src.len / width) % KQ_SUPER != 0) {
        PyErr_Format(PyExc_ValueError, "encode: %zd elements is not a multiple of %d", src.len / width, KQ_SUPER);
    } else if (dst.len != src.len / width / KQ_SUPER * nbytes) {
        PyErr_Format(PyExc_ValueError, "encode: dst holds %zd bytes, expected %zd", dst.len,
                     src.len / width / KQ_SUPER * nbytes);
    } else {
        int ok;
        Py_ssize_t blocks = src.len / width / KQ_SUPER;
        Py_BEGIN_ALLOW_THREADS
        ok = encode_all((const unsigned char *)src.buf, (uint8_t *)dst.buf, blocks, bf16, fn, nbytes);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(ok);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *isa(PyObject *self, PyObject *args)
{
    return PyUnicode_FromString(isa_name);
}

static PyMethodDef methods[] = {
    {"isa", isa, METH_NOARGS, "isa() -> str\n\nThe build of the encoders in use: 'avx2' or 'generic'."},
    {"encode", encode, METH_VARARGS,
     "encode(ggml_type, src, dst, bf16) -> bool\n\n"
     "Encode src (C-contiguous float32, or bfloat16 bits as uint16 when bf16 is true; a multiple of\n"
     "256 elements) as GGML type 10..14 (Q2_K..Q6_K) into dst (writable, exactly the encoded size),\n"
     "bytes equal to llama.cpp's quantize without an importance matrix. Returns False, dst\n"
     "unspecified, when a value is infinite or NaN. Releases the GIL while encoding."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kquants",
    "Native K-quant encoder for specconv's converter (optional; see specconv.convert.native).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kquants(void)
{
    choose_encoders();
    return PyModule_Create(&module);
}
