"""Triton kernels of a Gated DeltaNet layer's recurrent part for a few tokens (imported on first use;
needs Triton): the gated delta rule and the short causal conv, each one launch for all tokens, each
writing the state after every kept token into a slot of the ring of states (runtime/memory.py keeps
one per sequence and layer), so a rollback makes another slot current instead of rebuilding a state.

Slots are given as int64 tensors on the device (the state before the batch `src_slot[0]`, the state
after kept token i `dst_slots[i]`), so a captured CUDA graph replays with new slots written into
the same index buffers. They are the only addresses taken from loaded values (Triton's interpreter
runs them: tests/runtime/test_triton_kernels.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specconv.runtime.kernels_triton._pointwise_jit import _rounded, _silu, gdn_gate_values, inverse_root
from specconv.runtime.kernels_triton._tail_jit import _last_arrival


# n and keep are never specialized as constants (Triton makes an argument equal to 1 one): a one-token
# step then runs the code of a verification batch, so its rows cannot differ by compilation
@triton.jit(do_not_specialize=["n", "keep"])
def gdn_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, bias_ptr, m_ptr, windows_ptr, conv_w_ptr,
                    states_ptr, src_slot_ptr, dst_slots_ptr,
                    o_ptr, norm_w_ptr, z_ptr, y_ptr, count_ptr, n, keep, n_key_heads, group, dk, dv, per_group,
                    eps, scale, norm_eps, norm_count,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gg,
                    stride_bt, stride_bg, stride_mt, stride_wslot, stride_wrow, stride_cw,
                    stride_slot, stride_sh, stride_sk, stride_ot, stride_oh, stride_zt, stride_zh,
                    stride_yt, stride_yh,
                    NORM_QK: tl.constexpr, GATES: tl.constexpr, CONV: tl.constexpr, K: tl.constexpr,
                    GATED_NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_DV: tl.constexpr):
    """One program per (value head h, BLOCK_V columns of its state [dk, dv]): a column of the state
    needs only itself through the tokens, so the program keeps its [dk, BLOCK_V] block in registers
    for all n tokens, reading the state once and writing each kept token's state once. Per token
    (the recurrent form of runtime/graphs/gdn.py): S ← e^g S; δ = β (v − Sᵀk); S ← S + k δᵀ; o = Sᵀq.
    Value head h reads key head (h // group) mod n_key_heads: h mod n_key_heads for GGUF's tiled
    value heads (group 1), h // group for grouped ones (group = value heads per key head).

    NORM_QK: q and k are the conv's outputs, L2-normed here (q then · scale) with norm_kernel's
    operations (a head's sum over a block of BLOCK_K = its width rounded up, as norm_kernel's).
    GATES: g_ptr and beta_ptr hold the projections alpha and b, a_ptr and bias_ptr the per-head a
    and dt_bias, and the gates are gdn_gate_values (gdn_gates_kernel's formula). Head h of g / beta
    (or alpha / b) is read at (h // per_group) · stride_gg + h mod per_group of a token's row.
    CONV: q, k and v are the causal conv's outputs (`conv_channels`, causal_conv_kernel's operations,
    rounded into m's dtype as its output is) of the pre-conv rows m [n, C] = [q | k | v] with the
    windows ring [slots, K-1, C] and weight [C, K]; the windows after the kept tokens go to the
    destination slots of both rings, each channel's by one program (a key head's by the first value
    head reading it, in its first column block). Other programs read the key head's window before
    the batch while it writes: the source slot must not be a destination (the memory's rings)."""
    h = tl.program_id(0)
    key_head = (h // group) % n_key_heads
    rows = tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok, col_ok = rows < dk, cols < dv
    block_ok = row_ok[:, None] & col_ok[None, :]
    block = h * stride_sh + rows[:, None] * stride_sk + cols[None, :]
    src = tl.load(src_slot_ptr).to(tl.int64)
    s = tl.load(states_ptr + src * stride_slot + block, mask=block_ok, other=0.0).to(tl.float32)
    head_g = (h // per_group) * stride_gg + h % per_group
    head_b = (h // per_group) * stride_bg + h % per_group
    first = n - keep
    q_channels = key_head * dk + rows  # CONV: the channels of m and of the windows this program reads
    k_channels = n_key_heads * dk + q_channels
    v_channels = 2 * n_key_heads * dk + h * dv + cols
    for t in range(n):
        if CONV:
            k = conv_channels(m_ptr, windows_ptr, conv_w_ptr, src, t, k_channels, row_ok, stride_mt, stride_wslot,
                              stride_wrow, stride_cw, K).to(m_ptr.dtype.element_ty).to(tl.float32)
            q = conv_channels(m_ptr, windows_ptr, conv_w_ptr, src, t, q_channels, row_ok, stride_mt, stride_wslot,
                              stride_wrow, stride_cw, K).to(m_ptr.dtype.element_ty).to(tl.float32)
        else:
            k = tl.load(k_ptr + t * stride_kt + key_head * stride_kh + rows, mask=row_ok, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + t * stride_qt + key_head * stride_qh + rows, mask=row_ok, other=0.0).to(tl.float32)
        if NORM_QK:
            k = k * inverse_root(tl.sum(k * k, axis=0), eps)
            q = q * inverse_root(tl.sum(q * q, axis=0), eps) * scale
        if CONV:
            v = conv_channels(m_ptr, windows_ptr, conv_w_ptr, src, t, v_channels, col_ok, stride_mt, stride_wslot,
                              stride_wrow, stride_cw, K).to(m_ptr.dtype.element_ty).to(tl.float32)
        else:
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + head_g)
        beta = tl.load(beta_ptr + t * stride_bt + head_b)
        if GATES:
            g, beta = gdn_gate_values(g, tl.load(bias_ptr + h), tl.load(a_ptr + h), beta)
        g, beta = g.to(tl.float32), beta.to(tl.float32)
        s = s * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + cols, o.to(o_ptr.dtype.element_ty), mask=col_ok)
        kept = block_ok & (tl.full([BLOCK_K, BLOCK_V], t, tl.int32) >= first)  # a vector mask (as _input_row)
        dst = tl.load(dst_slots_ptr + tl.maximum(t - first, 0)).to(tl.int64)
        tl.store(states_ptr + dst * stride_slot + block, s.to(states_ptr.dtype.element_ty), mask=kept)
    if CONV:
        first_reader = (tl.zeros_like(rows) + h == key_head * group) & (tl.zeros_like(rows) + tl.program_id(1) == 0)
        key_ok = row_ok & first_reader  # a vector mask (as _input_row)
        for i in range(keep):
            dst = tl.load(dst_slots_ptr + i).to(tl.int64)
            write_window(m_ptr, windows_ptr, src, dst, first + i, q_channels, key_ok, stride_mt, stride_wslot,
                         stride_wrow, K)
            write_window(m_ptr, windows_ptr, src, dst, first + i, k_channels, key_ok, stride_mt, stride_wslot,
                         stride_wrow, K)
            write_window(m_ptr, windows_ptr, src, dst, first + i, v_channels, col_ok, stride_mt, stride_wslot,
                         stride_wrow, K)
    if GATED_NORM:
        counter = count_ptr + h
        if _last_arrival(counter, tl.num_programs(1)):
            gated_norm_rows(o_ptr + h * stride_oh, norm_w_ptr, z_ptr + h * stride_zh, y_ptr + h * stride_yh, n, dv,
                            norm_count, norm_eps, stride_ot, stride_zt, stride_yt, BLOCK_DV)
            tl.store(counter, 0)  # every program of the head has counted: zero again for the next launch


@triton.jit
def gated_norm_rows(x_ptr, w_ptr, z_ptr, y_ptr, n, width, count, eps, stride_xt, stride_zt, stride_yt,
                    BLOCK: tl.constexpr):
    """Rows t < n of x (float32 o: stride_xt apart): y = x · (Σ x² / count + eps)^(-1/2) · w, rounded
    into x's dtype, · silu(z), stored in y's dtype: the float32 operations of _pointwise_jit
    norm_kernel with a weight and a gate (the same block of BLOCK = width rounded up to a power of
    two, so the same sum), per row, whatever n is. x is read from L2 (.cg): other multiprocessors
    wrote it."""
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    for t in range(n):
        x = tl.load(x_ptr + t * stride_xt + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        y = x * inverse_root(tl.div_rn(tl.sum(x * x, axis=0), count), eps)
        y = y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + t * stride_zt + cols, mask=ok, other=0.0).to(tl.float32)
        y = _rounded(y, x_ptr.dtype.element_ty) * _silu(z)
        tl.store(y_ptr + t * stride_yt + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def conv_channels(m_ptr, states_ptr, weight_ptr, src, t, channels, channel_ok, stride_mt, stride_slot, stride_row,
                  stride_wc, K: tl.constexpr):
    """SiLU(Σ_j x[t + j] w[:, j]) of token t on `channels` (float32), x = [the window in slot src; m]."""
    acc = tl.zeros(channels.shape, dtype=tl.float32)
    for j in tl.static_range(K):
        x = _input_row(m_ptr, states_ptr, src, t + j, channels, channel_ok, stride_mt, stride_slot, stride_row, K)
        w = tl.load(weight_ptr + channels * stride_wc + j, mask=channel_ok, other=0.0).to(tl.float32)
        acc += x * w
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def write_window(m_ptr, states_ptr, src, dst, t, channels, channel_ok, stride_mt, stride_slot, stride_row,
                 K: tl.constexpr):
    """The window after token t on `channels` (rows t+1 .. t+K-1 of x = [slot src; m]) into slot dst,
    its rows in order (only later rows are read: dst may be src)."""
    for j in tl.static_range(K - 1):
        x = _input_row(m_ptr, states_ptr, src, t + 1 + j, channels, channel_ok, stride_mt, stride_slot, stride_row, K)
        tl.store(states_ptr + dst * stride_slot + j * stride_row + channels, x.to(states_ptr.dtype.element_ty),
                 mask=channel_ok)


@triton.jit
def _input_row(m_ptr, states_ptr, src, r, channels, channel_ok, stride_mt, stride_slot, stride_row,
               K: tl.constexpr):
    """Row r of the conv's inputs [the K-1 rows of the state before the batch; m] as float32."""
    r = tl.zeros_like(channels) + r  # per channel: masks are vectors (a scalar one fails the interpreter)
    from_state = r < K - 1
    old = tl.load(states_ptr + src * stride_slot + tl.minimum(r, K - 2) * stride_row + channels,
                  mask=channel_ok & from_state, other=0.0)
    new = tl.load(m_ptr + tl.maximum(r - (K - 1), 0) * stride_mt + channels,
                  mask=channel_ok & ~from_state, other=0.0)
    return tl.where(from_state, old.to(tl.float32), new.to(tl.float32))


@triton.jit(do_not_specialize=["n", "keep"])  # as gdn_step_kernel: one compiled code for every width
def causal_conv_kernel(m_ptr, states_ptr, weight_ptr, src_slot_ptr, dst_slots_ptr, out_ptr,
                       n, keep, n_channels, stride_mt, stride_slot, stride_row, stride_wc, stride_ot,
                       K: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per BLOCK_C channels: out[t] = SiLU(Σ_j x[t + j] w[:, j]) over the inputs
    x = [state; m] (oldest first), then the window after each kept token t (rows t+1 .. t+K-1 of x)
    into its slot. Every output is computed before any window is written, and a window's rows are
    written in order while only later rows are read, so the state before the batch may also be the
    last kept token's slot (a ring of one)."""
    channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channels < n_channels
    src = tl.load(src_slot_ptr).to(tl.int64)
    for t in range(n):
        out = conv_channels(m_ptr, states_ptr, weight_ptr, src, t, channels, channel_ok, stride_mt, stride_slot,
                            stride_row, stride_wc, K)
        tl.store(out_ptr + t * stride_ot + channels, out.to(out_ptr.dtype.element_ty), mask=channel_ok)
    first = n - keep
    for i in range(keep):
        dst = tl.load(dst_slots_ptr + i).to(tl.int64)
        write_window(m_ptr, states_ptr, src, dst, first + i, channels, channel_ok, stride_mt, stride_slot,
                     stride_row, K)
