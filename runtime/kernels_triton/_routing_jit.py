"""Triton kernel of the MoE router (imported on first use; needs Triton). The wrapper is routing.py.

One program per row: the row's softmax, its top k and the renormalisation are that program's
reductions over a block sized by the number of experts only, so a row gives the same bits alone or
in a batch of any size.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_topk_kernel(logits_ptr, w_ptr, idx_ptr, n_experts, stride_l, K: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """Row r of logits [n, n_experts]: p = exp(l - max l) / Σ exp(l - max l) in float32; the k experts
    of largest logit (softmax is monotonic; among equal logits the lowest index first), in decreasing
    order, into idx [n, K] (int64); their p / Σ of the k chosen p (summed in that order) into w [n, K]."""
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_experts
    x = tl.load(logits_ptr + r * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    e = tl.where(ok, tl.exp(x - top), 0.0)
    p = tl.div_rn(e, tl.sum(e, axis=0))
    slots = tl.arange(0, BLOCK_K)
    chosen_p = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    free = ok
    total = 0.0
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, x, float("-inf")), axis=0)
        i = tl.min(tl.where(free & (x == best), cols, BLOCK), axis=0)
        pick = cols == i
        pj = tl.sum(tl.where(pick, p, 0.0), axis=0)
        free = free & (cols != i)
        total = total + pj
        chosen_p = tl.where(slots == j, pj, chosen_p)
        chosen_i = tl.where(slots == j, i, chosen_i)
    keep = slots < K
    tl.store(w_ptr + r * K + slots, tl.div_rn(chosen_p, total), mask=keep)
    tl.store(idx_ptr + r * K + slots, chosen_i.to(tl.int64), mask=keep)


@triton.jit
def combine_kernel(y_ptr, w_ptr, idx_ptr, out_ptr, width, stride_y, stride_w, stride_i,
                   K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    """Columns of program (r, c) of out[r] = Σ_s float32(y[r·K + s]) · w[r, s] over the K slots of row
    r, added in increasing order of chosen[r, s] (distinct experts), each product rounded to float32
    before its sum, starting from 0: the reference's `total = total + y_s · w_s` in that order."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    slots = tl.arange(0, BLOCK_K)
    done = slots >= K
    experts = tl.load(idx_ptr + r * stride_i + slots, mask=~done, other=0).to(tl.int32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in tl.static_range(K):
        low = tl.min(tl.where(done, 2147483647, experts), axis=0)
        s = tl.min(tl.where(~done & (experts == low), slots, BLOCK_K), axis=0)
        done = done | (slots == s)
        weight = tl.load(w_ptr + r * stride_w + s).to(tl.float32)
        y = tl.load(y_ptr + (r * K + s).to(tl.int64) * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        acc = acc + y * weight
    tl.store(out_ptr + r.to(tl.int64) * width + cols, acc, mask=ok)


@triton.jit
def gated_shared_kernel(routed_ptr, shared_ptr, gate_ptr, y_ptr, width, stride_r, stride_s, stride_g,
                        BLOCK: tl.constexpr):
    """Columns of program (r, c): y = rounded(routed) + rounded(float32(shared) · σ(gate[r])), each
    rounding into y's dtype, σ(g) = 1 / (1 + exp(-g)) in float32."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    dtype = y_ptr.dtype.element_ty
    routed = tl.load(routed_ptr + r * stride_r + cols, mask=ok, other=0.0).to(tl.float32).to(dtype).to(tl.float32)
    shared = tl.load(shared_ptr + r * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + r * stride_g).to(tl.float32)
    gated = (shared * tl.div_rn(1.0, 1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(y_ptr + r.to(tl.int64) * width + cols, (routed + gated).to(dtype), mask=ok)
