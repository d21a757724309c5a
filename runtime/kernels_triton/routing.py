"""The MoE softmax router in one Triton launch.

    softmax_topk(logits, k) -> (weights float32 [n, k], chosen int64 [n, k])

logits [n, E] (float32 / bfloat16 / float16, the last dimension contiguous, E ≤ MAX_EXPERTS):
p = softmax(logits) over the experts in float32, the k experts of largest p, and their weights
p / Σ of the chosen k p (runtime/graphs/ops.py `moe_softmax_topk`, docs/reference/model-math.md
§3.1). The experts are picked by their logits (softmax keeps their order), in decreasing order,
and among equal logits the lowest index first: torch.topk orders no ties (on the CPU it may return
a higher index of a tie before a lower one), so on inputs without ties the chosen set is torch's,
and the weights are within a few float32 ulps of its softmax / topk / sum / divide. One program per
row (batch-invariant).
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common

MAX_EXPERTS = 1024  # a row's experts are one program's block; more take the torch reference


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
