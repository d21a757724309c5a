/* Native CPU dequantizer for specconv's runtime: GGUF blocks -> float32, bit-identical to
 * runtime/dequant.py (and gguf.quants), with the GIL released and the blocks of one call split
 * over a few threads. The per-type decoders are in dq_blocks.c.
 *
 * Threads: torch's own OpenMP pool where it is there. torch's ATen parallel backend is OpenMP
 * (libgomp bundled with torch), whose entry points are in the process's global namespace once
 * torch is imported; a split runs as a parallel region on those threads (GOMP_parallel, libgomp's
 * stable ABI), which are already awake after each torch operation: microseconds, where starting
 * a pthread per call cost tens, and no fight with torch's spinning threads for the cores. Where
 * the symbols are absent (another OpenMP runtime, torch not imported) or
 * SPECCONV_NATIVE_PTHREADS=1, or in a child made by fork() (libgomp's pool does not survive it), a
 * thread is started per share as before.
 *
 * Python sees `dequantize(ggml_type, src, nbytes, dst, threads)`, the fused product for decode
 * `dot(...)` (dq_dot.c), its 8-bit-activation form `dot_i8(...)` (dq_dot_i8.inc) and the Gated
 * DeltaNet step over a few tokens `gdn_conv(...)`, `gdn(...)` (gdn_step.c: it shares this
 * module's thread split), taking raw addresses (torch's data_ptr()):
 * runtime/dequant_native.py and runtime/gdn_native.py check the tensors (CPU, contiguous, dtypes,
 * sizes) before they call, so this module trusts them. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dq_blocks.h"
#include "gdn_step.h"

#define MAX_THREADS 64

/* Work split in units (blocks, rows): run(ctx, first, count) on up to `threads` threads, the
 * caller's thread taking the first share. */
typedef void (*work_fn)(const void *ctx, size_t first, size_t count);

typedef struct {
    work_fn run;
    const void *ctx;
    size_t first, count;
} job;

static void *thread_main(void *arg)
{
    const job *j = (const job *)arg;
    j->run(j->ctx, j->first, j->count);
    return NULL;
}

static void run_pthreads(work_fn run, const void *ctx, size_t units, int threads)
{
    job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    size_t share = units / (size_t)threads, extra = units % (size_t)threads, first = 0;
    for (int t = 0; t < threads; t++) {
        size_t count = share + ((size_t)t < extra);
        jobs[t] = (job){run, ctx, first, count};
        first += count;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, thread_main, &jobs[t]) == 0;
    jobs[0].run(ctx, jobs[0].first, jobs[0].count);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            jobs[t].run(ctx, jobs[t].first, jobs[t].count); /* no thread: do its share here */
    }
}

/* libgomp's entry points, looked up once in what the process has loaded (torch's libgomp) */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
typedef int (*omp_int_fn)(void);
static struct {
    pthread_once_t once;
    gomp_parallel_fn parallel;
    omp_int_fn thread_num, num_threads;
    volatile int forked; /* in a child made by fork(): libgomp's pool did not come along */
} omp = {PTHREAD_ONCE_INIT, NULL, NULL, NULL, 0};

/* libgomp is not fork-safe: a parallel region in a forked child waits forever for the parent's
 * pool threads, so a child splits over started pthreads instead */
static void omp_after_fork(void)
{
    omp.forked = 1;
}

static void omp_resolve(void)
{
    gomp_parallel_fn parallel = (gomp_parallel_fn)dlsym(RTLD_DEFAULT, "GOMP_parallel");
    omp_int_fn thread_num = (omp_int_fn)dlsym(RTLD_DEFAULT, "omp_get_thread_num");
    omp_int_fn num_threads = (omp_int_fn)dlsym(RTLD_DEFAULT, "omp_get_num_threads");
    if (parallel && thread_num && num_threads) {
        omp.parallel = parallel;
        omp.thread_num = thread_num;
        omp.num_threads = num_threads;
    }
}

