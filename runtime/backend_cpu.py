"""The CPU backend with the optional native extension built (runtime/backend.py): the native
decoders (runtime/dequant_native.py), fused and chunked products of stored weights, and the native
Gated DeltaNet step and conv (runtime/gdn_native.py), for float32 activations; every other call
takes the torch reference it inherits.

The product of a stored matrix with float32 activations and a type the native dequantizer covers
(benchmarks/dequant_native.py, docs/runtime.md "Native dequantization"):
* a matrix of at most WHOLE_MAX_ELEMENTS values: dequantized whole and multiplied in one product
  (what a dense weight computes, bit for bit);
* a type with an 8-bit-activation kernel on this CPU (dequant_native.default_activations: Q8_0
  with AVX-512 VNNI) and up to FUSED_MAX_ROWS rows: that kernel, whose rows do not depend on each
  other (runtime/dq_dot_i8.inc);
* up to FUSED_MAX_ROWS rows of activations (decode, the check of k drafts, short prompts) and a
  type in FUSED_TYPES with a vector kernel on this CPU (dequant_native.has_fused_kernel: AVX-512
  or AVX2): the fused native kernel, which decodes each weight block once in registers and
  multiplies it with every row (up to 9 per pass over the weights; the float32 matrix is never
  written). Its sums are its own (FMA, vector lanes), so it equals the BLAS product within
  float32 summation noise. 16: measured faster than the chunked path below up to 16 rows
  (3584 x 1024 Q8_0 / Q4_K / Q6_K, one thread), level with it at 24;
* a mid-size matrix (up to stored.CHUNK_ELEMENTS values, an expert) with more rows: one product;
* otherwise: pieces of NATIVE_CHUNK_ELEMENTS values dequantized natively into one float32 buffer
  per thread, reused, which stays in the L2 cache while the BLAS product reads it.

Products left to the torch reference with 2 .. FUSED_MAX_ROWS float32 rows and a weight of at most
stored.CHUNK_ELEMENTS values (small matrices, routers, dense weights) run one row at a time: torch's
product of several rows rounds a row otherwise than its product of one row, and an 8-bit product
downstream would turn that last bit into another code, so a verification batch would not give the
bits of one-token decode steps.

A MoE layer always groups rows by expert (one product per routed expert over its rows): it reads
each routed expert's bytes once for the whole batch, which the fused kernel then multiplies with
every row routed to it.

In batch-invariant mode (backend.rows_alone) a native product takes one row per call (the fused
kernel's sums depend on how many rows it holds) and the delta rule one token per native step.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from specconv.runtime import dequant, dequant_native, gdn_native, stored
from specconv.runtime.backend import batch_invariant, rows_alone
from specconv.runtime.backend_torch import TorchBackend, token_by_token
from specconv.runtime.graphs import gdn
from specconv.runtime.placement import active_device
from specconv.runtime.stored import StoredWeight

WHOLE_MAX_ELEMENTS = 1 << 16
FUSED_MAX_ROWS = 16
FUSED_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
                         GGMLQuantizationType.Q6_K, GGMLQuantizationType.BF16, GGMLQuantizationType.F16})
NATIVE_CHUNK_ELEMENTS = 1 << 18


class _ThreadBuffers(threading.local):
    values: torch.Tensor | None = None  # this thread's float32 scratch (_chunk_buffer)


_buffers = _ThreadBuffers()


class NativeCpuBackend(TorchBackend):
    name = "cpu-native"

    # ---- weights ----------------------------------------------------------------------------------
    def dequantize_rows(self, raw: torch.Tensor, qtype, dtype: torch.dtype) -> torch.Tensor:
        """runtime/dequant.py's values (bit for bit) from the native decoders where they cover the type."""
        dequant.check_rows(raw, qtype, dtype)
        if not dequant.is_view(qtype, dtype):
            values = dequant_native.dequantize(raw, qtype)
            if values is not None:
                return values.to(dtype)
        return super().dequantize_rows(raw, qtype, dtype)

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        rows = x.numel() // w.shape[-1] if w.shape[-1] else 0
        if isinstance(w, StoredWeight) and w.ndim == 2 and w.numel() > WHOLE_MAX_ELEMENTS and _native(x, w):
            if rows <= FUSED_MAX_ROWS and dequant_native.default_activations(w.qtype) == "int8":
                return _native_product(x, w)  # no row split: a row's bits whatever the batch
            if rows_alone() and rows > 1:  # each row as in a one-row batch
                xs = x.reshape(rows, w.shape[1])
                return torch.cat([_native_product(xs[i:i + 1].clone(), w) for i in range(rows)]).reshape(
                    *x.shape[:-1], w.shape[0])
            if rows <= FUSED_MAX_ROWS or w.numel() > stored.CHUNK_ELEMENTS:
                return _native_product(x, w)
        if 1 < rows <= FUSED_MAX_ROWS and x.dtype == torch.float32 and w.numel() <= stored.CHUNK_ELEMENTS:
            with batch_invariant(True):  # torch's one-row products (a batch's changes a row's last bits)
                return super().linear(x, w)
        return super().linear(x, w)

    def moe(self, x, weights, chosen, experts):
        return self.moe_by_expert(x, weights, chosen, experts)

    # ---- Gated DeltaNet ---------------------------------------------------------------------------
    def causal_conv(self, m: torch.Tensor, conv_state: torch.Tensor, weight, keep: int):
        if gdn_native.conv_applies(m, conv_state, weight):  # decode and verification: one native call
            sums, states = gdn_native.conv_tokens(m, conv_state, weight, keep)
            return F.silu(sums), states
        return super().causal_conv(m, conv_state, weight, keep)

    def delta_rule(self, q, k, v, g, beta, state, keep: int, lazy: bool = False, out: torch.Tensor | None = None,
                   exact: bool = False):
        if exact and gdn_native.applies(q[:1], state, None):
            return token_by_token(_native_token, q, k, v, g, beta, state, keep)
        if not exact and lazy and gdn_native.applies(q, state, out):
            q, k, v, g, beta = (x.to(torch.float32).contiguous() for x in (q, k, v, g, beta))
            o, delta, last = gdn_native.delta_rule_tokens(q, k, v, g, beta, state, out=out)
            return o, gdn_native.NativePendingStates(state, q, k, v, g, beta, delta, q.shape[0] - keep, last)
        tail = gdn_native.MAX_TOKENS
        if not exact and lazy and keep <= tail < q.shape[0]:
            # a prompt: the chunked form up to its last `tail` tokens, the batched form over those,
            # whatever `keep`: split at n - keep (the torch backend's split), the state after a prompt
            # would depend on the snapshot ring's size, which plain and speculative decoding choose
            # differently, and 8-bit activation products downstream turn its last bits into codes
            head = q.shape[0] - tail
            o_head, mid = gdn.chunked_delta_rule(q[:head], k[:head], v[:head], g[:head], beta[:head], state)
            o_tail, pending = gdn.batched_delta_rule(q[head:], k[head:], v[head:], g[head:], beta[head:], mid,
                                                     keep=keep, lazy=True)
            return torch.cat([o_head, o_tail]), pending
        return super().delta_rule(q, k, v, g, beta, state, keep, lazy=lazy, out=out, exact=exact)


