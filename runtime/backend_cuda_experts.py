"""Routed experts on the CUDA backend (runtime/backend_cuda.py's CudaBackend is a CudaExperts):

* `route_softmax_topk`: a softmax router's softmax, top-k and renormalisation in one launch
  (kernels_triton.softmax_topk), one program per row.
* `route_grouped`: a router with a selection bias, expert groups and scales (sigmoid or softmax
  scores: DeepSeek-V3, GLM-4.5, Gemma 4, Qwen3-MoE without renormalisation) in one launch
  (kernels_triton.grouped_topk), one program per row.
* `add_gated_shared`, `add_shared`: a MoE block's routed sum plus its (sigmoid-gated) shared
  expert, one launch. `moe_out`: by pairs, the un-gated shared experts' add and the rounding into
  the compute dtype inside the combine launch (no launch of their own).
* `moe`: decode and verification batches (up to GATHER_MAX_ROWS rows) of stored experts of a
  KERNEL_TYPE pair every row with each of its k experts and run experts.ffn once over the n·k
  pairs, each product `kernels_triton.expert_matmul` (one launch: the expert index read on the
  device, no gathered copy of the experts' bytes or of x; gate and up together,
  `expert_matmul_pair`, where `linear_group` gets both); the pairs' outputs summed per row in
  increasing expert order by `kernels_triton.moe_combine` (one launch), as the torch reference's
  by-index form sums them, with the same bits. Longer batches and other weights take the torch
  reference. `PairedExperts` stands for an expert tensor read by pairs: CudaBackend.linear,
  linear_glu and linear_group take it.
"""

from __future__ import annotations

import torch

from specconv.archs import names
from specconv.runtime.backend import Experts
from specconv.runtime.backend_cuda_base import KERNEL_DTYPES, CudaKernelBase
from specconv.runtime.backend_torch import GATHER_MAX_ROWS
from specconv.runtime.stored import StoredWeight


