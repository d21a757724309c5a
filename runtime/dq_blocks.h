/* Block decoders of the native dequantizer (runtime/_dequant.c): GGUF blocks -> float32.
 *
 * Each decoder turns `n` consecutive blocks at `src` into n * block values at `dst`, with the
 * float32 operations, in the order, that runtime/dequant.py documents (and gguf.quants performs),
 * so the results are bit-identical. Built with -ffp-contract=off: a product followed by a sum
 * or difference is never fused. */
#ifndef SPECCONV_DQ_BLOCKS_H
#define SPECCONV_DQ_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

typedef void (*dq_fn)(const uint8_t *src, float *dst, size_t n);

typedef struct {
    int ggml_type;   /* GGMLQuantizationType value */
    int block;       /* values per block */
    int size;        /* bytes per block */
    dq_fn decode;
} dq_type;

/* The covered type `ggml_type`, or NULL. */
const dq_type *dq_find(int ggml_type);

/* Every covered type, terminated by an entry whose decode is NULL. */
extern const dq_type dq_types[];

#endif
