"""The backend seam: the arithmetic behind the graphs, chosen once per kind of compute device.

Graphs reach stored weights and the heavy kernels only through runtime/graphs/ops.py (`linear`,
`moe`, embedding rows, `dense`) and runtime/graphs/gdn.py (`causal_conv`, `delta_rule`); those ask
`for_device(device)` for the backend of the device the activations are on. Each backend provides

    dequantize_rows(raw, qtype, dtype)          packed rows -> values (runtime/dequant.py's values)
    linear(x, w)                                x @ wᵀ, w a StoredWeight or a tensor [out, in]
    linear_wide(x, w)                           acc(x) @ wᵀ (a weight kept float32: x read as it is)
    linear_wide_group(x, [w, ...])              (acc(x) @ w₀ᵀ, ...): the same rows by several float32 weights
    linear_group(x, [w, ...])                   (x @ w₀ᵀ, x @ w₁ᵀ, ...): the same rows by several weights
    linear_glu(gate, up, w, act)                (act(gate) · up) @ wᵀ: a GLU's down product (act "silu",
                                                "gelu_tanh"; glu(gate, up, act) is its input alone)
    linear_per_head(x, w)                       x[:, h] @ w[h]ᵀ: each head by its own matrix of a 3-D weight
    moe(x, weights, chosen, experts)            Σ_slots weight · expert(x) over the routed experts
    moe_out(x, weights, chosen, experts, shared)   the same plus un-gated shared experts, in x's dtype
    route_softmax_topk(logits, k)               a softmax router's (weights, chosen experts) [n, k]
    route_grouped(logits, k, gating, bias, groups, groups_used, renormalise, scale, expert_scale)
                                                a sigmoid / softmax router with a selection bias, expert
                                                groups and scales (DeepSeek-V3, GLM-4.5, Gemma 4 ...)
    add_shared(routed, shared), add_gated_shared(routed, shared, gate)
                                                a MoE block's routed sum plus its shared expert
    causal_conv(m, conv_state, weight, keep)    the Gated DeltaNet's short conv + SiLU
    delta_rule(q, k, v, g, beta, state, keep, lazy, out, exact)   the gated delta rule
    linear_add_rms_norm(x, w, h, weight, eps, up, act)   add_rms_norm(h, x @ wᵀ (or linear_glu's), weight):
                                                the product ending a mixer / FFN with the residual add
                                                and norm after it (one launch on CUDA)
    linear_add_normed(x, w, h, weight, eps, scale, then, up, act)   (s, o): s = add_normed(h, x @ wᵀ, weight,
                                                scale), o = rms_norm(s, then) or None: a product joining the
                                                stream through a sandwich norm (one launch on CUDA)
    rms_norm, add_rms_norm, add_normed, gated_rms_norm, l2_norm, rope, normed_rope, silu_mul, gelu_mul, glu,
    gdn_gates, rope_table
                                                the small operations around the products (ops.py's
                                                helpers and gdn.gates reach them)
    attention(q, k, v, q_pos, k_pos, scale, gate, window, sinks)   causal attention over a layer's K/V
                                                cells, with an optional sigmoid output gate, sliding
                                                window and attention sinks (ops.cached_attention,
                                                ops.attend_cells)
    latent_attention(q_lat, q_pe, kv, q_pos, k_pos, scale, chosen)   multi-head latent attention over
                                                latent cells [c | k_pe], V = c (ops.latent_attention),
                                                with DeepSeek Sparse Attention's chosen keys where given
    write_kv(k_cache, v_cache, cells, k, v)     a batch's K/V into a layer's fixed-size buffers, in
                                                place by cell index (runtime/memory.py `Batch.attend_kv`)
    normed_rope_qk(q, k, q_weight, k_weight, eps, cos, sin, style)   normed_rope of a layer's q, then
                                                of its k (ops.normed_rope_qk)
    normed_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin, style, k_cache, v_cache, cells, v_norm)
                                                normed_rope_qk, then write_kv of k and v (v RMS-normed
                                                without a weight first with v_norm): q roped
                                                (ops.roped_attended_kv; one launch on CUDA)

* "torch" (runtime/backend_torch.py): torch operations only, on any device (CPU, CUDA, meta): the
  reference the others are tested against, and what runs where nothing faster applies.
* "cpu-native" (runtime/backend_cpu.py): the CPU with the optional native extension built: native
  decoders, fused products of stored weights, the native Gated DeltaNet step and conv (float32).
* "cuda" (runtime/backend_cuda.py): the Triton kernels of runtime/kernels_triton where Triton is
  installed and the case fits, torch otherwise.

A backend falls back to the torch reference call by call where its kernels do not apply (another
dtype, a type without a kernel, SPECCONV_NO_NATIVE=1), so every backend runs every model.

Batch invariance (`rows_alone`): inside `batch_invariant(True)` — what a Context does for a model
computing in bfloat16 / float16 — every backend computes each row of a batch with the operations,
in the order, of a one-row batch, so a verification forward of k+1 rows gives each row the bits of
the one-row forward and greedy speculative decoding equals plain decoding exactly
(docs/runtime.md, "Backends"). One batch is exempt (`prompt_prefix`): a prompt's prefix, which
plain and speculative decoding both evaluate alike, may be computed in another order, one that
depends on nothing but the batch's inputs.

Activation observer (`observing`): an optional object that ops.linear hands the input rows of every
product by a weight, and ops.moe the rows routed to each expert (it announces each expert's slices
first: `expert(e, [(3-D weight, its slice e), ...])`, a context manager around that expert's
feed-forward). `specconv imatrix` sums their squares (specconv/imatrix/collector.py). Unset, the
seam's cost is one context-variable read per product.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch

# compute dtypes whose forwards are made batch-invariant (float32 / float64 keep the batched forms)
INVARIANT_DTYPES = (torch.bfloat16, torch.float16)

_rows_alone: ContextVar[bool] = ContextVar("specconv_rows_alone", default=False)


def rows_alone() -> bool:
    """Whether each row of a batch must be computed as in a one-row batch (see the module doc)."""
    return _rows_alone.get()


@contextmanager
def batch_invariant(enabled: bool):
    token = _rows_alone.set(enabled)
    try:
        yield
    finally:
        _rows_alone.reset(token)


# A prompt's prefix (all but its last token) is the one batch that plain and speculative decoding
# both evaluate, with the same inputs and from the same state (runtime/generate.py, spec_link.py
# `start_prompt`): its rows need the same bits in both, not a one-row forward's.
_prompt_prefix: ContextVar[bool] = ContextVar("specconv_prompt_prefix", default=False)


def prompt_prefix() -> bool:
    """Whether the batch being evaluated is a prompt's prefix (`evaluating_prompt_prefix`)."""
    return _prompt_prefix.get()


