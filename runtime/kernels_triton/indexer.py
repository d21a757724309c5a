"""The lightning indexer's scores of DeepSeek Sparse Attention (runtime/graphs/dsa.py) in one Triton launch.

    index_scores(q, weights, keys, scale, weight_scale=1.0) -> [n, cells] float32

q [n, heads, D] (float32 / bfloat16 / float16, the last dimension contiguous): each query row's
indexer heads, roped; weights [n, heads] float32 (the heads' weights, w_j(t) = weights[t, j] ·
weight_scale rounded to float32, as the product of a float32 tensor and a number is); keys
[cells, D] (the indexer keys of a layer's whole cache buffer, read through their row stride: a
slice of the cache rows). scores[t, s] = Σ_j w_j(t) · ReLU((q[t, j] · keys[s]) · scale), float32,
the heads added in increasing order — docs/dsa.md's I(t, s).

One program per (query row, block of cells): the block's keys are read once and multiplied with
every head of the row, so a row's scores are the same bits alone or in a batch of any width, and
the launch has the same shape at every step (CUDA-graph capture). Cells no query sees get scores
too (the caller's selection masks them).
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common

MAX_INDEX_DIM = 512  # one program holds a block of keys this wide
TILE = 8192  # values of one block of keys: BLOCK_T · the padded width


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float,
                 weight_scale: float = 1.0) -> torch.Tensor:
    op = "index_scores"
    if q.dim() != 3 or weights.dim() != 2 or keys.dim() != 2:
        raise SpecconvError(f"{op}: expected q [n, heads, D], weights [n, heads], keys [cells, D] "
                            f"(got {tuple(q.shape)}, {tuple(weights.shape)}, {tuple(keys.shape)})")
    n, heads, d = q.shape
    cells = keys.shape[0]
    _common.check_shape(op, "weights", weights, (n, heads))
    _common.check_shape(op, "keys", keys, (cells, d))
    if not 0 < d <= MAX_INDEX_DIM:
        raise SpecconvError(f"{op}: index head dimension {d} (1 to {MAX_INDEX_DIM})")
    for name, t in (("q", q), ("keys", keys)):
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    if weights.dtype != torch.float32 or (heads > 1 and weights.stride(1) != 1):
        raise SpecconvError(f"{op}: weights must be float32 [n, heads] with contiguous rows (got {weights.dtype})")
    device = _common.check_device(op, q, weights, keys)
    out = torch.empty(n, cells, dtype=torch.float32, device=device)
    if n * cells == 0:
        return out
    block_d = _common.next_power_of_2(d)
    block_t = max(16, min(128, TILE // block_d))
    jit = _common.jit_module("_indexer_jit")
    jit.index_scores_kernel[(n, _common.cdiv(cells, block_t))](
        q, weights, keys, out, cells, heads, d, float(scale), float(weight_scale), q.stride(0), q.stride(1),
        weights.stride(0),
        keys.stride(0), BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False)
    return out
