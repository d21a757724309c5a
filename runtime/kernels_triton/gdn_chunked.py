"""The gated delta rule for long inputs (prompts) in one Triton launch, in its chunked (WY) form.

    gdn_chunked(q, k, v, g, beta, states, src_slot, dst_slots, out=None, group=1) -> o [n, nv, dv]

Inputs as gdn_step takes them (runtime/kernels_triton/gdn.py: q, k [n, nk, dk] with the key heads
in the tiled (`group=1`) or grouped (`group=nv/nk`) layout, v [n, nv, dv], g, beta [n, nv], each in
any float dtype, read into float32; states [slots, nv, dk, dv] float32, the sequence's ring), any
n ≥ 1. The state before the batch is read from slot `src_slot`, the state after token n − keep + i
written to slot `dst_slots[i]` (keep = len(dst_slots) ≤ n), slots as int64 device tensors or ints.

The tokens go through chunks of CHUNK in order (runtime/graphs/gdn.py `chunked_delta_rule`'s
formulas, _chunked_jit.py), each chunk's products on [CHUNK, dk] tiles: one launch for the whole
input, where gdn_step takes MAX_TOKENS tokens a launch. The sums run in another order than the
recurrence's, so a token's bits depend on its chunk: the CUDA backend takes this form for prompts
only (runtime/backend_cuda_recurrent.py `delta_rule_slots`). Outputs and the final state do not depend on
`keep`; the kept states before the last are computed besides (one product each).
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common
from specconv.runtime.kernels_triton.gdn import slots_and_out

CHUNK = 64  # tokens per chunk, as runtime/graphs/gdn.py CHUNK
BLOCK_V = 32  # state columns per program
PRECISION = "ieee"  # float32 products: TF32's 10-bit operands would be the error's largest part
NUM_WARPS = 8  # a chunk's [64, dk] tiles of k, q and W in registers at once


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                states: torch.Tensor, src_slot, dst_slots, out: torch.Tensor | None = None,
                group: int = 1) -> torch.Tensor:
    op = "gdn_chunked"
    if q.dim() != 3 or v.dim() != 3 or states.dim() != 4:
        raise SpecconvError(f"{op}: expected q, k [n, nk, dk], v [n, nv, dv], states [slots, nv, dk, dv] "
                            f"(got q {tuple(q.shape)}, v {tuple(v.shape)}, states {tuple(states.shape)})")
    n, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    for name, t, shape in (("k", k, (n, nk, dk)), ("v", v, (n, nv, dv)), ("g", g, (n, nv)), ("beta", beta, (n, nv)),
                           ("states", states, (states.shape[0], nv, dk, dv))):
        _common.check_shape(op, name, t, shape)
    if n == 0 or nk == 0 or nv % nk:
        raise SpecconvError(f"{op}: {n} tokens (one or more) and {nv} value heads over {nk} key heads")
    if group not in (1, nv // nk):
        raise SpecconvError(f"{op}: group must be 1 (tiled heads) or {nv // nk} (grouped heads), got {group}")
    if states.dtype != torch.float32:
        raise SpecconvError(f"{op}: states must be float32 (got {states.dtype})")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    _common.check_last_contiguous(op, "states", states)
    _common.check_device(op, q, k, v, g, beta, states)
    src, dst, out = slots_and_out(op, src_slot, dst_slots, states, q, out, n, nv, dv)
    keep = dst.shape[0]
    jit = _common.jit_module("_chunked_jit")
    grid = (nv, _common.cdiv(dv, BLOCK_V))
    jit.gdn_chunked_kernel[grid](q, k, v, g, beta, states, src, dst, out, n, keep, nk, group, dk, dv,
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 g.stride(0), beta.stride(0), states.stride(0), states.stride(1), states.stride(2),
                                 out.stride(0), out.stride(1),
                                 CHUNK=CHUNK, BLOCK_K=_common.dot_width(dk), BLOCK_V=BLOCK_V,
                                 PRECISION=PRECISION, num_warps=NUM_WARPS)
    return out