/* the OpenMP pool, unless absent or SPECCONV_NATIVE_PTHREADS=1 */
static int omp_usable(void)
{
    pthread_once(&omp.once, omp_resolve);
    const char *force = getenv("SPECCONV_NATIVE_PTHREADS");
    return omp.parallel != NULL && !omp.forked && !(force != NULL && strcmp(force, "1") == 0);
}

typedef struct {
    work_fn run;
    const void *ctx;
    size_t units;
} omp_job;

/* one thread of the team: its share of the units (the team may be smaller than asked) */
static void omp_main(void *arg)
{
    const omp_job *j = (const omp_job *)arg;
    size_t t = (size_t)omp.thread_num(), n = (size_t)omp.num_threads();
    size_t share = j->units / n, extra = j->units % n;
    size_t first = t * share + (t < extra ? t : extra), count = share + (t < extra);
    if (count)
        j->run(j->ctx, first, count);
}

static void run_parallel(work_fn run, const void *ctx, size_t units, int threads)
{
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if ((size_t)threads > units)
        threads = units ? (int)units : 1;
    if (threads == 1) {
        run(ctx, 0, units);
    } else if (omp_usable()) {
        omp_job j = {run, ctx, units};
        omp.parallel(omp_main, &j, (unsigned)threads, 0);
    } else {
        run_pthreads(run, ctx, units, threads);
    }
}

/* run_parallel with the GIL released: what every entry point below does with its work */
static void run_released(work_fn run, const void *ctx, size_t units, int threads)
{
    Py_BEGIN_ALLOW_THREADS
    run_parallel(run, ctx, units, threads);
    Py_END_ALLOW_THREADS
}

/* ---- dequantize -------------------------------------------------------------------------------- */

typedef struct {
    const dq_type *type;
    const uint8_t *src;
    float *dst;
} decode_ctx;

static void decode_work(const void *arg, size_t first, size_t count)
{
    const decode_ctx *c = (const decode_ctx *)arg;
    c->type->decode(c->src + first * (size_t)c->type->size, c->dst + first * (size_t)c->type->block, count);
}

static PyObject *dequantize(PyObject *self, PyObject *args)
{
    (void)self;
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
    decode_ctx ctx = {type, (const uint8_t *)(uintptr_t)src_addr, (float *)(uintptr_t)dst_addr};
    run_released(decode_work, &ctx, blocks, threads);
    Py_RETURN_NONE;
}

/* ---- fused product ----------------------------------------------------------------------------- */

typedef struct {
    const dq_type *type;
    const uint8_t *w;
    size_t row_bytes, n_in, nx, out_stride;
    const float *x;
    float *out;
    int failed; /* a thread could not get its row buffer */
} dot_ctx;

static void dot_work(const void *arg, size_t first, size_t count)
{
    dot_ctx *c = (dot_ctx *)arg;
    if (dq_fused(c->type->ggml_type) != NULL) { /* the vector kernels need no row buffer */
        dq_dot_rows(c->type, c->w, c->row_bytes, first, count, c->n_in, c->x, c->nx, c->out, c->out_stride, NULL);
        return;
    }
    float *row = malloc(c->n_in * sizeof(float) + 64);
    if (row == NULL) {
        c->failed = 1;
        return;
    }
    dq_dot_rows(c->type, c->w, c->row_bytes, first, count, c->n_in, c->x, c->nx, c->out, c->out_stride, row);
    free(row);
}

