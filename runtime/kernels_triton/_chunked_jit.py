"""Triton kernel of the gated delta rule for long inputs (prompts) in its chunked form (imported on
first use; needs Triton): runtime/kernels_triton/gdn_chunked.py calls it, runtime/graphs/gdn.py
`chunked_delta_rule` is the same formula in torch (docs/reference/model-math.md §2.2).

Per chunk of CHUNK tokens with cumulative log-decay Γ (float64: a decay is a difference of two of its
values, as `gdn.cumulative_log_decay` explains) and D_ij = e^{Γ_i − Γ_j} (j ≤ i):

    A = strict-lower(β_i k_i·k_j D_ij),  T = (I + A)⁻¹            the UT transform
    U = T (β V),  W = T (β e^Γ K),  V_new = U − W S               δ of every token of the chunk
    O = (Q e^Γ) S + ((Q Kᵀ) ⊙ D) V_new
    S_t = e^{Γ_t} S + Σ_{j≤t} e^{Γ_t − Γ_j} k_j V_new_jᵀ          the state after token t

All products are tl.dot on [CHUNK, dk] / [CHUNK, BLOCK_V] tiles in float32 (IEEE: TF32 would round
the operands to 10 bits); T by forward substitution, a row at a time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unit_lower_inverse(a, idx, CHUNK: tl.constexpr):
    """(I + a)⁻¹ for a strictly lower triangular [CHUNK, CHUNK] a: row r of the inverse is
    e_r − Σ_{j<r} a_rj (row j of the inverse), rows in increasing order (each needs only earlier rows)."""
    inv = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    for r in range(1, CHUNK):
        a_r = tl.sum(tl.where(idx[:, None] == r, a, 0.0), axis=0)  # row r of a, indexed by column
        row = tl.sum(a_r[:, None] * inv, axis=0)
        inv = tl.where(idx[:, None] == r, inv - row[None, :], inv)
    return inv


@triton.jit
def _state_after(s, k, v_new, gamma, idx, at, PRECISION: tl.constexpr):
    """The state after token `at` of the chunk (0-based): e^{Γ_at} S + Σ_{j≤at} e^{Γ_at − Γ_j} k_j v_new_jᵀ,
    S the state before the chunk."""
    gamma_at = tl.sum(tl.where(idx == at, gamma, 0.0), axis=0)
    weight = tl.where(idx <= at, tl.exp(tl.where(idx <= at, gamma_at - gamma, 0.0).to(tl.float32)), 0.0)
    return (tl.exp(gamma_at.to(tl.float32)) * s
            + tl.dot(tl.trans(k * weight[:, None]), v_new, input_precision=PRECISION))


@triton.jit
def gdn_chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, src_slot_ptr, dst_slots_ptr, o_ptr,
                       n, keep, n_key_heads, group, dk, dv,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                       stride_slot, stride_sh, stride_sk, stride_ot, stride_oh,
                       CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                       PRECISION: tl.constexpr):
    """One program per (value head h, BLOCK_V columns of its state [dk, dv]), as gdn_step: the block
    of the state stays in registers from chunk to chunk; the chunk's K-only terms (A, T, W) are
    recomputed by each column block. Value head h reads key head (h // group) mod n_key_heads.

    Tokens past n load as k = v = 0, g = 0, β = 0: they add nothing and leave Γ flat, so the last
    chunk's end state is the state after token n − 1. The state after each kept token (the last
    `keep`) goes to dst_slots[t − (n − keep)]; every chunk's end state comes from the same formula
    whether or not it is kept, so outputs and the final state do not depend on `keep`."""
    h = tl.program_id(0)
    key_head = (h // group) % n_key_heads
    dims = tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    dim_ok, col_ok = dims < dk, cols < dv
    block_ok = dim_ok[:, None] & col_ok[None, :]
    block = h * stride_sh + dims[:, None] * stride_sk + cols[None, :]
    src = tl.load(src_slot_ptr).to(tl.int64)
    s = tl.load(states_ptr + src * stride_slot + block, mask=block_ok, other=0.0).to(tl.float32)
    idx = tl.arange(0, CHUNK)
    causal = idx[:, None] >= idx[None, :]  # j ≤ i
    strict = idx[:, None] > idx[None, :]
    first = n - keep
    for start in range(0, n, CHUNK):
        tok = start + idx
        tok_ok = tok < n
        row = tok.to(tl.int64)  # a token's offset: a prompt of a whole context times a row passes 2^31
        key_ok = tok_ok[:, None] & dim_ok[None, :]
        val_ok = tok_ok[:, None] & col_ok[None, :]
        k = tl.load(k_ptr + row[:, None] * stride_kt + key_head * stride_kh + dims[None, :], mask=key_ok,
                    other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row[:, None] * stride_qt + key_head * stride_qh + dims[None, :], mask=key_ok,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row[:, None] * stride_vt + h * stride_vh + cols[None, :], mask=val_ok,
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_gt + h, mask=tok_ok, other=0.0).to(tl.float64)
        beta = tl.load(beta_ptr + row * stride_bt + h, mask=tok_ok, other=0.0).to(tl.float32)
        gamma = tl.cumsum(g, axis=0)
        # e^{Γ_i − Γ_j} on and below the diagonal only (above it the exponent is positive: no inf)
        decay = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0).to(tl.float32)), 0.0)
        growth = tl.exp(gamma.to(tl.float32))  # e^{Γ_i}
        a = tl.where(strict, beta[:, None] * tl.dot(k, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
        inverse = _unit_lower_inverse(a, idx, CHUNK)
        u = tl.dot(inverse, beta[:, None] * v, input_precision=PRECISION)
        w = tl.dot(inverse, (beta * growth)[:, None] * k, input_precision=PRECISION)
        v_new = u - tl.dot(w, s, input_precision=PRECISION)
        scores = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
        o = (tl.dot(q * growth[:, None], s, input_precision=PRECISION)
             + tl.dot(scores, v_new, input_precision=PRECISION))
        tl.store(o_ptr + row[:, None] * stride_ot + h * stride_oh + cols[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=val_ok)
        last = tl.minimum(start + CHUNK, n) - 1  # the chunk's last token
        for t in range(tl.maximum(first, start), last):  # kept tokens before it (the ring's snapshots)
            dst = tl.load(dst_slots_ptr + (t - first)).to(tl.int64)
            kept_state = _state_after(s, k, v_new, gamma, idx, t - start, PRECISION)
            tl.store(states_ptr + dst * stride_slot + block, kept_state.to(states_ptr.dtype.element_ty),
                     mask=block_ok)
        s = _state_after(s, k, v_new, gamma, idx, last - start, PRECISION)
        kept = block_ok & (tl.full([BLOCK_K, BLOCK_V], last, tl.int32) >= first)  # a vector mask (as gdn_step)
        dst = tl.load(dst_slots_ptr + tl.maximum(last - first, 0)).to(tl.int64)
        tl.store(states_ptr + dst * stride_slot + block, s.to(states_ptr.dtype.element_ty), mask=kept)