@contextmanager
def evaluating_prompt_prefix():
    """Around the evaluation of a prompt's prefix: inside, a backend may compute the batch in an order
    other than a one-row forward's even in batch-invariant mode (the CUDA backend's chunked delta
    rule), provided the order depends only on the batch's inputs: not on how many states the
    context keeps (a speculative context's ring holds more than a plain one's)."""
    token = _prompt_prefix.set(True)
    try:
        yield
    finally:
        _prompt_prefix.reset(token)


class ActivationObserver(Protocol):
    """Sees what the graphs multiply by weights (runtime/graphs/ops.py calls it)."""

    def product(self, x: torch.Tensor, w: Any) -> None:
        """x [..., in]: rows multiplied by w (a weight of the model, or an announced expert slice)."""

    def expert(self, e: int, slices: Sequence[tuple[Any, Any]]) -> ContextManager[None]:
        """Around expert e's feed-forward: (3-D weight, its slice e) pairs the products inside use."""


_observer: ContextVar[ActivationObserver | None] = ContextVar("specconv_activation_observer", default=None)


def activation_observer() -> ActivationObserver | None:
    return _observer.get()


@contextmanager
def observing(observer: ActivationObserver | None):
    """Forwards run inside see `observer` (None: none)."""
    token = _observer.set(observer)
    try:
        yield observer
    finally:
        _observer.reset(token)


@dataclass(frozen=True)
class Experts:
    """The routed experts of one MoE layer: 3-D weights [E, out, in] (stored or dense) and the
    expert's feed-forward `ffn(x, gate, up, down)` given one expert's slices (SwiGLU, GeGLU, a
    clamped SwiGLU: it reaches the slices through ops.linear, and reads x only through those products:
    the CUDA backend hands it each row of x once for its k experts). `up` may be None where `gate` holds
    each expert's gate and up rows together ([E, 2F, H]); `ffn` then gets None for it."""

    gate: Any
    up: Any
    down: Any
    ffn: Callable[..., torch.Tensor]


def for_device(device: torch.device | str) -> "TorchBackend":  # noqa: F821 (runtime/backend_torch.py)
    """The backend of a device kind: the same object for every call (chosen on first use, which
    load_model makes for each device it places weights on)."""
    return _backend(torch.device(device).type)


@functools.lru_cache(maxsize=None)
def _backend(kind: str):
    if kind == "cpu":
        from specconv.runtime import dequant_native

        if dequant_native._module() is not None:
            from specconv.runtime.backend_cpu import NativeCpuBackend

            return NativeCpuBackend()
    if kind == "cuda":
        from specconv.runtime.backend_cuda import CudaBackend

        return CudaBackend()
    from specconv.runtime.backend_torch import TorchBackend

    return TorchBackend()
