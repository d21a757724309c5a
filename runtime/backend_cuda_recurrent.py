"""Gated DeltaNet on the CUDA backend (runtime/backend_cuda.py's CudaBackend is a CudaRecurrence):

* Gated DeltaNet states in ring slots (`slot_states`): `causal_conv_slots` and `delta_rule_slots`
  run kernels_triton.causal_conv / gdn_step, one launch each for up to MAX_TOKENS tokens, reading
  the state before the batch from its slot and writing each kept token's state into its own slot
  (slot indices as device tensors: nothing read on the host, a rollback picks a slot). Longer
  inputs take kernels_triton.gdn_chunked for the delta rule (chunks of 64 tokens, one launch) and
  the torch conv; inside `batch_invariant(True)` only a prompt's prefix does (`prompt_prefix`),
  other long batches take the kernels in pieces of MAX_TOKENS tokens, so that each of their tokens
  gets the bits of a decode step. float64 states take the torch forms.
  `delta_rule_from_conv_slots` hands gdn_step the conv's q, k
  and the gates' projections as they are: the L2 norms and the gates are computed in its launch
  (the bits of the separate kernels under the interpreter). `conv_delta_rule_slots` folds the
  conv in as well (gdn_step's `conv=`) for a batch of up to MAX_TOKENS whose source slot is not a
  destination (gdn.Recurrence: the memory's spare slot), and both fold the layer's gated output
  norm (gdn_step's `gated_norm=`, the bits of `gated_rms_norm`'s kernel) where that kernel would
  take it: the mixer is one launch between its products.
"""

from __future__ import annotations

import torch

from specconv.runtime.backend import prompt_prefix, rows_alone
from specconv.runtime.backend_cuda_base import KERNEL_DTYPES, CudaKernelBase, joined_rows
from specconv.runtime.graphs import gdn
from specconv.runtime.graphs.ops import dense
from specconv.runtime.stored import StoredWeight


