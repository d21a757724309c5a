"""The Triton kernel of runtime/kernels_triton/attention.py (imported on first use; needs Triton).

One program per (query row, query head): the online softmax over the layer's K/V cells in blocks of
BLOCK_T cells, in increasing cell order, float32 throughout; the block size depends on the head
dimension only, so a row's sums run in the same order whatever the number of rows. A block whose
cells are all invisible to the row is skipped: it would multiply the running sums by exp(0) = 1 and
add zeros, so skipping it changes no bit. An attention sink is the softmax's starting point: the
running max starts at the sink's logit and the denominator at exp(0) = 1, with no value added.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x (float32) rounded into `dtype` and widened back: the value the reference holds there."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def attention_kernel(q_ptr, qr_ptr, k_ptr, v_ptr, kpos_ptr, qpos_ptr, keep_ptr, gate_ptr, sinks_ptr, o_ptr, cells,
                     heads, group, dk, dv, scale, window, stride_qn, stride_qh, stride_qrn, stride_qrh, stride_kt,
                     stride_kh, stride_vt, stride_vh, stride_keep, stride_gn, stride_gh, HAS_GATE: tl.constexpr,
                     GATE_PER_HEAD: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                     HAS_KEEP: tl.constexpr, V_IN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """Row r, head h (program r · heads + h) of q [n, heads, dk] against K [cells, heads / group, dk],
    V [cells, heads / group, dv] of KV head h // group: cell c visible iff 0 ≤ qpos[r] − kpos[c]
    (and, with HAS_WINDOW, qpos[r] − kpos[c] < window); with HAS_SINKS the logit sinks[h] (float32)
    joins the softmax's max and denominator and adds no value;
    o[r, h] = Σ softmax((q·k)·scale) v, then with HAS_GATE rounded into o's dtype and multiplied by
    sigmoid(gate[r, h]) rounded into o's dtype (the reference's o * sigmoid(gate).to(o.dtype)), or
    with GATE_PER_HEAD rounded into o's dtype and multiplied by sigmoid(gate[r, h]) (one value per
    head) in float32;
    o contiguous [n, heads, dv].
    With HAS_KEEP a cell is visible only where keep[r, c] (row stride stride_keep) is nonzero too.
    With V_IN_K (multi-head latent attention) V is each K cell's first dv entries: a cell is read once,
    as a piece of dv entries (the score's first part, then the value) and one of the dk − dv after it
    (BLOCK_DR wide: the score's second part), against q's first dv entries (q_ptr) and its other
    dk − dv (qr_ptr, with strides of its own: the roped part may be a tensor of its own); BLOCK_DK
    is unused."""
    p = tl.program_id(0)
    r = p // heads
    h = p % heads
    kv = h // group
    dvs = tl.arange(0, BLOCK_DV)
    dv_ok = dvs < dv
    if V_IN_K:
        drs = tl.arange(0, BLOCK_DR)
        dr_ok = drs < dk - dv
        q = tl.load(q_ptr + r * stride_qn + h * stride_qh + dvs, mask=dv_ok, other=0.0).to(tl.float32)
        q_rest = tl.load(qr_ptr + r * stride_qrn + h * stride_qrh + drs, mask=dr_ok, other=0.0).to(tl.float32)
    else:
        dks = tl.arange(0, BLOCK_DK)
        dk_ok = dks < dk
        q = tl.load(q_ptr + r * stride_qn + h * stride_qh + dks, mask=dk_ok, other=0.0).to(tl.float32)
    q_pos = tl.load(qpos_ptr + r).to(tl.int64)
    k_head = k_ptr + kv * stride_kh
    v_head = v_ptr + kv * stride_vh
    if HAS_SINKS:  # the sink's logit: the first score, exp(sink - sink) = 1 in the denominator
        m_run = tl.load(sinks_ptr + h).to(tl.float32)
        l_run = tl.full((), 1.0, tl.float32)
    else:
        m_run = tl.full((), float("-inf"), tl.float32)  # the largest visible score so far
        l_run = tl.zeros((), tl.float32)  # Σ exp(score - m_run)
    acc = tl.zeros((BLOCK_DV,), tl.float32)  # Σ exp(score - m_run) · v
    for start in range(0, cells, BLOCK_T):
        ts = start + tl.arange(0, BLOCK_T)
        t_ok = ts < cells
        k_pos = tl.load(kpos_ptr + ts, mask=t_ok, other=0).to(tl.int64)
        visible = t_ok & (k_pos <= q_pos)
        if HAS_WINDOW:
            visible = visible & (q_pos - k_pos < window)
        if HAS_KEEP:
            visible = visible & (tl.load(keep_ptr + r * stride_keep + ts, mask=t_ok, other=0) != 0)
        if tl.max(visible.to(tl.int32), axis=0) > 0:
            if V_IN_K:  # the first dv entries of the cell are its value too: read once
                v = tl.load(k_head + ts[:, None] * stride_kt + dvs[None, :], mask=visible[:, None] & dv_ok[None, :],
                            other=0.0).to(tl.float32)
                k_rest = tl.load(k_head + ts[:, None] * stride_kt + dv + drs[None, :],
                                 mask=visible[:, None] & dr_ok[None, :], other=0.0).to(tl.float32)
                s = (tl.sum(v * q[None, :], axis=1) + tl.sum(k_rest * q_rest[None, :], axis=1)) * scale
            else:
                k = tl.load(k_head + ts[:, None] * stride_kt + dks[None, :], mask=visible[:, None] & dk_ok[None, :],
                            other=0.0).to(tl.float32)
                s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_run, tl.max(s, axis=0))
            alpha = tl.exp(m_run - m_new)  # 0 while nothing was visible and no sink (m_run = -inf)
            e = tl.exp(s - m_new)
            if not V_IN_K:
                v = tl.load(v_head + ts[:, None] * stride_vt + dvs[None, :], mask=visible[:, None] & dv_ok[None, :],
                            other=0.0).to(tl.float32)
            l_run = l_run * alpha + tl.sum(e, axis=0)
            acc = acc * alpha + tl.sum(e[:, None] * v, axis=0)
            m_run = m_new
    o = tl.div_rn(acc, l_run)
    if HAS_GATE and GATE_PER_HEAD:
        z = tl.load(gate_ptr + r * stride_gn + h * stride_gh).to(tl.float32)
        o = _rounded(o, o_ptr.dtype.element_ty) * tl.div_rn(1.0, 1.0 + tl.exp(-z))
    elif HAS_GATE:
        z = tl.load(gate_ptr + r * stride_gn + h * stride_gh + dvs, mask=dv_ok, other=0.0).to(tl.float32)
        sig = _rounded(tl.div_rn(1.0, 1.0 + tl.exp(-z)), o_ptr.dtype.element_ty)
        o = _rounded(o, o_ptr.dtype.element_ty) * sig
    tl.store(o_ptr + p * dv + dvs, o.to(o_ptr.dtype.element_ty), mask=dv_ok)


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, cells_ptr, kc_ptr, vc_ptr, kv_heads, dk, dv, stride_kn, stride_kh, stride_vn,
                    stride_vh, stride_kct, stride_kch, stride_vct, stride_vch, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr):
    """Token t, KV head h (program t · kv_heads + h): k[t, h] into k_cache[cells[t], h] and v[t, h]
    into v_cache[cells[t], h], bits unchanged (the same dtype on both sides)."""
    p = tl.program_id(0)
    t = p // kv_heads
    h = p % kv_heads
    cell = tl.load(cells_ptr + t).to(tl.int64)
    dks = tl.arange(0, BLOCK_DK)
    dvs = tl.arange(0, BLOCK_DV)
    k = tl.load(k_ptr + t * stride_kn + h * stride_kh + dks, mask=dks < dk)
    tl.store(kc_ptr + cell * stride_kct + h * stride_kch + dks, k, mask=dks < dk)
    v = tl.load(v_ptr + t * stride_vn + h * stride_vh + dvs, mask=dvs < dv)
    tl.store(vc_ptr + cell * stride_vct + h * stride_vch + dvs, v, mask=dvs < dv)
