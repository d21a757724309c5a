"""Building blocks shared by the graphs (docs/reference/model-math.md §1): norms, rope, attention, FFNs.

Reductions run in float32 whatever the compute dtype; results come back in the input dtype. The norms,
rope, SwiGLU's and GeGLU's products and the attention over the cache are computed by the backend of
the activations' device too (one Triton kernel each on CUDA, runtime/backend_cuda.py; the torch
formulas of runtime/backend_torch.py elsewhere).

A weight `w[name]` is a torch tensor or a `StoredWeight` (runtime/stored.py: kept in its GGUF
type). Graphs multiply by weights only through `linear` (`linear_group` for the same rows by
several weights) and `moe`, which hand the product to the backend of the activations' device
(runtime/backend.py); they take embedding rows as `w[token_ids]` and values as `dense(w, dtype)`
for anything else, so both kinds work everywhere. A block's mixer or FFN may return its last
product unmade (`Deferred`): add_rms_norm then makes it with the residual add and the norm after it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.archs.rope_scaling import RopeScaling
from specconv.runtime.backend import Experts, activation_observer, for_device, rows_alone
from specconv.runtime.stored import StoredWeight


def acc(x: torch.Tensor) -> torch.Tensor:
    """x in the accumulation dtype: float32, or float64 when computing in float64."""
    return x if x.dtype == torch.float64 else x.float()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of activations in `dtype` (acc's), without converting any tensor: on a
    GPU each conversion is a launch."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x · (mean(x²) + ε)^(-1/2) ⊙ w over the last axis, in x's dtype (the GGUF weight already holds
    any +1)."""
    return for_device(x.device).rms_norm(x, weight, eps)


@dataclass(frozen=True)
class Deferred:
    """The product x @ wᵀ (with `up` and `act`: a GLU's down product (act(x) · up) @ wᵀ, glu_linear)
    not made yet: what a block's mixer or FFN returns where its output only joins the residual
    stream, so that add_rms_norm makes it together with the add and the norm after it (one launch
    on CUDA). `made` gives it as a tensor, for whatever needs the value itself."""
    x: torch.Tensor
    w: Any
    up: torch.Tensor | None = None
    act: str | None = None

    def made(self) -> torch.Tensor:
        return linear(self.x, self.w) if self.up is None else glu_linear(self.x, self.up, self.w, self.act)


def made(t: "torch.Tensor | Deferred") -> torch.Tensor:
    """t as a tensor: a Deferred product made, a tensor as it is."""
    return t.made() if isinstance(t, Deferred) else t


def add_rms_norm(h: torch.Tensor, delta: "torch.Tensor | Deferred", weight, eps: float) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(h + delta, rms_norm(h + delta, weight)): a block's residual add and the norm that follows it,
    one kernel on CUDA; a Deferred delta is made by the backend's linear_add_rms_norm (on CUDA in the
    product's launch: no launch of its own for the add and norm)."""
    backend = for_device(h.device)
    if isinstance(delta, Deferred) and activation_observer() is None:  # an observer sees the product's rows
        return backend.linear_add_rms_norm(delta.x, delta.w, h, weight, eps, delta.up, delta.act)
    return backend.add_rms_norm(h, made(delta), weight, eps)


def add_normed(h: torch.Tensor, x: "torch.Tensor | Deferred", weight, eps: float, scale=None) -> torch.Tensor:
    """h + rms_norm(x, weight), times the one-value `scale` (in the accumulation dtype) when given:
    a sandwich norm's output joining the residual stream (Gemma), one kernel on CUDA; a Deferred x
    is made by the backend's linear_add_normed (on CUDA in the product's launch)."""
    backend = for_device(h.device)
    if isinstance(x, Deferred) and activation_observer() is None:  # an observer sees the product's rows
        return backend.linear_add_normed(x.x, x.w, h, weight, eps, scale, None, x.up, x.act)[0]
    return backend.add_normed(h, made(x), weight, eps, scale)