class CudaRecurrence(CudaKernelBase):
    """The short causal conv and the delta rule, their states in ring slots."""

    def _recurrent_kernels(self, ring: torch.Tensor, *tensors: torch.Tensor) -> bool:
        """Whether the Triton recurrent kernels take a float32 ring and these inputs."""
        return (self.kernels is not None and ring.device.type in self.device_types and ring.dtype == torch.float32
                and all(t.dtype in KERNEL_DTYPES for t in tensors))

    def _recurrent_pieces(self, n: int, ring: torch.Tensor, *tensors: torch.Tensor) -> bool:
        """Whether the Triton recurrent kernels take these n tokens (in pieces where n > MAX_TOKENS)."""
        return self._recurrent_kernels(ring, *tensors) and (n <= self.kernels.MAX_TOKENS or rows_alone())

    def _chunked(self, n: int, ring: torch.Tensor, *tensors: torch.Tensor) -> bool:
        """Whether n tokens take the chunked kernel (kernels_triton.gdn_chunked, one launch): more than a
        gdn_step launch holds, outside batch-invariant mode or in a prompt's prefix
        (backend.prompt_prefix, evaluated alike by plain and speculative decoding). Other long batches
        in batch-invariant mode — a verification of more than MAX_TOKENS - 1 drafts, its re-evaluation
        after a checkpoint rollback — keep gdn_step's per-token bits, as the decode steps they must
        equal."""
        return (self._recurrent_kernels(ring, *tensors) and n > self.kernels.MAX_TOKENS
                and (not rows_alone() or prompt_prefix()))

    def causal_conv_slots(self, m, ring, weight, src_slot, dst_slots):
        n = m.shape[0]
        if not (self._recurrent_pieces(n, ring, m) and ring.shape[1] >= 1):
            return super().causal_conv_slots(m, ring, weight, src_slot, dst_slots)
        values = weight.dense(torch.float32) if isinstance(weight, StoredWeight) else weight.to(torch.float32)
        return joined_rows([self.kernels.causal_conv(m[a:b], ring, values, src, dst)
                        for a, b, src, dst in ring_pieces(n, self.kernels.MAX_TOKENS, src_slot, dst_slots)])

    def delta_rule_slots(self, q, k, v, g, beta, ring, src_slot, dst_slots, key_heads: str = gdn.TILED):
        """The kernel reads each value head's key head (`key_heads` layout) and every input in its
        dtype: q, k with the key heads only and v in the compute dtype need no copy first."""
        n = q.shape[0]
        group = v.shape[1] // q.shape[1] if key_heads == gdn.GROUPED else 1  # value heads per key head, in order
        if self._chunked(n, ring, q, k, v, g, beta):
            return self.kernels.gdn_chunked(q, k, v, g, beta, ring, src_slot, dst_slots, group=group)
        if not self._recurrent_pieces(n, ring, q, k, v, g, beta):
            return super().delta_rule_slots(q, k, v, g, beta, ring, src_slot, dst_slots, key_heads)
        pieces = ring_pieces(n, self.kernels.MAX_TOKENS, src_slot, dst_slots)
        return joined_rows([self.kernels.gdn_step(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], ring, src, dst,
                                                  group=group) for a, b, src, dst in pieces])


    def delta_rule_from_conv_slots(self, q, k, v, b, alpha, a, dt_bias, eps: float, scale: float, ring,
                                   src_slot, dst_slots, key_heads: str = gdn.TILED, gated_norm=None):
        """One gdn_step launch (per piece of MAX_TOKENS) with q and k's norms and the gates in it, and
        the output norm where `gated_norm` is given and `_folded_norm` takes it; b, alpha [n, nv] or
        Qwen3-Next's [n, nk, r] views read through their strides."""
        n = q.shape[0]
        weights = tuple(dense(w, torch.float32) for w in (a, dt_bias))
        # a long batch the chunked kernel takes: the norms and gates first (their kernels), then it
        if self._chunked(n, ring, q, k, v, b, alpha) or not (
                self._recurrent_pieces(n, ring, q, k, v, b, alpha) and b.dim() in (2, 3) and b.shape == alpha.shape
                and all(w.device == q.device for w in weights)
                and all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (q, k, b, alpha))):
            return super().delta_rule_from_conv_slots(q, k, v, b, alpha, a, dt_bias, eps, scale, ring, src_slot,
                                                      dst_slots, key_heads, gated_norm)
        group = v.shape[1] // q.shape[1] if key_heads == gdn.GROUPED else 1
        folded = self._folded_norm(v, gated_norm)
        out = joined_rows([self.kernels.gdn_step(q[start:end], k[start:end], v[start:end], alpha[start:end],
                                             b[start:end], ring, src, dst, group=group, eps=eps, scale=scale,
                                             gate_weights=weights, gated_norm=_rows(folded, start, end))
                       for start, end, src, dst in ring_pieces(n, self.kernels.MAX_TOKENS, src_slot, dst_slots)])
        return self._normed_apart(out, gated_norm, folded)

    def conv_delta_rule_slots(self, m, windows, conv_weight, heads, b, alpha, a, dt_bias, eps: float, scale: float,
                              ring, src_slot, dst_slots, key_heads: str = gdn.TILED, gated_norm=None):
        """The conv folded into gdn_step's launch too (`conv=`), and the output norm where `gated_norm`
        is given and `_folded_norm` takes it: one launch for the mixer between its products, for a
        batch of one launch (MAX_TOKENS: a longer one reads ring_pieces' scratch slot it writes)."""
        n = m.shape[0]
        q, k, v = gdn.qkv_heads(m, heads)
        values = dense(conv_weight, torch.float32)
        weights = tuple(dense(w, torch.float32) for w in (a, dt_bias))
        if not (n <= self.kernels.MAX_TOKENS and self._recurrent_pieces(n, ring, m, b, alpha)
                and windows.dtype == torch.float32 and windows.device == ring.device and windows.shape[1] >= 1
                and m.stride(-1) == 1 and b.dim() in (2, 3) and b.shape == alpha.shape
                and all(w.device == m.device for w in (values,) + weights)
                and all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in (b, alpha))):
            return super().conv_delta_rule_slots(m, windows, conv_weight, heads, b, alpha, a, dt_bias, eps, scale, ring,
                                                 src_slot, dst_slots, key_heads, gated_norm)
        group = heads[2] // heads[0] if key_heads == gdn.GROUPED else 1
        folded = self._folded_norm(v, gated_norm)
        out = self.kernels.gdn_step(q, k, v, alpha, b, ring, src_slot, dst_slots, group=group, eps=eps, scale=scale,
                                    gate_weights=weights, conv=(windows, values), gated_norm=folded)
        return self._normed_apart(out, gated_norm, folded)

    def _folded_norm(self, v: torch.Tensor, gated_norm):
        """gated_norm = (weight, gate, eps, out_dtype) as gdn_step's `gated_norm=` takes it (the
        weight's float32 values), or None where the norm kernel would not take it: the rule's o is
        then normed by `gated_rms_norm` (`_normed_apart`). v [n, nv, dv] stands for o's shape."""
        if gated_norm is None:
            return None
        weight, gate, eps, out_dtype = gated_norm
        values = self._norm_weight(weight, v) if self._norm_fits(v) and self._pointwise(v, gate) else False
        if (values is False or values is None or gate.shape != v.shape or out_dtype not in (None,) + KERNEL_DTYPES
                or (gate.shape[-1] > 1 and gate.stride(-1) != 1)):
            return None
        return values, gate, eps, out_dtype

    def _normed_apart(self, out: torch.Tensor, gated_norm, folded) -> torch.Tensor:
        """gdn_step's result: y where the norm was folded in, else o (normed here where asked)."""
        return out if gated_norm is None or folded is not None else self.gated_rms_norm(out, *gated_norm)


def _rows(gated_norm, start: int, end: int):
    """gdn_step's `gated_norm=` for the piece of tokens start..end-1: its gate's rows."""
    if gated_norm is None:
        return None
    weight, gate, eps, out_dtype = gated_norm
    return weight, gate[start:end], eps, out_dtype


def ring_pieces(n: int, step: int, src_slot: torch.Tensor, dst_slots: torch.Tensor):
    """(start, end, source slot, destination slots) of n tokens cut into pieces of at most `step`, for
    a kernel that reads the state before its piece from one slot and writes the states after the
    piece's last len(destinations) tokens: the batch's kept tokens (its last len(dst_slots)) go to
    their own slots; a piece holding none of them leaves its last state in the batch's last
    destination slot, which the next piece reads and the last kept token finally overwrites. The
    slots stay device tensors (slices: no host read)."""
    keep = dst_slots.shape[0]
    first_kept = n - keep
    scratch = dst_slots[keep - 1:]
    source = src_slot
    for a in range(0, n, step):
        b = min(a + step, n)
        if b <= first_kept:
            yield a, b, source, scratch
            source = scratch
        else:
            lo = max(a, first_kept) - first_kept
            yield a, b, source, dst_slots[lo:b - first_kept]
            source = dst_slots[b - 1 - first_kept:b - first_kept]