static PyObject *dot(PyObject *self, PyObject *args)
{
    (void)self;
    int ggml_type, threads;
    unsigned long long w_addr, x_addr, out_addr;
    Py_ssize_t rows, n_in, nx, out_stride;
    if (!PyArg_ParseTuple(args, "iKnnKnKni:dot", &ggml_type, &w_addr, &rows, &n_in, &x_addr, &nx, &out_addr,
                          &out_stride, &threads))
        return NULL;
    const dq_type *type = dq_find(ggml_type);
    if (type == NULL)
        return PyErr_Format(PyExc_ValueError, "dot: GGML type %d is not covered", ggml_type);
    if (rows < 0 || nx < 0 || n_in <= 0 || n_in % type->block || out_stride < rows)
        return PyErr_Format(PyExc_ValueError, "dot: bad shape (rows %zd, n_in %zd, nx %zd, out stride %zd)",
                            rows, n_in, nx, out_stride);
    if (rows && nx && (!w_addr || !x_addr || !out_addr))
        return PyErr_Format(PyExc_ValueError, "dot: null buffer address");
    dot_ctx ctx = {type, (const uint8_t *)(uintptr_t)w_addr, (size_t)(n_in / type->block * type->size),
                   (size_t)n_in, (size_t)nx, (size_t)out_stride, (const float *)(uintptr_t)x_addr,
                   (float *)(uintptr_t)out_addr, 0};
    if (rows && nx)
        run_released(dot_work, &ctx, (size_t)rows, threads);
    if (ctx.failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---- product with 8-bit activations ------------------------------------------------------------ */

typedef struct {
    const dq_i8_kernel *kernel;
    const uint8_t *w, *xq;
    size_t row_bytes, n_in, nx, out_stride;
    float *out;
} i8_ctx;

static void i8_work(const void *arg, size_t first, size_t count)
{
    const i8_ctx *c = (const i8_ctx *)arg;
    c->kernel->rows(c->w, c->row_bytes, first, count, c->n_in, c->xq, c->nx, c->out, c->out_stride);
}

static PyObject *dot_i8(PyObject *self, PyObject *args)
{
    (void)self;
    int ggml_type, threads;
    unsigned long long w_addr, x_addr, out_addr;
    Py_ssize_t rows, n_in, nx, out_stride;
    if (!PyArg_ParseTuple(args, "iKnnKnKni:dot_i8", &ggml_type, &w_addr, &rows, &n_in, &x_addr, &nx, &out_addr,
                          &out_stride, &threads))
        return NULL;
    const dq_type *type = dq_find(ggml_type);
    const dq_i8_kernel *kernel = dq_i8(ggml_type);
    if (type == NULL || kernel == NULL)
        return PyErr_Format(PyExc_ValueError, "dot_i8: no 8-bit-activation kernel for GGML type %d here", ggml_type);
    if (rows < 0 || nx < 0 || n_in <= 0 || n_in % type->block || out_stride < rows)
        return PyErr_Format(PyExc_ValueError, "dot_i8: bad shape (rows %zd, n_in %zd, nx %zd, out stride %zd)",
                            rows, n_in, nx, out_stride);
    if (rows && nx && (!w_addr || !x_addr || !out_addr))
        return PyErr_Format(PyExc_ValueError, "dot_i8: null buffer address");
    if (!rows || !nx)
        Py_RETURN_NONE;
    const size_t xstride = kernel->row_bytes((size_t)n_in);
    uint8_t *xq = malloc((size_t)nx * xstride);
    if (xq == NULL)
        return PyErr_NoMemory();
    i8_ctx ctx = {kernel, (const uint8_t *)(uintptr_t)w_addr, xq, (size_t)(n_in / type->block * type->size),
                  (size_t)n_in, (size_t)nx, (size_t)out_stride, (float *)(uintptr_t)out_addr};
    const float *x = (const float *)(uintptr_t)x_addr;
    Py_BEGIN_ALLOW_THREADS
    for (size_t j = 0; j < (size_t)nx; j++) /* once, before the split: every thread reads them all */
        kernel->quantize(x + j * (size_t)n_in, (size_t)n_in, xq + j * xstride);
    run_parallel(i8_work, &ctx, (size_t)rows, threads);
    Py_END_ALLOW_THREADS
    free(xq);
    Py_RETURN_NONE;
}

static PyObject *i8(PyObject *self, PyObject *args)
{
    (void)self;
    int ggml_type;
    if (!PyArg_ParseTuple(args, "i:i8", &ggml_type))
        return NULL;
    const dq_i8_kernel *kernel = dq_i8(ggml_type);
    return PyLong_FromLong(kernel == NULL ? 0 : kernel->width);
}

/* ---- gated delta rule ------------------------------------------------------------------------- */

static PyObject *gdn(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long src, dst, q, k, v, g, beta, o, delta;
    Py_ssize_t n, nv, dk, dv;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKnnnni:gdn", &src, &dst, &q, &k, &v, &g, &beta, &o, &delta, &n, &nv, &dk,
                          &dv, &threads))
        return NULL;
    if (n < 0 || nv < 0 || dk < 0 || dv < 0)
        return PyErr_Format(PyExc_ValueError, "gdn: bad shape (n %zd, heads %zd, dk %zd, dv %zd)", n, nv, dk, dv);
    if (n && nv && dk && dv && !(src && dst && q && k && v && g && beta && o && delta))
        return PyErr_Format(PyExc_ValueError, "gdn: null buffer address");
    gdn_args a = {(const float *)(uintptr_t)src, (float *)(uintptr_t)dst, (const float *)(uintptr_t)q,
                  (const float *)(uintptr_t)k, (const float *)(uintptr_t)v, (const float *)(uintptr_t)g,
                  (const float *)(uintptr_t)beta, (float *)(uintptr_t)o, (float *)(uintptr_t)delta,
                  (size_t)n, (size_t)nv, (size_t)dk, (size_t)dv};
    if (n && nv && dk && dv)
        run_released(gdn_heads, &a, (size_t)nv, threads);
    Py_RETURN_NONE;
}