def _native_token(q, k, v, g, beta, state):
    """One token through the native step: (o [1, nv, dv], the state after it, a new tensor)."""
    o, _, after = gdn_native.delta_rule_tokens(q, k, v, g, beta, state)
    return o, after


def _native(x: torch.Tensor, w: StoredWeight) -> bool:
    """Whether this product runs from stored bytes on the CPU, in a type the native dequantizer
    covers, with float32 activations."""
    return (x.dtype == torch.float32 and w.raw.device.type == "cpu"
            and (active_device() or w.device).type == "cpu" and dequant_native.covers(w.qtype))


def _chunk_buffer(n: int) -> torch.Tensor:
    """This thread's float32 buffer for dequantized pieces, at least n values (grown, never shrunk)."""
    buffer = _buffers.values
    if buffer is None or buffer.numel() < n:
        buffer = _buffers.values = torch.empty(n, dtype=torch.float32)
    return buffer


def _native_product(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    n_out, n_in = w.shape
    raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
    if w.counter is not None:
        w.counter.bytes += raw.numel()
    rows = x.numel() // n_in if n_in else 0
    if rows <= FUSED_MAX_ROWS and w.qtype in FUSED_TYPES and dequant_native.has_fused_kernel(w.qtype):
        fused = dequant_native.matmul_t(x, raw, w.qtype, n_in)
        if fused is not None:
            return fused
    xs = x.reshape(-1, n_in)
    out = torch.empty(xs.shape[0], n_out, dtype=torch.float32)
    step = max(1, NATIVE_CHUNK_ELEMENTS // max(1, n_in))
    buffer = _chunk_buffer(step * n_in)
    decode = dequant_native.chunk_decoder(w.qtype, raw, buffer)  # the checks done once, not per piece
    for start in range(0, n_out, step):
        rows = min(step, n_out - start)
        values = decode(start, rows).view(rows, n_in)
        torch.mm(xs, values.t(), out=out[:, start:start + rows])  # straight into its columns
    return out.reshape(*x.shape[:-1], n_out)
