"""The MoE routers and the sum of the routed experts' outputs, one Triton launch each.

    softmax_topk(logits, k) -> (weights float32 [n, k], chosen int64 [n, k])
    grouped_topk(logits, k, sigmoid, bias=None, groups=1, groups_used=1, renormalise=True, scale=1.0,
                 expert_scale=None) -> (weights float32 [n, k], chosen int64 [n, k])
    moe_combine(y, weights, chosen, shared=None, out_dtype=float32, shared_gate=None) -> [n, out] in out_dtype
    add_gated_shared(routed, shared, gate) -> [n, out] in shared's dtype
    add_shared(routed, shared) -> [n, out] in shared's dtype

logits [n, E] (float32 / bfloat16 / float16, the last dimension contiguous, E ≤ MAX_EXPERTS):
p = softmax(logits) over the experts in float32, the k experts of largest p, and their weights
p / Σ of the chosen k p (runtime/graphs/ops.py `moe_softmax_topk`, docs/reference/model-math.md
§3.1). The experts are picked by their logits (softmax keeps their order), in decreasing order,
and among equal logits the lowest index first: torch.topk orders no ties (on the CPU it may return
a higher index of a tie before a lower one), so on inputs without ties the chosen set is torch's,
and the weights are within a few float32 ulps of its softmax / topk / sum / divide. One program per
row (batch-invariant).

grouped_topk: the router of DeepSeek-V3 / GLM-4.5 and of the families that share its formula
(runtime/backend_torch.py `route_grouped`, docs/reference/model-math.md §3.2): float32 logits
[n, E] (E ≤ MAX_EXPERTS), scores s = σ(logits) (`sigmoid`) or softmax(logits) in float32, the
choice c = s + bias (bias float32 [E], selection only); with groups_used < groups (groups
dividing E, at least two experts each) every group of E / groups consecutive experts scores the
sum of its two largest c and only the groups_used best stay eligible; the k experts of largest c
in decreasing order, among equal c the lowest index first (the reference's rule: a stable sort,
not torch.topk, whose order of ties on the CPU is the C++ library's); weights: their s,
renormalised by (Σ s + 1e-20) when asked, times expert_scale[expert] (float32 [E], Gemma 4's
per-expert scale) where given, times `scale`. One program per row (batch-invariant). The chosen
experts are the reference's where the kernel's σ / softmax give the same float32 scores (equal
logits: equal scores, so ties are reproduced); a score one ulp away can reorder two experts whose
choices differ by less than that ulp. Weights: within a few float32 ulps (exp and the sums of the
softmax and of the renormalisation in another order).

moe_combine: y [n·k, out] the outputs of each row's k (row, slot) pairs, row-major (float32 /
bfloat16 / float16, the last dimension contiguous), weights [n, k] float, chosen [n, k] integer
distinct experts per row: Σ over the slots of float32(y) · weight, added in increasing expert
order from 0 in float32 (CudaBackend.moe_by_pairs: the torch reference's by-index sum, its bits);
then float32(shared) [n, out] added where given (un-gated shared experts), the float32 result
rounded once into out_dtype (the torch formula's `(routed + acc(shared)).to(dtype)`). With
`shared_gate` (float32 logits [n, 1]) the shared expert is gated instead: add_gated_shared's
formula on the float32 routed sum, in the same launch.

add_gated_shared: a MoE block's output with its sigmoid-gated shared expert (Qwen3.5): routed
[n, out] (the float32 sum of the routed experts) rounded into shared's dtype, plus shared [n, out]
· σ(gate[r]) in float32 rounded into that dtype (gate [n, 1] float32 logits), the sum rounded
again: the torch formula's three roundings, its σ within a few float32 ulps.

add_shared: a MoE block's output with its un-gated shared experts (DeepSeek, GLM): routed [n, out]
float32 plus shared [n, out] widened to float32, the sum rounded once into shared's dtype (the torch
formula's bits).
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common

MAX_EXPERTS = 1024  # a row's experts are one program's block; more take the torch reference
COMBINE_BLOCK = 1024  # output columns per program of moe_combine and add_gated_shared


def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    op = "softmax_topk"
    _common.check_float(op, "logits", logits)
    if logits.dim() != 2:
        raise SpecconvError(f"{op}: expected logits [n, experts] (got {tuple(logits.shape)})")
    n, n_experts = logits.shape
    if not 0 < k <= n_experts <= MAX_EXPERTS:
        raise SpecconvError(f"{op}: need 0 < k ≤ experts ≤ {MAX_EXPERTS} (got k={k}, {n_experts} experts)")
    _common.check_last_contiguous(op, "logits", logits)
    device = _common.check_device(op, logits)
    weights = torch.empty(n, k, dtype=torch.float32, device=device)
    chosen = torch.empty(n, k, dtype=torch.int64, device=device)
    if n == 0:
        return weights, chosen
    jit = _common.jit_module("_routing_jit")
    jit.softmax_topk_kernel[(n,)](logits, weights, chosen, n_experts, logits.stride(0), K=k,
                                  BLOCK=_common.next_power_of_2(n_experts), BLOCK_K=_common.next_power_of_2(k),
                                  enable_fp_fusion=False)
    return weights, chosen


def grouped_topk(logits: torch.Tensor, k: int, sigmoid: bool, bias: torch.Tensor | None = None, groups: int = 1,
                 groups_used: int = 1, renormalise: bool = True, scale: float = 1.0,
                 expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    op = "grouped_topk"
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise SpecconvError(f"{op}: expected float32 logits [n, experts] (got {logits.dtype} {tuple(logits.shape)})")
    n, n_experts = logits.shape
    if not 0 < k <= n_experts <= MAX_EXPERTS:
        raise SpecconvError(f"{op}: need 0 < k ≤ experts ≤ {MAX_EXPERTS} (got k={k}, {n_experts} experts)")
    grouped = groups_used < groups  # all groups kept: no group limit
    if (groups < 1 or not 0 < groups_used <= groups or n_experts % groups
            or (grouped and (n_experts // groups < 2 or k > groups_used * n_experts // groups))):
        raise SpecconvError(f"{op}: {n_experts} experts do not split into {groups} groups of at least two with "
                            f"{k} experts among the {groups_used} kept")
    vectors = [(name, t) for name, t in (("bias", bias), ("expert_scale", expert_scale)) if t is not None]
    for name, t in vectors:
        if t.dtype != torch.float32:
            raise SpecconvError(f"{op}: {name} must be float32 (got {t.dtype})")
        _common.check_shape(op, name, t, (n_experts,))
        _common.check_last_contiguous(op, name, t)
    _common.check_last_contiguous(op, "logits", logits)
    device = _common.check_device(op, logits, *(t for _, t in vectors))
    weights = torch.empty(n, k, dtype=torch.float32, device=device)
    chosen = torch.empty(n, k, dtype=torch.int64, device=device)
    if n == 0:
        return weights, chosen
    n_groups = groups if grouped else 1
    group_size = n_experts // n_groups
    jit = _common.jit_module("_routing_jit")
    jit.grouped_topk_kernel[(n,)](logits, logits if bias is None else bias,
                                  logits if expert_scale is None else expert_scale, weights, chosen, n_groups,
                                  group_size, logits.stride(0), float(scale), K=k,
                                  GROUPS_USED=groups_used if grouped else 0, SIGMOID=bool(sigmoid),
                                  HAS_BIAS=bias is not None, HAS_ESCALE=expert_scale is not None,
                                  RENORMALISE=bool(renormalise), BLOCK_G=_common.next_power_of_2(n_groups),
                                  BLOCK_S=_common.next_power_of_2(group_size), BLOCK_K=_common.next_power_of_2(k),
                                  enable_fp_fusion=False)
    return weights, chosen


def moe_combine(y: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, shared: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    op = "moe_combine"
    if out_dtype not in _common.FLOAT_DTYPES:
        raise SpecconvError(f"{op}: out_dtype must be float32, bfloat16 or float16 (got {out_dtype})")
    if shared_gate is not None and (shared is None or shared_gate.dtype != torch.float32
                                    or shared_gate.shape != (weights.shape[0], 1)):
        raise SpecconvError(f"{op}: shared_gate is float32 [n, 1], with shared (got {shared_gate.dtype}, "
                            f"{tuple(shared_gate.shape)})")
    for name, t in (("y", y), ("weights", weights)) + ((("shared", shared),) if shared is not None else ()):
        _common.check_float(op, name, t)
    if weights.dim() != 2 or chosen.dtype not in (torch.int32, torch.int64):
        raise SpecconvError(f"{op}: expected weights [n, k] and integer chosen experts (got weights "
                            f"{tuple(weights.shape)}, chosen {chosen.dtype})")
    n, k = weights.shape
    _common.check_shape(op, "chosen", chosen, (n, k))
    if y.dim() != 2 or y.shape[0] != n * k:
        raise SpecconvError(f"{op}: y has shape {tuple(y.shape)}, expected [{n * k}, out]")
    for name, t in (("y", y), ("weights", weights), ("chosen", chosen)):
        _common.check_last_contiguous(op, name, t)
    width = y.shape[1]
    if shared is not None:
        _common.check_shape(op, "shared", shared, (n, width))
        _common.check_last_contiguous(op, "shared", shared)
    extra = tuple(t for t in (shared, shared_gate) if t is not None)
    device = _common.check_device(op, y, weights, chosen, *extra)
    out = torch.empty(n, width, dtype=out_dtype, device=device)
    if out.numel() == 0:
        return out
    block = min(COMBINE_BLOCK, _common.next_power_of_2(width))
    jit = _common.jit_module("_routing_jit")
    jit.combine_kernel[(n, _common.cdiv(width, block))](y, weights, chosen, out, y if shared is None else shared,
                                                        y if shared_gate is None else shared_gate, width,
                                                        y.stride(0), weights.stride(0), chosen.stride(0),
                                                        0 if shared is None else shared.stride(0),
                                                        0 if shared_gate is None else shared_gate.stride(0), K=k,
                                                        BLOCK_K=_common.next_power_of_2(max(k, 1)), BLOCK=block,
                                                        HAS_SHARED=shared is not None, GATED=shared_gate is not None,
                                                        enable_fp_fusion=False)
    return out


def add_gated_shared(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    op = "add_gated_shared"
    for name, t in (("routed", routed), ("shared", shared), ("gate", gate)):
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    if shared.dim() != 2:
        raise SpecconvError(f"{op}: expected shared [n, out] (got {tuple(shared.shape)})")
    n, width = shared.shape
    _common.check_shape(op, "routed", routed, (n, width))
    _common.check_shape(op, "gate", gate, (n, 1))
    device = _common.check_device(op, routed, shared, gate)
    y = torch.empty(n, width, dtype=shared.dtype, device=device)
    if y.numel() == 0:
        return y
    block = min(COMBINE_BLOCK, _common.next_power_of_2(width))
    jit = _common.jit_module("_routing_jit")
    jit.gated_shared_kernel[(n, _common.cdiv(width, block))](routed, shared, gate, y, width, routed.stride(0),
                                                             shared.stride(0), gate.stride(0), BLOCK=block,
                                                             enable_fp_fusion=False)
    return y


def add_shared(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    op = "add_shared"
    for name, t in (("routed", routed), ("shared", shared)):
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    if routed.dtype != torch.float32 or shared.dim() != 2:
        raise SpecconvError(f"{op}: expected float32 routed and shared [n, out] (got {routed.dtype}, "
                            f"{tuple(shared.shape)})")
    n, width = shared.shape
    _common.check_shape(op, "routed", routed, (n, width))
    device = _common.check_device(op, routed, shared)
    y = torch.empty(n, width, dtype=shared.dtype, device=device)
    if y.numel() == 0:
        return y
    block = min(COMBINE_BLOCK, _common.next_power_of_2(width))
    jit = _common.jit_module("_routing_jit")
    jit.shared_add_kernel[(n, _common.cdiv(width, block))](routed, shared, y, width, routed.stride(0), shared.stride(0),
                                                           BLOCK=block, enable_fp_fusion=False)
    return y