static PyObject *gdn_conv(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long state, m, w, out, states;
    Py_ssize_t n, channels, kernel, first, keep;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKKKnnnnni:gdn_conv", &state, &m, &w, &out, &states, &n, &channels, &kernel,
                          &first, &keep, &threads))
        return NULL;
    if (n < 0 || channels < 0 || kernel < 1 || first < 0 || keep < 0 || first + keep > n)
        return PyErr_Format(PyExc_ValueError, "gdn_conv: bad shape (n %zd, channels %zd, kernel %zd, first %zd, keep %zd)",
                            n, channels, kernel, first, keep);
    if (n && channels && !(m && w && out && (state || kernel == 1) && (states || !keep)))
        return PyErr_Format(PyExc_ValueError, "gdn_conv: null buffer address");
    gdn_conv_args a = {(const float *)(uintptr_t)state, (const float *)(uintptr_t)m, (const float *)(uintptr_t)w,
                       (float *)(uintptr_t)out, (float *)(uintptr_t)states, (size_t)n, (size_t)channels,
                       (size_t)kernel, (size_t)first, (size_t)keep};
    if (n && channels)
        run_released(gdn_conv_channels, &a, (size_t)channels, threads);
    Py_RETURN_NONE;
}

static PyObject *fused(PyObject *self, PyObject *args)
{
    (void)self;
    int ggml_type;
    if (!PyArg_ParseTuple(args, "i:fused", &ggml_type))
        return NULL;
    return PyLong_FromLong(dq_fused_width(ggml_type)); /* dq_dot.c */
}

static PyObject *decoded(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromSize_t(__atomic_load_n(&dq_values_decoded, __ATOMIC_RELAXED));
}

static PyObject *pool(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyUnicode_FromString(omp_usable() ? "openmp" : "pthreads");
}

/* "1" in the environment (as the Python side's os.environ sets it: putenv) */
static int switch_on(const char *name)
{
    const char *value = getenv(name);
    return value != NULL && strcmp(value, "1") == 0;
}

static PyObject *switches(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(switch_on("SPECCONV_NO_NATIVE") | switch_on("SPECCONV_NO_NATIVE_DEQUANT") << 1
                           | switch_on("SPECCONV_NATIVE_FLOAT_ACTIVATIONS") << 2 | switch_on("SPECCONV_NO_NATIVE_GDN") << 3);
}

