"""The Triton kernel of runtime/kernels_triton/indexer.py (imported on first use; needs Triton).

Program (row r, block b): the keys of cells b·BLOCK_T .. b·BLOCK_T + BLOCK_T − 1 read once, then for
each indexer head j in increasing order the score's term weights[r, j] · ReLU((q[r, j] · key) · scale)
added in float32: the same operations in the same order whatever the number of rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def index_scores_kernel(q_ptr, w_ptr, keys_ptr, out_ptr, cells, heads, d, scale, w_scale, stride_qn, stride_qh,
                        stride_wn, stride_kt, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """scores[r, t] = Σ_j (w[r, j] · w_scale) · ReLU((q[r, j] · keys[t]) · scale) for the block's cells t,
    into out (contiguous [n, cells] float32)."""
    r = tl.program_id(0)
    ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ds = tl.arange(0, BLOCK_D)
    t_ok = ts < cells
    d_ok = ds < d
    keys = tl.load(keys_ptr + ts[:, None].to(tl.int64) * stride_kt + ds[None, :], mask=t_ok[:, None] & d_ok[None, :],
                   other=0.0).to(tl.float32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    for j in range(heads):
        q = tl.load(q_ptr + r * stride_qn + j * stride_qh + ds, mask=d_ok, other=0.0).to(tl.float32)
        s = tl.sum(keys * q[None, :], axis=1) * scale
        w = tl.load(w_ptr + r * stride_wn + j) * w_scale
        total = total + w * tl.maximum(s, 0.0)
    tl.store(out_ptr + r.to(tl.int64) * cells + ts, total, mask=t_ok)