def add_normed_rms_norm(h: torch.Tensor, x: "torch.Tensor | Deferred", weight, eps: float, then,
                        scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s, then)) for s = add_normed(h, x, weight, scale): a sandwich norm's output
    joining the stream and the norm that reads the stream next (Gemma's post-attention norm,
    residual add and FFN norm; a block's last sandwich and the next block's input norm); a Deferred
    x in the product's launch on CUDA (linear_add_normed), else two norm kernels."""
    backend = for_device(h.device)
    if isinstance(x, Deferred) and activation_observer() is None:
        return backend.linear_add_normed(x.x, x.w, h, weight, eps, scale, then, x.up, x.act)
    s = backend.add_normed(h, made(x), weight, eps, scale)
    return s, backend.rms_norm(s, then, eps)


def gated_rms_norm(x: torch.Tensor, weight, gate: torch.Tensor, eps: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """rms_norm(x, weight) · silu(gate), in the accumulation dtype (Gated DeltaNet's output norm), or
    rounded once into `out_dtype` (the next product's input: one kernel on CUDA, no cast after it)."""
    return for_device(x.device).gated_rms_norm(x, weight, gate, eps, out_dtype)


def l2_norm(x: torch.Tensor, eps: float, scale: float | None = None) -> torch.Tensor:
    """x · (Σ x² + ε)^(-1/2) over the last axis, in the accumulation dtype, then times `scale` if
    given (rounded after the norm, as a separate product would be; one kernel on CUDA)."""
    return for_device(x.device).l2_norm(x, eps, scale)


def dense(w, dtype: torch.dtype | None = None) -> torch.Tensor:
    """All values of a weight as a torch tensor (in `dtype` when given)."""
    if isinstance(w, StoredWeight):
        return w.dense(dtype)
    return w if dtype is None else w.to(dtype)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ wᵀ for a GGUF matrix in torch order [out, in] (stored or dense), by the backend."""
    observer = activation_observer()
    if observer is not None:
        observer.product(x, w)
    return for_device(x.device).linear(x, w)


def linear_wide(x: torch.Tensor, w) -> torch.Tensor:
    """acc(x) @ wᵀ for a weight the graph keeps float32 (a router, a gate), by the backend: it may
    read x in its own dtype (CUDA: widened inside the product kernel, no cast launch first)."""
    observer = activation_observer()
    if observer is not None:
        observer.product(x, w)
    return for_device(x.device).linear_wide(x, w)


def linear_wide_group(x: torch.Tensor, ws) -> tuple[torch.Tensor, ...]:
    """(acc(x) @ w₀ᵀ, acc(x) @ w₁ᵀ, ...): linear_wide by several float32 weights (a MoE block's router
    and its shared expert's gate), each output what linear_wide gives; one launch on CUDA."""
    observer = activation_observer()
    if observer is not None:
        for w in ws:
            observer.product(x, w)
    return for_device(x.device).linear_wide_group(x, ws)


def head_projections(x: torch.Tensor, ws, heads: Sequence[int], head_dim: int) -> tuple[torch.Tensor, ...]:
    """x @ wᵢᵀ for each weight (attention's q / k / v of one normed input), each viewed as [n, heads[i],
    head_dim]: one grouped product (linear_group), each output the bits `linear` gives it."""
    n = x.shape[0]
    return tuple(y.view(n, h, head_dim) for y, h in zip(linear_group(x, ws), heads))


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y + bias (a product's bias, any float dtype) in y's dtype, the sum in the accumulation dtype and
    rounded once: (acc(y) + bias).to(y.dtype)'s bits, written into y (torch computes a mixed-dtype
    add in the wider dtype and rounds into y's: one launch on a GPU where the formula takes three)."""
    return y if bias is None else y.add_(bias)


def linear_group(x: torch.Tensor, ws) -> tuple[torch.Tensor, ...]:
    """(x @ w₀ᵀ, x @ w₁ᵀ, ...): the same rows by several weights, each output what `linear` gives; the
    backend may run them together (one launch per weight type on CUDA, runtime/backend_cuda.py)."""
    observer = activation_observer()
    if observer is not None:
        for w in ws:
            observer.product(x, w)
    return for_device(x.device).linear_group(x, ws)


def moe(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Σ over each row's k routed experts of weights[row, slot] · experts.ffn(x[row], expert's slices),
    in the accumulation dtype [n, out]; weights, chosen [n, k]. The one place graphs run routed
    experts: the backend decides how (by index without host reads, or grouped by expert)."""
    observer = activation_observer()
    if observer is not None:
        return _observed_moe(x, weights, chosen, experts, observer)
    return for_device(x.device).moe(x, weights, chosen, experts)


def moe_out(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: Experts,
            shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE block's output in x's dtype: `moe`'s sum rounded, or (routed + acc(shared)).to(dtype)
    with un-gated shared experts' output `shared` (add_shared), or add_gated_shared's sum with a
    shared expert gated by σ(shared_gate [n, 1]). On CUDA the rounding and the shared add happen
    inside the launch that sums the routed experts."""
    observer = activation_observer()
    if observer is not None:
        out = _observed_moe(x, weights, chosen, experts, observer)
        if shared is None:
            return out.to(x.dtype)
        return add_shared(out, shared) if shared_gate is None else add_gated_shared(out, shared, shared_gate)
    return for_device(x.device).moe_out(x, weights, chosen, experts, shared, shared_gate)


def _observed_moe(x, weights, chosen, experts: Experts, observer) -> torch.Tensor:
    """`moe` under an activation observer (runtime/backend.py): one routed expert at a time over the
    rows routed to it, its slices announced so that the products inside experts.ffn count for that
    expert. The routing is read on the host (observing is offline work)."""
    parts = (experts.gate, experts.up, experts.down)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape[0], experts.down.shape[1], dtype=wide, device=x.device)
    for e in torch.unique(chosen).tolist():
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        sliced = [None if t is None else t[e] for t in parts]
        with observer.expert(e, [(t, s) for t, s in zip(parts, sliced) if t is not None]):
            y = experts.ffn(x[rows], *sliced)
        out.index_add_(0, rows, y.to(out.dtype) * weights[rows, slot][:, None])
    return out


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, rotary_dim/2] for NEOX rope with θ_i = base^(-2i/rotary_dim). The frequencies are rounded to
    float32 as HF and llama.cpp hold them; angles and cos/sin in `dtype` (float32 or float64)."""
    return rope_table(positions, rope_inv_freq(rotary_dim, float(base), positions.device, dtype))


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, divisor: float | None = None,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, len(inv_freq)] of the angles position · θ_i in inv_freq's dtype: each position
    divided by `divisor` first (linear rope scaling), cos and sin times `scale` (YaRN's attention
    factor) when given. One launch on CUDA."""
    return for_device(positions.device).rope_table(positions, inv_freq, divisor, scale)


@functools.lru_cache(maxsize=64)
def rope_inv_freq(rotary_dim: int, base: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """θ_i = base^(-2i/rotary_dim) [rotary_dim/2], rounded to float32 then held in `dtype`: made once
    per device and kept (a constant of the file; on CUDA six launches per forward fewer, and a
    captured step reads it as one of its fixed addresses). Never an inference tensor, so forwards
    inside and outside torch.inference_mode share it."""
    with torch.inference_mode(False):
        exponent = torch.arange(0, rotary_dim, 2, device=device, dtype=torch.int64).float() / rotary_dim
        return (1.0 / (base ** exponent)).to(dtype)


@functools.lru_cache(maxsize=64)
def yarn_inv_freq(rotary_dim: int, base: float, yarn: RopeScaling, device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2] in float32, cos/sin factor) of YaRN as transformers computes them:
    a linear ramp between extrapolated (θ_i) and interpolated (θ_i / factor) frequencies over the
    correction range of dimensions (floored / ceiled), β_fast 32 and β_slow 1 unless the file gives
    them, and attention factor 0.1·ln(factor) + 1 unless given. The file's yarn_ext_factor is not read:
    transformers has no such parameter and llama.cpp takes it from its context parameters (1 for YaRN).
    Made once per device and kept, as rope_inv_freq."""
    with torch.inference_mode(False):
        return _yarn_inv_freq(rotary_dim, base, yarn, device)


def _yarn_inv_freq(rotary_dim: int, base: float, yarn: RopeScaling, device) -> tuple[torch.Tensor, float]:
    d, factor = rotary_dim, yarn.factor
    beta_fast = 32.0 if yarn.beta_fast is None else yarn.beta_fast
    beta_slow = 1.0 if yarn.beta_slow is None else yarn.beta_slow

    def corr(rotations: float) -> float:
        return d * math.log(yarn.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = base ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d)
    extrapolate = 1 - ((torch.arange(d // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    attn = yarn.attn_factor
    attn = float(attn) if attn is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, attn


def rope_cos_sin_scaled(positions: torch.Tensor, rotary_dim: int, base: float, scaling: RopeScaling | None,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin` under a file's rope scaling (archs/rope_scaling.py; the graph refuses other kinds
    at load): none; linear, positions divided by its factor; YaRN, `yarn_inv_freq`'s frequencies and
    cos/sin multiplied by its attention factor."""
    if scaling is None:
        return rope_cos_sin(positions, rotary_dim, base, dtype)
    if scaling.kind == "linear":
        return rope_table(positions, rope_inv_freq(rotary_dim, float(base), positions.device, dtype),
                          divisor=scaling.factor)
    inv, attn = yarn_inv_freq(rotary_dim, base, scaling, positions.device)
    return rope_table(positions, inv.to(dtype), scale=attn)


SCALED_ROPE_KINDS = ("linear", "yarn")  # what rope_cos_sin_scaled runs


def check_rope_scaling(arch: str, scaling: RopeScaling | None, base: float) -> None:
    """A one-line SpecconvError unless `rope_cos_sin_scaled` can run the file's rope scaling."""
    if scaling is None:
        return
    where = f"{arch}.rope.scaling"
    if scaling.kind not in SCALED_ROPE_KINDS:
        raise SpecconvError(f"{where}.type {scaling.kind!r} is not supported by the runtime "
                            f"(none, {' and '.join(SCALED_ROPE_KINDS)} are)")
    if scaling.factor is None or scaling.factor <= 0:
        raise SpecconvError(f"{where}.factor must be given and positive for {scaling.kind} rope scaling")
    if scaling.kind == "yarn" and (scaling.original_context is None or base <= 1.0):
        raise SpecconvError(f"YaRN rope scaling needs {where}.original_context_length and "
                            f"{arch}.rope.freq_base > 1")


def rope_neox_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of the first d = 2·cos.shape[-1] dims of every head; x: [n, heads, hd]."""
    return for_device(x.device).rope(x, cos, sin, "neox")


def normed_rope_neox(x: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_neox_partial(rms_norm(x, weight)) over each head of x [n, heads, hd]: a per-head q or k
    norm and the rotation after it, one kernel on CUDA; weight None: the rotation alone."""
    return for_device(x.device).normed_rope(x, weight, eps, cos, sin, "neox")


def normed_rope_qk(q: torch.Tensor, k: torch.Tensor, q_weight, k_weight, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, style: str = "neox") -> tuple[torch.Tensor, torch.Tensor]:
    """(normed_rope_neox(q, q_weight), normed_rope_neox(k, k_weight)) of one layer (either weight
    None: the rotation alone; `style` "norm": NORM pairs, rope_pairs): one launch on CUDA."""
    return for_device(q.device).normed_rope_qk(q, k, q_weight, k_weight, eps, cos, sin, style)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NORM rope: rotate adjacent pairs (2i, 2i + 1) of the first d = 2·cos.shape[-1] dims of every
    head; x: [n, heads, hd]."""
    return for_device(x.device).rope(x, cos, sin, "norm")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale) v with key visible iff k_pos ≤ q_pos; grouped-query heads.

    q: [n, nh, hd], k/v: [T, nkv, hd] -> [n, nh, hd]. Query head j uses KV head j // (nh/nkv).
    """
    n, nh, hd = q.shape
    nkv = k.shape[1]
    # the query heads of a KV head as one group: K and V are read in place, never repeated per
    # query head (a copy of the whole context per attention layer and step)
    qg = acc(q).view(n, nkv, nh // nkv, hd)
    scores = torch.einsum("nkgd,tkd->kgnt", qg, acc(k)) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("kgnt,tkd->nkgd", probs, acc(v)).reshape(n, nh, v.shape[-1]).to(q.dtype)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                       scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale) v with key visible iff 0 ≤ q_pos − k_pos (< window when window > 0); `sinks`
    [nh]: one more logit per head whose probability mass is dropped (attention sinks). The formula of
    the sliding-window graphs (Gemma 4, Step-3.5, MiMo-V2): each KV head repeated for its query heads,
    so their sums run in the order they always have (causal_attention groups the heads instead)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", acc(q), acc(k)) * scale
    dist = q_pos[:, None] - k_pos[None, :]
    visible = (dist >= 0) & (dist < window) if window > 0 else dist >= 0
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnt,thd->nhd", probs, acc(v)).to(q.dtype)


def by_rows(n: int, f) -> torch.Tensor:
    """f(slice(None)): rows first, for the n rows of a batch; in batch-invariant mode (runtime/backend.py
    `rows_alone`) f(slice(i, i + 1)) for each row alone, concatenated, because torch's batched products
    and einsums sum a row's terms in an order that depends on how many rows there are."""
    if n <= 1 or not rows_alone():
        return f(slice(None))
    return torch.cat([f(slice(i, i + 1)) for i in range(n)])


def attended_kv(batch, layer: int, k: torch.Tensor, v: torch.Tensor):
    """`batch.attend_kv` for a graph that attends itself (attend_cells): in batch-invariant mode, and
    on a backend with `static_kv`, the layer's whole fixed-size buffer (cells not written at
    memory.UNWRITTEN, masked by any causal mask), so each query row's sums run over the same cells
    wherever the sequence ends and the shapes stay fixed (see cached_attention)."""
    return batch.attend_kv(layer, k, v, whole=rows_alone() or for_device(k.device).static_kv)


def roped_attended_kv(batch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight, k_weight,
                      eps: float, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox", v_norm: bool = False):
    """(q', K, V, positions): normed_rope_qk of q and k, then attended_kv of k' and v (with `v_norm`
    rms_norm(v, None, eps) first: Gemma 4). Where attended_kv writes the layer's whole buffers in a
    plain layout (memory.py `Batch.kv_cells`), the backend's normed_rope_store writes k' and v
    itself: the norms, the rope and the K/V store in one launch on CUDA; the same operations, in the
    same order, on the torch backend."""
    backend = for_device(q.device)
    whole = rows_alone() or backend.static_kv
    target = batch.kv_cells(layer, q.device) if whole else None
    if target is None:
        if v_norm:
            v = rms_norm(v, None, eps)
        q, k = normed_rope_qk(q, k, q_weight, k_weight, eps, cos, sin, style)
        return (q, *batch.attend_kv(layer, k, v, whole=whole))
    q = backend.normed_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin, style, *target, v_norm)
    return (q, *batch.attend_written(layer, q.device))


def attend_cells(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 scale: float, window: int = 0, sinks: torch.Tensor | None = None,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
    """The backend's attention over K/V cells a graph got itself (attended_kv, another layer's or
    context's cells): `windowed_attention`'s formula with the optional output gate
    sigmoid_gated(o, gate) (per value or per head); one Triton launch on CUDA, each query row alone
    in batch-invariant mode."""
    return for_device(q.device).attention(q, k, v, q_pos, k_pos, scale, gate, window=window, sinks=sinks)


def sigmoid_gated(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """An attention's output gate on o [n, heads, dv]: a gate per value ([n, heads, dv], Qwen3.5)
    o · sigmoid(gate), the sigmoid rounded into o's dtype first; a gate per head ([n, heads],
    Step-3.5) o · sigmoid(gate) in the accumulation dtype, rounded once. o itself without a gate."""
    if gate is None:
        return o
    if gate.dim() == o.dim() - 1:
        return (acc(o) * torch.sigmoid(acc(gate))[..., None]).to(o.dtype)
    return o * torch.sigmoid(acc(gate)).to(o.dtype)


def cached_attention(batch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight, k_weight,
                     eps: float, rope: tuple[torch.Tensor, torch.Tensor], scale: float,
                     gate: torch.Tensor | None = None, style: str = "neox") -> torch.Tensor:
    """Norm (q_weight, k_weight: per-head norms, either None) and rope q and k by the angles `rope` =
    (cos, sin), store this batch's K/V in layer `layer`'s cache (runtime/memory.py `Batch`) and attend
    to every cell visible by position: roped_attended_kv (on CUDA one launch for the norms, the rope
    and the K/V store), then `causal_attention` over the cache, by the backend (`attention`: one
    Triton launch on CUDA), with the output gate `sigmoid_gated(o, gate)` where given.

    A backend with `static_kv` (CUDA) attends over the layer's whole fixed-size buffer, cells not
    written masked out, so the shapes do not change from step to step. So does batch-invariant mode
    (runtime/backend.py `rows_alone`), in which each query row attends alone over that whole buffer,
    so its sums run over the same cells in the same order whatever the batch's width and wherever
    the sequence ends."""
    q, k_all, v_all, k_pos = roped_attended_kv(batch, layer, q, k, v, q_weight, k_weight, eps, *rope, style=style)
    return for_device(q.device).attention(q, k_all, v_all, batch.positions, k_pos, scale, gate)


def cached_latent_attention(batch, layer: int, q_lat: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor,
                            k_pe: torch.Tensor, scale: float) -> torch.Tensor:
    """Multi-head latent attention over layer `layer`'s cache: store this batch's latent rows
    [c | rope(k_pe)] (c [n, 1, kv_lora], k_pe [n, 1, dr], written side by side in a layout with
    value_width = kv_lora: V is each K cell's c, kept once) and attend with q_lat [n, heads, kv_lora],
    q_pe [n, heads, dr] to every cell visible by position, by the backend (`latent_attention`: one
    Triton launch on CUDA, each cell read once); o [n, heads, kv_lora]. Whole buffers as in
    cached_attention."""
    backend = for_device(q_lat.device)
    k_all, _, k_pos = batch.attend_kv(layer, k_pe, c, whole=rows_alone() or backend.static_kv)
    return backend.latent_attention(q_lat, q_pe, k_all, batch.positions, k_pos, scale)


def attend_latent_cells(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, scale: float, chosen: torch.Tensor) -> torch.Tensor:
    """Multi-head latent attention over latent cells a graph got itself (attended_kv; kv [cells, 1,
    kv_lora + dr]) restricted to the cells `chosen` [n, cells] per query row (DeepSeek Sparse
    Attention), by the backend (`latent_attention`: one Triton launch on CUDA, the mask its key mask)."""
    return for_device(q_lat.device).latent_attention(q_lat, q_pe, kv, q_pos, k_pos, scale, chosen)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float,
                 weight_scale: float = 1.0) -> torch.Tensor:
    """DeepSeek Sparse Attention's lightning-indexer scores [n, cells] (runtime/graphs/dsa.py):
    Σ_j (weights[:, j] · weight_scale) · ReLU((q[:, j] · keys) · scale), by the backend (one launch
    on CUDA, the weights scaled inside)."""
    return for_device(q.device).index_scores(q, weights, keys, scale, weight_scale)


def linear_per_head(x: torch.Tensor, w) -> torch.Tensor:
    """y[:, h] = x[:, h] @ w[h]ᵀ for x [n, heads, in] and a 3-D weight [heads, out, in] (MLA's attn_k_b,
    attn_v_b), in x's dtype, by the backend (one launch on CUDA: each (row, head) a one-row product by
    its head's matrix, read packed)."""
    return for_device(x.device).linear_per_head(x, w)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return deferred_swiglu(x, gate, up, down).made()


def deferred_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> Deferred:
    """A SwiGLU FFN with its down product not made yet (Deferred): gate and up multiplied now."""
    return deferred_glu(x, gate, up, down, "silu")


def deferred_glu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str) -> Deferred:
    """A GLU FFN (act "silu": SwiGLU, "gelu_tanh": GeGLU) with its down product not made yet
    (Deferred): gate and up multiplied now, in one group."""
    g, u = linear_group(x, (gate, up))
    return Deferred(g, down, u, act)


def glu_linear(gate: torch.Tensor, up: torch.Tensor, w, act: str) -> torch.Tensor:
    """(act(gate) · up) @ wᵀ, act "silu" (SwiGLU) or "gelu_tanh" (GeGLU), act(gate) · up rounded into
    gate's dtype first: a GLU's down product, by the backend (on CUDA the product kernel computes
    the GLU as it reads its input: one launch; elsewhere silu_mul / gelu_mul, then `linear`)."""
    backend = for_device(gate.device)
    if activation_observer() is not None:  # the observer sees the product's input rows
        return linear(backend.glu(gate, up, act), w)
    return backend.linear_glu(gate, up, w, act)


def moe_softmax_topk(x: torch.Tensor, router: torch.Tensor, n_used: int, gate_exps: torch.Tensor,
                     up_exps: torch.Tensor, down_exps: torch.Tensor) -> torch.Tensor:
    """Softmax router over all experts, top-k, weights renormalised over the chosen k (docs/reference/model-math.md §3.1),
    the routed experts' sum in the accumulation dtype (the caller rounds it: add_gated_shared).

    router [E, H]; gate/up_exps [E, Fe, H]; down_exps [E, H, Fe].
    """
    weights, chosen = for_device(x.device).route_softmax_topk(linear_wide(x, router), n_used)
    return moe(x, weights, chosen, Experts(gate_exps, up_exps, down_exps, swiglu))


def moe_softmax_topk_gated_shared(x: torch.Tensor, logits: torch.Tensor, n_used: int, gate_exps: torch.Tensor,
                                  up_exps: torch.Tensor, down_exps: torch.Tensor, shared: torch.Tensor,
                                  shared_gate: torch.Tensor) -> torch.Tensor:
    """add_gated_shared(moe_softmax_topk(...), shared, shared_gate) in x's dtype from the router's
    logits (linear_wide(x, router), float32 [n, E]): a MoE block with a sigmoid-gated shared expert
    (Qwen3.5), its shared add inside the launch that sums the routed experts on CUDA (moe_out)."""
    weights, chosen = for_device(x.device).route_softmax_topk(logits, n_used)
    return moe_out(x, weights, chosen, Experts(gate_exps, up_exps, down_exps, swiglu), shared, shared_gate)


def add_gated_shared(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """routed.to(dtype) + (acc(shared) · σ(gate)).to(dtype), dtype shared's: a MoE block's routed sum
    (accumulation dtype) plus its shared expert gated by σ of one logit per row (gate [n, 1])."""
    return for_device(shared.device).add_gated_shared(routed, shared, gate)


def add_shared(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """(routed + acc(shared)).to(dtype), dtype shared's: a MoE block's routed sum (accumulation dtype)
    plus its un-gated shared experts (one launch on CUDA)."""
    return for_device(shared.device).add_shared(routed, shared)