static PyObject *types(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
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
    {"dot", dot, METH_VARARGS,
     "dot(ggml_type, w, rows, n_in, x, nx, out, out_stride, threads) -> None\n\n"
     "out[j * out_stride + r] = (row r of the `rows` x `n_in` matrix stored as ggml_type at address w)\n"
     ". (x_j, the float32 vector at x + j * n_in) for j < nx: each row dequantized exactly as\n"
     "dequantize() gives, each block once for all the vectors; float32 sums of their own order\n"
     "(x @ dense(W)^T within summation noise). Rows split over up to `threads`\n"
     "threads, GIL released. The caller guarantees the addresses."},
    {"dot_i8", dot_i8, METH_VARARGS,
     "dot_i8(ggml_type, w, rows, n_in, x, nx, out, out_stride, threads) -> None\n\n"
     "dot() with each x_j first quantized to 8-bit blocks of 32 (d = max|x|/127) and integer dot\n"
     "products per block (dq_dot_i8.inc: the error bound there); each output's operations do not\n"
     "depend on nx, the thread split or the neighbouring rows. ValueError where i8() is 0."},
    {"i8", i8, METH_VARARGS,
     "i8(ggml_type) -> int\n\nThe vector width in bits of dot_i8()'s kernel for this type on this CPU and setting,\n"
     "0 where there is none."},
    {"gdn", gdn, METH_VARARGS,
     "gdn(src, dst, q, k, v, g, beta, o, delta, n, nv, dk, dv, threads) -> None\n\n"
     "The gated delta rule over n tokens for nv heads (float32 addresses; gdn_step.c): the state\n"
     "[nv, dk, dv] at src before, at dst after (may be src); q, k [n, nv, dk], v [n, nv, dv], g, beta\n"
     "[n, nv] in; o [n, nv, dv] and delta [nv, n, dv] out. Heads split over up to `threads` threads,\n"
     "GIL released. The caller guarantees the addresses."},
    {"gdn_conv", gdn_conv, METH_VARARGS,
     "gdn_conv(state, m, w, out, states, n, channels, kernel, first, keep, threads) -> None\n\n"
     "The depthwise causal conv of the Gated DeltaNet (float32 addresses; gdn_step.c): with x the\n"
     "rows of state [K-1, C] then m [n, C], out[t][c] = sum_j x[t+j][c] w[c][j] (w [C, K]);\n"
     "states [keep, K-1, C] = the windows after tokens first .. first+keep-1. Channels split over up\n"
     "to `threads` threads, GIL released."},
    {"fused", fused, METH_VARARGS,
     "fused(ggml_type) -> int\n\nThe vector width in bits (512: AVX-512, 256: AVX2) of dot()'s kernel for this\n"
     "type that computes the values in registers, on this CPU and setting; 0 where it decodes each row\n"
     "into a buffer first (plain C)."},
    {"decoded", decoded, METH_NOARGS,
     "decoded() -> int\n\nWeight values dot() has decoded since the module was loaded, all threads together\n"
     "(each block once per group of up to 9 activation rows)."},
    {"pool", pool, METH_NOARGS,
     "pool() -> 'openmp' | 'pthreads'\n\nWhere a split call runs now: torch's OpenMP threads (GOMP_parallel) or a\n"
     "pthread per share (no OpenMP runtime loaded, or SPECCONV_NATIVE_PTHREADS=1)."},
    {"switches", switches, METH_NOARGS,
     "switches() -> int\n\nBits of the switches set to \"1\" in the environment now: 1 SPECCONV_NO_NATIVE,\n"
     "2 SPECCONV_NO_NATIVE_DEQUANT, 4 SPECCONV_NATIVE_FLOAT_ACTIVATIONS, 8 SPECCONV_NO_NATIVE_GDN (getenv:\n"
     "a fraction of a microsecond, where os.environ takes one per missing name)."},
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
    pthread_atfork(NULL, NULL, omp_after_fork);
    return PyModule_Create(&module);
}
