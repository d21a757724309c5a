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
def combine_kernel(y_ptr, w_ptr, idx_ptr, out_ptr, shared_ptr, gate_ptr, width, stride_y, stride_w, stride_i,
                   stride_s, stride_g, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_SHARED: tl.constexpr, GATED: tl.constexpr):
    """Columns of program (r, c) of out[r] = Σ_s float32(y[r·K + s]) · w[r, s] over the K slots of row
    r, added in increasing order of chosen[r, s] (distinct experts), each product rounded to float32
    before its sum, starting from 0: the reference's `total = total + y_s · w_s` in that order. With
    HAS_SHARED, + float32(shared[r]) last; the float32 result rounded once into out's dtype. With
    GATED too, the shared expert is gated by σ(gate[r]) instead (_gated_sum: gated_shared_kernel's
    formula on the float32 sum)."""
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
    if HAS_SHARED:
        shared = tl.load(shared_ptr + r * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            acc = _gated_sum(acc, shared, tl.load(gate_ptr + r * stride_g).to(tl.float32), out_ptr.dtype.element_ty)
        else:
            acc = acc + shared
    tl.store(out_ptr + r.to(tl.int64) * width + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_sum(routed, shared, g, DTYPE: tl.constexpr):
    """float32 rounded(routed) + rounded(shared · σ(g)), each rounding into DTYPE, σ(g) = 1 / (1 + exp(-g))
    in float32: a MoE block's routed sum and its sigmoid-gated shared expert."""
    gated = (shared * tl.div_rn(1.0, 1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return routed.to(DTYPE).to(tl.float32) + gated


@triton.jit
def gated_shared_kernel(routed_ptr, shared_ptr, gate_ptr, y_ptr, width, stride_r, stride_s, stride_g,
                        BLOCK: tl.constexpr):
    """Columns of program (r, c): y = rounded(routed) + rounded(float32(shared) · σ(gate[r])), each
    rounding into y's dtype, σ(g) = 1 / (1 + exp(-g)) in float32."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    routed = tl.load(routed_ptr + r * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    shared = tl.load(shared_ptr + r * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + r * stride_g).to(tl.float32)
    y = _gated_sum(routed, shared, g, y_ptr.dtype.element_ty)
    tl.store(y_ptr + r.to(tl.int64) * width + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def grouped_topk_kernel(logits_ptr, bias_ptr, escale_ptr, w_ptr, idx_ptr, n_groups, group_size, stride_l, scale,
                        K: tl.constexpr, GROUPS_USED: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_ESCALE: tl.constexpr, RENORMALISE: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row r of logits [n, n_groups · group_size], held as [groups, experts of a group]: scores s =
    σ(l) = 1 / (1 + exp(−l)) (SIGMOID) or softmax(l), in float32; c = s + bias. With GROUPS_USED <
    n_groups, each group scores the sum of its two largest c (the first of them: its lowest index) and
    the GROUPS_USED best groups stay eligible (equal scores: the lower group first), c = −inf in the
    others. The K experts of largest c in decreasing order, equal c the lowest index first, into idx
    [n, K] (int64); their s, over (Σ of the K s in slot order + 1e-20) when RENORMALISE, times
    escale[expert] (HAS_ESCALE), times `scale`, into w [n, K]."""
    r = tl.program_id(0)
    groups = tl.arange(0, BLOCK_G)[:, None]
    members = tl.arange(0, BLOCK_S)[None, :]
    experts = groups * group_size + members
    ok = (groups < n_groups) & (members < group_size)
    x = tl.load(logits_ptr + r * stride_l + experts, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        s = tl.div_rn(1.0, 1.0 + tl.exp(-x))
    else:
        e = tl.where(ok, tl.exp(x - tl.max(tl.max(x, axis=1), axis=0)), 0.0)
        s = tl.div_rn(e, tl.sum(tl.sum(e, axis=1), axis=0))
    c = s
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + experts, mask=ok, other=0.0).to(tl.float32)
    c = tl.where(ok, c, float("-inf"))
    if GROUPS_USED > 0:
        group_ids = tl.arange(0, BLOCK_G)
        first = tl.max(c, axis=1)
        first_at = tl.min(tl.where(ok & (c == first[:, None]), members, BLOCK_S), axis=1)
        second = tl.max(tl.where(members == first_at[:, None], float("-inf"), c), axis=1)
        group_score = first + second
        open_group = group_ids < n_groups
        keep = group_ids < 0
        for _ in tl.static_range(GROUPS_USED):
            best = tl.max(tl.where(open_group, group_score, float("-inf")), axis=0)
            g = tl.min(tl.where(open_group & (group_score == best), group_ids, BLOCK_G), axis=0)
            keep = keep | (group_ids == g)
            open_group = open_group & (group_ids != g)
        c = tl.where(keep[:, None], c, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    chosen_s = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    free = ok
    total = 0.0
    n_experts = n_groups * group_size
    for j in tl.static_range(K):
        best = tl.max(tl.max(tl.where(free, c, float("-inf")), axis=1), axis=0)
        i = tl.min(tl.min(tl.where(free & (c == best), experts, n_experts), axis=1), axis=0)
        pick = experts == i
        sj = tl.sum(tl.sum(tl.where(pick, s, 0.0), axis=1), axis=0)
        free = free & ~pick
        total = total + sj
        chosen_s = tl.where(slots == j, sj, chosen_s)
        chosen_i = tl.where(slots == j, i, chosen_i)
    keep_slot = slots < K
    w = chosen_s
    if RENORMALISE:
        w = tl.div_rn(w, total + 1e-20)
    if HAS_ESCALE:
        w = w * tl.load(escale_ptr + chosen_i, mask=keep_slot, other=0.0).to(tl.float32)
    w = w * scale
    tl.store(w_ptr + r * K + slots, w, mask=keep_slot)
    tl.store(idx_ptr + r * K + slots, chosen_i.to(tl.int64), mask=keep_slot)


@triton.jit
def shared_add_kernel(routed_ptr, shared_ptr, y_ptr, width, stride_r, stride_s, BLOCK: tl.constexpr):
    """Columns of program (r, c): y = routed + float32(shared) in float32, rounded once into y's dtype."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    routed = tl.load(routed_ptr + r * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    shared = tl.load(shared_ptr + r * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + r.to(tl.int64) * width + cols, (routed + shared).to(y_ptr.dtype.element_ty), mask=ok)
