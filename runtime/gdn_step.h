/* The Gated DeltaNet step over a few tokens in cache (gdn_step.c), called by runtime/_dequant.c. */
#ifndef SPECCONV_GDN_STEP_H
#define SPECCONV_GDN_STEP_H

#include <stddef.h>

typedef struct {
    const float *src; /* state before the batch [nv, dk, dv] */
    float *dst;       /* state after the batch [nv, dk, dv] (may be src) */
    const float *q, *k; /* [n, nv, dk] */
    const float *v;     /* [n, nv, dv] */
    const float *g, *beta; /* [n, nv]: log-decay, write strength */
    float *o;          /* out: [n, nv, dv] */
    float *delta;      /* out: δ [nv, n, dv] */
    size_t n, nv, dk, dv;
} gdn_args;

/* heads first .. first+count-1 (a work_fn of _dequant.c's thread split) */
void gdn_heads(const void *arg, size_t first, size_t count);

typedef struct {
    const float *state; /* [K-1, C]: the previous K-1 inputs, oldest first */
    const float *m;     /* [n, C]: the batch's inputs */
    const float *w;     /* [C, K]: the weights */
    float *out;         /* out: [n, C] the conv sums (before the activation) */
    float *states;      /* out: [keep, K-1, C] the windows after tokens first .. first+keep-1 */
    size_t n, channels, kernel, first, keep;
} gdn_conv_args;

/* channels first .. first+count-1 of the depthwise causal conv (a work_fn) */
void gdn_conv_channels(const void *arg, size_t first, size_t count);

#endif
