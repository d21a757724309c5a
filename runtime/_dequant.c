/* Native CPU dequantizer for specconv's runtime: GGUF blocks -> float32, bit-identical to
 * runtime/dequant.py (and gguf.quants), with the GIL released and the blocks of one call split
 * over a few threads. The per-type decoders are in dq_blocks.c.
 *
 * Python sees one function, `dequantize(ggml_type, src, nbytes, dst, threads)`, taking raw
 * addresses (torch's data_ptr()): runtime/dequant_native.py checks the tensors (CPU, contiguous,
 * sizes) before it calls, so this module trusts them. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>

#include "dq_blocks.h"

#define MAX_THREADS 64

typedef struct {
    const dq_type *type;
    const uint8_t *src;
    float *dst;
    size_t first, count; /* blocks */
} job;

static void run_job(const job *j)
{
    j->type->decode(j->src + j->first * (size_t)j->type->size, j->dst + j->first * (size_t)j->type->block,
                    j->count);
}

static void *thread_main(void *arg)
{
    run_job((const job *)arg);
    return NULL;
}

/* Decode `blocks` blocks on up to `threads` threads (the caller's thread takes the first share). */
static void decode_parallel(const dq_type *type, const uint8_t *src, float *dst, size_t blocks, int threads)
{
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if ((size_t)threads > blocks)
        threads = blocks ? (int)blocks : 1;
    job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    size_t share = blocks / (size_t)threads, extra = blocks % (size_t)threads, first = 0;
    for (int t = 0; t < threads; t++) {
        size_t count = share + ((size_t)t < extra);
        jobs[t] = (job){type, src, dst, first, count};
        first += count;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, thread_main, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_job(&jobs[t]); /* could not start a thread: do its share here */
    }
}

static PyObject *dequantize(PyObject *self, PyObject *args)
{
    int ggml_type, threads;
    unsigned long long src_addr, dst_addr;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "iKnKi:dequantize", &ggml_type, &src_addr, &nbytes, &dst_addr, &threads))
        return NULL;
    const dq_type *type = dq_find(ggml_type);
    if (type == NULL)
        return PyErr_Format(PyExc_ValueError, "dequantize: GGML type %d is not covered", ggml_type);
    if (nbytes < 0 || nbytes % type->size)
        return PyErr_Format(PyExc_ValueError, "dequantize: %zd bytes is not a whole number of %d-byte blocks",
                            nbytes, type->size);
    size_t blocks = (size_t)nbytes / (size_t)type->size;
    if (blocks && (!src_addr || !dst_addr))
        return PyErr_Format(PyExc_ValueError, "dequantize: null buffer address");
    Py_BEGIN_ALLOW_THREADS
    decode_parallel(type, (const uint8_t *)(uintptr_t)src_addr, (float *)(uintptr_t)dst_addr, blocks, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *types(PyObject *self, PyObject *unused)
{
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    for (const dq_type *t = dq_types; t->decode; t++) {
        PyObject *key = PyLong_FromLong(t->ggml_type), *value = Py_BuildValue("(ii)", t->block, t->size);
        if (key == NULL || value == NULL || PyDict_SetItem(out, key, value) < 0) {
            Py_XDECREF(key);
            Py_XDECREF(value);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(ggml_type, src, nbytes, dst, threads) -> None\n\n"
     "Decode the `nbytes` bytes of GGUF blocks at address `src` into float32 values at address `dst`\n"
     "(nbytes / block size * values per block of them), bit-identical to specconv.runtime.dequant,\n"
     "on up to `threads` threads, with the GIL released. The caller guarantees the addresses."},
    {"types", types, METH_NOARGS, "types() -> {ggml_type: (values per block, bytes per block)} covered"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_dequant",
    "Native GGUF dequantizer for specconv's runtime (optional; see specconv.runtime.dequant_native).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__dequant(void)
{
    return PyModule_Create(&module);
}
