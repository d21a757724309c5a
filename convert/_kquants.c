/* Native K-quant encoder for specconv's converter (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): bytes equal to
 * llama.cpp's quantize tool without an importance matrix, with the GIL released so that the
 * converter's worker threads encode chunks of a tensor at once. The block encoders are in
 * kq_blocks.h and kq_search.h (built for any CPU and for AVX2); the importance-weighted encoders
 * (llama.cpp's quantize with --imatrix) in kq_weighted.h; this file is the Python entry point. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>

#include "kq_common.h"
#include "kq_weighted.h"

typedef void (*block_fn)(const float *, uint8_t *);
typedef void (*wblock_fn)(const float *, const float *, uint8_t *);

static block_fn encoders[5]; /* Q2_K..Q6_K, for this CPU: set when the module loads */
static wblock_fn wencoders[5]; /* the importance-weighted ones */
static const char *isa_name = "generic";

static void choose_encoders(void)
{
    block_fn generic[5] = {kq_block_q2_k_generic, kq_block_q3_k_generic, kq_block_q4_k_generic,
                           kq_block_q5_k_generic, kq_block_q6_k_generic};
    memcpy(encoders, generic, sizeof encoders);
    wblock_fn wgeneric[5] = {kq_wblock_q2_k_generic, kq_wblock_q3_k_generic, kq_wblock_q4_k_generic,
                             kq_wblock_q5_k_generic, kq_wblock_q6_k_generic};
    memcpy(wencoders, wgeneric, sizeof wencoders);
#ifdef KQ_HAVE_AVX2
    const char *off = getenv("SPECCONV_NO_AVX2"); /* tests run the generic build on AVX2 machines too */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && !(off && strcmp(off, "1") == 0)) {
        isa_name = "avx2";
        block_fn avx2[5] = {kq_block_q2_k_avx2, kq_block_q3_k_avx2, kq_block_q4_k_avx2, kq_block_q5_k_avx2,
                            kq_block_q6_k_avx2};
        memcpy(encoders, avx2, sizeof encoders);
        wblock_fn wavx2[5] = {kq_wblock_q2_k_avx2, kq_wblock_q3_k_avx2, kq_wblock_q4_k_avx2, kq_wblock_q5_k_avx2,
                              kq_wblock_q6_k_avx2};
        memcpy(wencoders, wavx2, sizeof wencoders);
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

/* encode_weighted: whole rows, each weighted by its group's slice of `weights` (an importance
 * matrix: one slice of n_per_row values per expert, rows_per_group rows each). */
static int encode_rows(const unsigned char *src, uint8_t *dst, Py_ssize_t nrows, Py_ssize_t n_per_row, int bf16,
                       int type, const float *weights, Py_ssize_t rows_per_group, Py_ssize_t first_row,
                       float *x)
{
    int block = 0, bytes = kw_layout(type, &block);
    size_t row_bytes = (size_t)(n_per_row / block) * bytes;
    for (Py_ssize_t r = 0; r < nrows; r++) {
        uint32_t all = 0;
        if (bf16) {
            const unsigned char *p = src + (size_t)r * n_per_row * 2;
            for (Py_ssize_t i = 0; i < n_per_row; i++) {
                uint32_t bits = (uint32_t)(p[2 * i] | (p[2 * i + 1] << 8)) << 16;
                x[i] = kq_float(bits);
                all |= (bits & 0x7f800000u) == 0x7f800000u;
            }
        } else {
            memcpy(x, src + (size_t)r * n_per_row * 4, (size_t)n_per_row * 4);
            for (Py_ssize_t i = 0; i < n_per_row; i++)
                all |= (kq_bits(x[i]) & 0x7f800000u) == 0x7f800000u;
        }
        if (all)
            return 0;
        const float *qw = weights ? weights + (size_t)((first_row + r) / rows_per_group) * n_per_row : NULL;
        kw_row(type, x, qw, n_per_row, dst + (size_t)r * row_bytes,
               type >= KQ_Q2_K && type <= KQ_Q6_K ? wencoders[type - KQ_Q2_K] : NULL);
    }
    return 1;
}

static PyObject *encode_weighted(PyObject *self, PyObject *args)
{
    int type, bf16;
    Py_ssize_t n_per_row, rows_per_group, first_row;
    PyObject *src_obj, *dst_obj, *w_obj;
    if (!PyArg_ParseTuple(args, "iOOpnOnn:encode_weighted", &type, &src_obj, &dst_obj, &bf16, &n_per_row, &w_obj,
                          &rows_per_group, &first_row))
        return NULL;
    int block = 0, bytes = kw_layout(type, &block);
    if (!bytes) {
        PyErr_Format(PyExc_ValueError, "encode_weighted: GGML type %d has no weighted encoder here", type);
        return NULL;
    }
    if (n_per_row <= 0 || n_per_row % block || rows_per_group <= 0 || first_row < 0) {
        PyErr_Format(PyExc_ValueError, "encode_weighted: row length %zd (blocks of %d), %zd rows per group, first "
                     "row %zd", n_per_row, block, rows_per_group, first_row);
        return NULL;
    }
    Py_buffer src, dst, w;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    int unweighted = w_obj == Py_None; /* IQ4_NL / IQ4_XS without an imatrix */
    if (unweighted && type != KW_IQ4_NL && type != KW_IQ4_XS) {
        PyErr_Format(PyExc_ValueError, "encode_weighted: GGML type %d needs weights here", type);
        unweighted = -1;
    }
    if (unweighted < 0 || (!unweighted && PyObject_GetBuffer(w_obj, &w, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    if (unweighted) {
        memset(&w, 0, sizeof w);
        w.itemsize = 4;
        w.len = PY_SSIZE_T_MAX / 2;
    }
    Py_ssize_t width = bf16 ? 2 : 4, n = src.len / width, nrows = n / n_per_row;
    PyObject *result = NULL;
    if (src.itemsize != width || w.itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "encode_weighted: src items are %zd bytes (expected %zd), weights %zd (expected "
                     "4: float32)", src.itemsize, width, w.itemsize);
    } else if (n % n_per_row) {
        PyErr_Format(PyExc_ValueError, "encode_weighted: %zd elements is not whole rows of %zd", n, n_per_row);
    } else if (dst.len != nrows * (n_per_row / block) * bytes) {
        PyErr_Format(PyExc_ValueError, "encode_weighted: dst holds %zd bytes, expected %zd", dst.len,
                     nrows * (n_per_row / block) * bytes);
    } else if (nrows && w.len / 4 < ((first_row + nrows - 1) / rows_per_group + 1) * n_per_row) {
        PyErr_Format(PyExc_ValueError, "encode_weighted: %zd weights do not cover rows %zd..%zd (%zd per group of %zd rows)",
                     w.len / 4, first_row, first_row + nrows - 1, n_per_row, rows_per_group);
    } else {
        float *x = PyMem_RawMalloc((size_t)n_per_row * sizeof(float));
        if (!x) {
            PyErr_NoMemory();
        } else {
            int ok;
            Py_BEGIN_ALLOW_THREADS
            ok = encode_rows((const unsigned char *)src.buf, (uint8_t *)dst.buf, nrows, n_per_row, bf16, type,
                             unweighted ? NULL : (const float *)w.buf, rows_per_group, first_row, x);
            Py_END_ALLOW_THREADS
            PyMem_RawFree(x);
            result = PyBool_FromLong(ok);
        }
    }
    if (!unweighted)
        PyBuffer_Release(&w);
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
    {"encode_weighted", encode_weighted, METH_VARARGS,
     "encode_weighted(ggml_type, src, dst, bf16, n_per_row, weights, rows_per_group, first_row) -> bool\n\n"
     "Encode whole rows of src (float32, or bfloat16 bits as uint16) as GGML type 2, 3, 6, 7 (Q4_0, Q4_1,\n"
     "Q5_0, Q5_1), 10..14 (Q2_K..Q6_K), 20 or 23 (IQ4_NL, IQ4_XS) with importance weights, bytes equal\n"
     "to llama.cpp's quantize with --imatrix: row r (of the tensor: first_row + r) uses\n"
     "weights[g * n_per_row:(g + 1) * n_per_row], g = (first_row + r) // rows_per_group (one slice per\n"
     "expert); weights None (IQ4 types only): the tool's bytes without an imatrix. Returns False, dst unspecified,\n"
     "when a value is infinite or NaN. Releases the GIL while encoding."},
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