class CudaExperts(CudaKernelBase):
    """The routers, the routed experts by pairs and the shared experts' adds."""

    def moe(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: Experts) -> torch.Tensor:
        if self._pairs_fit(x, weights, experts):
            return self.moe_by_pairs(x, weights, chosen, experts)
        return super().moe(x, weights, chosen, experts)

    def moe_out(self, x, weights, chosen, experts: Experts, shared=None, shared_gate=None) -> torch.Tensor:
        """By pairs, the shared experts' add (gated by σ(shared_gate) where given) and the rounding
        into x's dtype inside the combine launch (shared: x's dtype and shape [n, out], shared_gate
        float32 [n, 1], on x's device)."""
        width = experts.down.shape[1]
        if self._pairs_fit(x, weights, experts) and (shared is None or (
                shared.dtype == x.dtype and shared.device == x.device and shared.shape == (x.shape[0], width))) and (
                shared_gate is None or (shared is not None and shared_gate.dtype == torch.float32
                                        and shared_gate.device == x.device and shared_gate.shape == (x.shape[0], 1))):
            return self.moe_by_pairs(x, weights, chosen, experts, shared, x.dtype, shared_gate)
        return super().moe_out(x, weights, chosen, experts, shared, shared_gate)

    def _pairs_fit(self, x: torch.Tensor, weights: torch.Tensor, experts: Experts) -> bool:
        """Whether moe_by_pairs takes the batch: decode / verification rows, stored experts of a kernel type."""
        stored = [w for w in (experts.gate, experts.up, experts.down) if w is not None]
        return (0 < x.shape[0] <= GATHER_MAX_ROWS and x.dtype in KERNEL_DTYPES and weights.dtype in KERNEL_DTYPES
                and all(isinstance(w, StoredWeight) and w.ndim == 3 and self._kernel_for(w.raw, w.qtype)
                        and w.raw.device == x.device and self.kernels.result_dtype(w.qtype, x.dtype) == x.dtype
                        for w in stored))

    def route_softmax_topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch (kernels_triton.softmax_topk) for float32 logits of up to MAX_ROUTED_EXPERTS
        experts: the chosen set is the reference's where no logits tie (a tie: the lowest index)."""
        if not (self._pointwise(logits, dtypes=(torch.float32,)) and logits.dim() == 2
                and 0 < k <= logits.shape[-1] <= self.kernels.MAX_ROUTED_EXPERTS):
            return super().route_softmax_topk(logits, k)
        return self.kernels.softmax_topk(logits.contiguous(), k)

    def route_grouped(self, logits, k, gating, bias=None, groups=1, groups_used=1, renormalise=True, scale=1.0,
                      expert_scale=None):
        """One launch (kernels_triton.grouped_topk) for float32 logits of up to MAX_ROUTED_EXPERTS experts
        and float32 bias / expert scale vectors on their device: the reference's chosen experts
        (equal choices: the lowest index) wherever the kernel's scores have its bits."""
        n_experts = logits.shape[-1] if logits.dim() == 2 else 0
        vectors = [t for t in (bias, expert_scale) if t is not None]
        grouped = groups is not None and groups > 1 and groups_used != groups
        if not (self._pointwise(logits, *vectors, dtypes=(torch.float32,)) and 0 < k <= n_experts
                and n_experts <= self.kernels.MAX_ROUTED_EXPERTS and all(t.shape == (n_experts,) for t in vectors)
                and gating in (names.EXPERT_GATING_SIGMOID, names.EXPERT_GATING_SOFTMAX)
                and (not grouped or (n_experts % groups == 0 and n_experts // groups >= 2
                                     and 0 < groups_used < groups and k <= groups_used * (n_experts // groups)))):
            return super().route_grouped(logits, k, gating, bias, groups, groups_used, renormalise, scale, expert_scale)
        bias, expert_scale = (None if t is None else t.contiguous() for t in (bias, expert_scale))
        return self.kernels.grouped_topk(logits.contiguous(), k, gating == names.EXPERT_GATING_SIGMOID, bias,
                                         groups=groups if grouped else 1, groups_used=groups_used if grouped else 1,
                                         renormalise=renormalise, scale=scale, expert_scale=expert_scale)

    def add_shared(self, routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """One launch (kernels_triton.add_shared) for a float32 routed sum."""
        if not (self._pointwise(shared) and self._pointwise(routed, dtypes=(torch.float32,)) and shared.dim() == 2
                and routed.shape == shared.shape and routed.device == shared.device):
            return super().add_shared(routed, shared)
        return self.kernels.add_shared(routed.contiguous(), shared.contiguous())

    def add_gated_shared(self, routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """One launch (kernels_triton.add_gated_shared) for float32 routed sums and gate logits."""
        if not (self._pointwise(shared) and self._pointwise(routed, gate, dtypes=(torch.float32,))
                and shared.dim() == 2 and routed.shape == shared.shape and gate.shape == (shared.shape[0], 1)
                and routed.device == gate.device == shared.device):
            return super().add_gated_shared(routed, shared, gate)
        return self.kernels.add_gated_shared(routed.contiguous(), shared.contiguous(), gate.contiguous())

    def moe_by_pairs(self, x, weights, chosen, experts: Experts, shared=None,
                     out_dtype: torch.dtype = torch.float32, shared_gate=None) -> torch.Tensor:
        """Every (row, slot) pair through its expert at once: experts.ffn over the n·k pairs in row-major
        order, each product expert_matmul (the first ones read each row of x once for its k pairs);
        then kernels_triton.moe_combine adds a row's terms in increasing expert order, as the by-index
        reference does (then `shared`, gated by σ(shared_gate) where given, rounded into out_dtype:
        moe_out). No sort, gather or repeated copy of x: one launch per product, one to combine."""
        pairs = chosen.reshape(-1)
        y = experts.ffn(x, *(None if w is None else PairedExperts(w, pairs)
                             for w in (experts.gate, experts.up, experts.down)))
        return self.kernels.moe_combine(y.reshape(pairs.shape[0], -1), weights.contiguous(), chosen.contiguous(),
                                        None if shared is None else shared.contiguous(), out_dtype,
                                        None if shared_gate is None else shared_gate.contiguous())


class PairedExperts:
    """One weight per pair: pair r is multiplied by expert pairs[r] of a stored 3-D expert tensor
    [E, out, in] (what CudaBackend.moe_by_pairs hands experts.ffn in place of one expert's 2-D
    slice). Only CudaBackend.linear takes it, with activations of one row per pair, or of one row per
    P / rows consecutive pairs (x itself, before the first product: [P, out] out either way)."""

    __slots__ = ("experts", "pairs")
    ndim = 2

    def __init__(self, experts: StoredWeight, pairs: torch.Tensor):
        self.experts, self.pairs = experts, pairs

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.experts.shape[1:])

    def pairs_with(self, other: "PairedExperts") -> bool:
        """Whether expert_matmul_pair takes both: the same pairs, expert tensors of one type and layout."""
        a, b = self.experts, other.experts
        return (self.pairs is other.pairs and a.qtype == b.qtype and a.shape == b.shape
                and a.raw.shape == b.raw.shape and a.raw.stride() == b.raw.stride() and a.raw.device == b.raw.device)

    def rows_of(self, x: torch.Tensor, *others: "PairedExperts") -> tuple[torch.Tensor, int]:
        """(x as [rows, in], pairs per row), counting the read experts' bytes (where a counter is attached)."""
        for w in (self, *others):
            if w.experts.counter is not None:
                w.experts.counter.bytes += w.experts.raw[0].numel() * w.pairs.shape[0]
        xs = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, self.shape[1])  # row strides kept
        return xs, (self.pairs.shape[0] // xs.shape[0] if xs.shape[0] else 1)
