"""The Triton kernels of runtime/kernels_triton/attention.py (imported on first use; needs Triton).

attention_kernel: one program per (query row, piece of the cells, KV head and tile of its query
heads). The program holds the tile's queries as a [HEAD_TILE, d] tile and walks its piece's K/V cells
in blocks of BLOCK_T cells, in increasing cell order: each block of K (and V) is loaded once for all
the heads of the tile, the scores [HEAD_TILE, BLOCK_T] are one product (tl.dot, float32 "ieee": no
TF32), and each head keeps its online softmax (running max, denominator, float32 value sums). A block
whose cells are all invisible to the row is skipped: it would multiply the running sums by
exp(0) = 1 and add zeros, so skipping it changes no bit. An attention sink is piece 0's starting
point: the running max starts at the sink's logit and the denominator at exp(0) = 1, with no value
added.

With SPLIT (several pieces) each program writes its heads' (max, denominator, value sums) to the
workspace, then counts itself done on the (row, KV head, tile)'s counter; the program that counts
last combines all pieces in piece order 0, 1, 2, ... (the global max first, then the rescaled
denominators and value sums, summed in that order), writes the output and sets the counter back to 0
for the next launch. The block size, the pieces and the tile depend on the layer's shape and the
buffer's cell count, never on the number of rows, so a row's sums run in the same order whatever the
batch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specconv.runtime.kernels_triton._tail_jit import _last_arrival


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x (float32) rounded into `dtype` and widened back: the value the reference holds there."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _finish(o, o_ptr, gate_ptr, r, hs, h_ok, dvs, dv_ok, heads, dv, stride_gn, stride_gh, HAS_GATE: tl.constexpr,
            GATE_PER_HEAD: tl.constexpr):
    """o [HEAD_TILE, BLOCK_DV] (float32) of row r, heads hs: the gate applied, stored into o [n, heads, dv]."""
    if HAS_GATE and GATE_PER_HEAD:
        z = tl.load(gate_ptr + r * stride_gn + hs * stride_gh, mask=h_ok, other=0.0).to(tl.float32)
        o = _rounded(o, o_ptr.dtype.element_ty) * tl.div_rn(1.0, 1.0 + tl.exp(-z))[:, None]
    elif HAS_GATE:
        z = tl.load(gate_ptr + r * stride_gn + hs[:, None] * stride_gh + dvs[None, :],
                    mask=h_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        sig = _rounded(tl.div_rn(1.0, 1.0 + tl.exp(-z)), o_ptr.dtype.element_ty)
        o = _rounded(o, o_ptr.dtype.element_ty) * sig
    tl.store(o_ptr + (r * heads + hs)[:, None] * dv + dvs[None, :], o.to(o_ptr.dtype.element_ty),
             mask=h_ok[:, None] & dv_ok[None, :])


@triton.jit
def attention_kernel(q_ptr, qr_ptr, k_ptr, v_ptr, kpos_ptr, qpos_ptr, keep_ptr, gate_ptr, sinks_ptr, o_ptr,
                     part_m_ptr, part_l_ptr, part_acc_ptr, counts_ptr, cells, piece_cells, heads, group, dk, dv,
                     scale, window, stride_qn, stride_qh, stride_qrn, stride_qrh, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_keep, stride_gn, stride_gh, HAS_GATE: tl.constexpr,
                     GATE_PER_HEAD: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                     HAS_KEEP: tl.constexpr, V_IN_K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
                     HEAD_TILE: tl.constexpr):
    """Program (r, piece, t) of the grid (n, pieces, kv_heads · tiles): row r of q [n, heads, dk],
    KV head t // tiles and its query heads (t % tiles) · HEAD_TILE ... + HEAD_TILE − 1 of the `group`
    sharing it (tiles = cdiv(group, HEAD_TILE); query head h reads KV head h // group), against the
    cells piece · piece_cells ... + piece_cells − 1 (a whole number of BLOCK_T blocks) of
    K [cells, heads / group, dk], V [cells, heads / group, dv]: cell c visible iff
    0 ≤ qpos[r] − kpos[c] (and, with HAS_WINDOW, qpos[r] − kpos[c] < window); with HAS_SINKS the logit
    sinks[h] (float32) joins the softmax's max and denominator and adds no value;
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
    is unused.
    With SPLIT: part_m, part_l [n · heads · pieces] and part_acc [n · heads · pieces, dv] (float32) hold
    each piece's running max, denominator and value sums; counts_ptr [n · kv_heads · tiles] (int32,
    zero before the launch and after it) counts the pieces done."""
    r = tl.program_id(0)
    piece = tl.program_id(1)
    t = tl.program_id(2)
    pieces = tl.num_programs(1)
    tiles = tl.cdiv(group, HEAD_TILE)
    kv = t // tiles
    gs = (t % tiles) * HEAD_TILE + tl.arange(0, HEAD_TILE)  # the tile's heads within the group
    h_ok = gs < group
    hs = kv * group + gs
    dvs = tl.arange(0, BLOCK_DV)
    dv_ok = dvs < dv
    if V_IN_K:
        drs = tl.arange(0, BLOCK_DR)
        dr_ok = drs < dk - dv
        q = tl.load(q_ptr + r * stride_qn + hs[:, None] * stride_qh + dvs[None, :],
                    mask=h_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        q_rest = tl.load(qr_ptr + r * stride_qrn + hs[:, None] * stride_qrh + drs[None, :],
                         mask=h_ok[:, None] & dr_ok[None, :], other=0.0).to(tl.float32)
    else:
        dks = tl.arange(0, BLOCK_DK)
        dk_ok = dks < dk
        q = tl.load(q_ptr + r * stride_qn + hs[:, None] * stride_qh + dks[None, :],
                    mask=h_ok[:, None] & dk_ok[None, :], other=0.0).to(tl.float32)
    q_pos = tl.load(qpos_ptr + r).to(tl.int64)
    k_head = k_ptr + kv * stride_kh
    v_head = v_ptr + kv * stride_vh
    m_run = tl.full((HEAD_TILE,), float("-inf"), tl.float32)  # the largest visible score so far
    l_run = tl.zeros((HEAD_TILE,), tl.float32)  # Σ exp(score - m_run)
    if HAS_SINKS:  # the sink's logit: piece 0's first score, exp(sink - sink) = 1 in the denominator
        sink = tl.load(sinks_ptr + hs, mask=h_ok, other=0.0).to(tl.float32)
        m_run = tl.where(piece == 0, sink, m_run)
        l_run = tl.where(piece == 0, 1.0, l_run)
    acc = tl.zeros((HEAD_TILE, BLOCK_DV), tl.float32)  # Σ exp(score - m_run) · v
    lo = piece * piece_cells
    for start in range(lo, tl.minimum(lo + piece_cells, cells), BLOCK_T):
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
                s = tl.dot(q_rest, tl.trans(k_rest), acc=tl.dot(q, tl.trans(v), input_precision="ieee"),
                           input_precision="ieee") * scale
            else:
                k = tl.load(k_head + ts[:, None] * stride_kt + dks[None, :], mask=visible[:, None] & dk_ok[None, :],
                            other=0.0).to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            s = tl.where(visible[None, :], s, float("-inf"))  # [HEAD_TILE, BLOCK_T]
            m_new = tl.maximum(m_run, tl.max(s, axis=1))
            alpha = tl.exp(m_run - m_new)  # 0 while nothing was visible and no sink (m_run = -inf)
            e = tl.exp(s - m_new[:, None])
            if not V_IN_K:
                v = tl.load(v_head + ts[:, None] * stride_vt + dvs[None, :], mask=visible[:, None] & dv_ok[None, :],
                            other=0.0).to(tl.float32)
            l_run = l_run * alpha + tl.sum(e, axis=1)
            acc = acc * alpha[:, None] + tl.dot(e, v, input_precision="ieee")
            m_run = m_new
    if SPLIT:
        part = (r * heads + hs) * pieces  # piece i of head h: part + i
        tl.store(part_m_ptr + part + piece, m_run, mask=h_ok)
        tl.store(part_l_ptr + part + piece, l_run, mask=h_ok)
        tl.store(part_acc_ptr + (part + piece)[:, None] * dv + dvs[None, :], acc, mask=h_ok[:, None] & dv_ok[None, :])
        counter = counts_ptr + r * tl.num_programs(2) + t
        if _last_arrival(counter, pieces):  # the last piece done (the cut products' arrival)
            m_all = tl.full((HEAD_TILE,), float("-inf"), tl.float32)
            for i in range(0, pieces):
                m_all = tl.maximum(m_all, tl.load(part_m_ptr + part + i, mask=h_ok, other=0.0, cache_modifier=".cg"))
            l_all = tl.zeros((HEAD_TILE,), tl.float32)
            acc = tl.zeros((HEAD_TILE, BLOCK_DV), tl.float32)
            for i in range(0, pieces):  # in piece order: the same sums for every batch
                m_i = tl.load(part_m_ptr + part + i, mask=h_ok, other=0.0, cache_modifier=".cg")
                w = tl.where(m_i == m_all, 1.0, tl.exp(m_i - m_all))  # 1, not NaN, where nothing was visible
                l_all = l_all + tl.load(part_l_ptr + part + i, mask=h_ok, other=1.0, cache_modifier=".cg") * w
                acc = acc + tl.load(part_acc_ptr + (part + i)[:, None] * dv + dvs[None, :],
                                    mask=h_ok[:, None] & dv_ok[None, :], other=0.0, cache_modifier=".cg") * w[:, None]
            _finish(tl.div_rn(acc, l_all[:, None]), o_ptr, gate_ptr, r, hs, h_ok, dvs, dv_ok, heads, dv, stride_gn,
                    stride_gh, HAS_GATE, GATE_PER_HEAD)
            tl.store(counter, 0)  # ready for the next launch
    else:
        _finish(tl.div_rn(acc, l_run[:, None]), o_ptr, gate_ptr, r, hs, h_ok, dvs, dv_ok, heads, dv, stride_gn,
                stride_gh, HAS_GATE, GATE_PER_HEAD)


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
