"""The gated delta rule for 1-16 tokens in one Triton launch, each kept token's state in its own slot.

    gdn_step(q, k, v, g, beta, states, src_slot, dst_slots, out=None, group=1,
             eps=None, scale=None, gate_weights=None, conv=None, gated_norm=None)
        -> o [n, nv, dv] (y with gated_norm)

Shapes (one sequence, docs/reference/model-math.md §2.2): q, k [n, nk, dk] (L2-normed, q scaled;
value head h reads key head (h // group) mod nk: group 1 reads h mod nk, GGUF's tiled Qwen3.5
heads; group nv / nk reads h // group, Qwen3-Next's grouped heads; nk = nv reads head h), v [n, nv, dv], g (log-decay ≤ 0)
and beta [n, nv], each in any float dtype (loaded into float32: the compute dtype's v needs no cast
first); states [slots, nv, dk, dv] float32, the ring
of the sequence's states for this layer (runtime/memory.py `Memory.ssm[layer][seq]`). The state
before the batch is read from slot `src_slot` and the state after token n - keep + i written to slot
`dst_slots[i]` (keep = len(dst_slots) ≤ n): a rollback to token i makes that slot current, nothing is
recomputed or copied. Slots are int64 tensors on the states' device (what a captured CUDA graph
reads) or Python ints (checked, then copied there). Each program keeps its block of the state in
registers, so any slot may be the source as well (a ring of one). o is float32 (the states' dtype),
written into `out` when given. The per-token math is runtime/graphs/gdn.py's recurrent form, the
oracle of the tests.

What the Gated DeltaNet computes around the rule, folded in (each program works out the key head
and the gates it reads: a dk-wide sum per token, a few scalars). The launch forbids FMA
contraction, as the launches of the kernels it folds in do, so that their operations give their
bits on a GPU too:
* `eps` given: q and k are the conv's outputs, L2-normed in the kernel, q then · `scale`: the bits of
  norm.l2_norm(q, eps, scale) and l2_norm(k, eps) under Triton's interpreter (on a GPU the sum's
  order follows the kernel's layout: a few ulps apart).
* `gate_weights=(a, dt_bias)` [nv] given: g and beta are the projections alpha and b, [n, nv] or
  [n, groups, nv / groups] views (read through their strides), and the gates are computed in the
  kernel with activation.gdn_gates's operations (the same bits).
* `conv=(windows, weight)` given: q, k, v are the views of the pre-conv rows m [n, C] = [q | k | v]
  (the graphs' slices of the conv's output, here of its input), convolved in the kernel with
  conv.causal_conv's operations (its output rounded into m's dtype: the same bits), windows
  [slots, K-1, C] the conv's ring (same slots as `states`), weight [C, K]. The windows after the
  kept tokens are written to the destination slots, each channel's by one program; the others read
  the window before the batch meanwhile, so the source slot must not be a destination (the
  memory's rings hold a spare slot; a ring of one, or ring_pieces' scratch slot, take the separate
  conv). Checked where the slots are ints.
* `gated_norm=(weight, gate, eps, out_dtype)` given: the layer's output norm after the rule, and y
  returned instead of o: y = rms_norm(o, weight, eps) rounded into o's dtype · silu(gate), rounded
  into out_dtype (float32 where None): kernels_triton.norm.rms_norm(o, weight, eps, gate=gate,
  out_dtype=out_dtype), weight [dv], gate [n, nv, dv] (read through its strides). The head's last
  program to finish its columns norms the head's rows (an int32 counter per head,
  _common.tile_counters), with norm_kernel's operations on each (token, head) row: its bits, and a
  row's y does not depend on the batch. Where no counters can be had (a CUDA graph capture before
  any were made) the norm is its own launch after the rule (rms_norm: the same bits).
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common, norm

MAX_TOKENS = 16  # longer inputs (prompts) take runtime/graphs/gdn.py's chunked form
BLOCK_V = 32  # state columns per program


def slots_and_out(op: str, src_slot, dst_slots, states: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None,
                  n: int, nv: int, dv: int):
    """(source slot, destination slots as device tensors, the float32 output [n, nv, dv]) of a delta
    rule kernel over n tokens: at most one kept state per token; `out` checked, or made."""
    src = slot_index(op, "src_slot", src_slot, states.shape[0], states.device, length=1)
    dst = slot_index(op, "dst_slots", dst_slots, states.shape[0], states.device)
    if dst.shape[0] > n:
        raise SpecconvError(f"{op}: {dst.shape[0]} destination slots for {n} tokens")
    if out is None:
        out = torch.empty(n, nv, dv, dtype=torch.float32, device=states.device)
    _common.check_shape(op, "out", out, (n, nv, dv))
    _common.check_device(op, q, out)
    _common.check_last_contiguous(op, "out", out)
    return src, dst, out


def slot_index(op: str, name: str, slots, n_slots: int, device: torch.device, length: int | None = None):
    """`slots` as an int64 tensor on `device`: a tensor as given (its values are not read: no sync),
    or ints checked against the ring size and copied there."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype != torch.int64 or slots.dim() != 1 or slots.device != device:
            raise SpecconvError(f"{op}: {name} must be a 1-D int64 tensor on {device} (got {slots.dtype}, "
                                f"shape {tuple(slots.shape)}, on {slots.device})")
        if not slots.is_contiguous():
            raise SpecconvError(f"{op}: {name} must be contiguous")
    else:
        values = [slots] if isinstance(slots, int) else list(slots)
        if any(not isinstance(s, int) or not 0 <= s < n_slots for s in values):
            raise SpecconvError(f"{op}: {name} {values} outside the ring of {n_slots} slots")
        slots = torch.tensor(values, dtype=torch.int64, device=device)
    if slots.shape[0] == 0 or (length is not None and slots.shape[0] != length):
        raise SpecconvError(f"{op}: {name} holds {slots.shape[0]} slots, expected {length or 'one or more'}")
    return slots


def gdn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             states: torch.Tensor, src_slot, dst_slots, out: torch.Tensor | None = None,
             group: int = 1, eps: float | None = None, scale: float | None = None,
             gate_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
             conv: tuple[torch.Tensor, torch.Tensor] | None = None,
             gated_norm: tuple[torch.Tensor, torch.Tensor, float, torch.dtype | None] | None = None) -> torch.Tensor:
    op = "gdn_step"
    if q.dim() != 3 or v.dim() != 3 or states.dim() != 4:
        raise SpecconvError(f"{op}: expected q, k [n, nk, dk], v [n, nv, dv], states [slots, nv, dk, dv] "
                            f"(got q {tuple(q.shape)}, v {tuple(v.shape)}, states {tuple(states.shape)})")
    n, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    _common.check_shape(op, "k", k, (n, nk, dk))
    _common.check_shape(op, "v", v, (n, nv, dv))
    gate_rows = _gate_rows(op, g, beta, n, nv, gate_weights is not None)
    _common.check_shape(op, "states", states, (states.shape[0], nv, dk, dv))
    if not 1 <= n <= MAX_TOKENS or nk == 0 or nv % nk:
        raise SpecconvError(f"{op}: {n} tokens (1..{MAX_TOKENS}) and {nv} value heads over {nk} key heads")
    if group not in (1, nv // nk):
        raise SpecconvError(f"{op}: group must be 1 (tiled heads) or {nv // nk} (grouped heads), got {group}")
    if states.dtype != torch.float32:
        raise SpecconvError(f"{op}: states must be float32 (got {states.dtype})")
    if scale is not None and eps is None:
        raise SpecconvError(f"{op}: scale multiplies the in-kernel norm of q: give eps with it")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    _common.check_last_contiguous(op, "states", states)
    _common.check_device(op, q, k, v, g, beta, states)
    a, dt_bias = (g, g) if gate_weights is None else gate_weights
    if gate_weights is not None:
        for name, t in (("a", a), ("dt_bias", dt_bias)):
            _common.check_shape(op, name, t, (nv,))
            _common.check_float(op, name, t)
            _common.check_last_contiguous(op, name, t)
        _common.check_device(op, q, a, dt_bias)
    windows, conv_weight = (states, states) if conv is None else _conv_inputs(op, q, k, v, states, conv)
    src, dst, out = slots_and_out(op, src_slot, dst_slots, states, q, out, n, nv, dv)
    keep = dst.shape[0]
    norm_w, z, norm_eps, out_dtype = (out, out, 0.0, None) if gated_norm is None else \
        _gated_norm_inputs(op, q, out, gated_norm)
    if conv is not None and not isinstance(src_slot, torch.Tensor) and not isinstance(dst_slots, torch.Tensor):
        source = src_slot if isinstance(src_slot, int) else list(src_slot)[0]  # values known here
        if source in ([dst_slots] if isinstance(dst_slots, int) else list(dst_slots)):
            raise SpecconvError(f"{op}: with the conv folded in, the source slot may not be a destination")
    counters = None if gated_norm is None else _common.tile_counters(out.device, nv)
    folded = counters is not None  # the norm in this launch
    y = torch.empty(out.shape, dtype=out_dtype, device=out.device) if folded else out
    jit = _common.jit_module("_recurrent_jit")
    grid = (nv, _common.cdiv(dv, BLOCK_V))
    per_group, stride_gg, stride_bg = gate_rows
    jit.gdn_step_kernel[grid](q, k, v, g, beta, a, dt_bias, q, windows, conv_weight, states, src, dst, out,
                              norm_w, z, y, counters if folded else out, n, keep,
                              nk, group, dk, dv, per_group, 0.0 if eps is None else float(eps),
                              1.0 if scale is None else float(scale), norm_eps, float(dv),
                              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                              g.stride(0), stride_gg, beta.stride(0), stride_bg,
                              q.stride(0), windows.stride(0), windows.stride(1), conv_weight.stride(0),
                              states.stride(0), states.stride(1), states.stride(2), out.stride(0), out.stride(1),
                              z.stride(0), z.stride(1), y.stride(0), y.stride(1),
                              NORM_QK=eps is not None, GATES=gate_weights is not None, CONV=conv is not None,
                              K=conv_weight.shape[1] if conv is not None else 2, GATED_NORM=folded,
                              BLOCK_K=_common.next_power_of_2(dk), BLOCK_V=BLOCK_V,
                              BLOCK_DV=_common.next_power_of_2(dv) if folded else 1, enable_fp_fusion=False)
    if gated_norm is None:
        return out
    if not folded:
        return norm.rms_norm(out, norm_w, norm_eps, gate=z, out_dtype=out_dtype)
    return y


def _gate_rows(op: str, g: torch.Tensor, beta: torch.Tensor, n: int, nv: int, projections: bool):
    """(heads per group, g's and beta's group strides): how the kernel finds head h in a token's row
    of g and beta, [n, nv] (one group of all heads) or, for the projections alpha and b,
    [n, groups, nv / groups] views too."""
    if projections and g.dim() == 3:
        groups, per_group = g.shape[1], g.shape[2]
        if groups * per_group != nv:
            raise SpecconvError(f"{op}: alpha has shape {tuple(g.shape)}, expected [{n}, groups, {nv} / groups]")
        _common.check_shape(op, "alpha", g, (n, groups, per_group))
        _common.check_shape(op, "b", beta, (n, groups, per_group))
        return per_group, g.stride(1), beta.stride(1)
    _common.check_shape(op, "alpha" if projections else "g", g, (n, nv))
    _common.check_shape(op, "b" if projections else "beta", beta, (n, nv))
    return max(nv, 1), 0, 0


def _gated_norm_inputs(op: str, q: torch.Tensor, o: torch.Tensor, gated_norm):
    """(weight, gate, eps, out_dtype) of `gated_norm=`, checked against o [n, nv, dv]: weight [dv],
    gate [n, nv, dv], out_dtype a float dtype (float32 where None)."""
    weight, gate, eps, out_dtype = gated_norm
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    if out_dtype not in _common.FLOAT_DTYPES:
        raise SpecconvError(f"{op}: the gated norm's out_dtype must be float32, bfloat16 or float16 (got {out_dtype})")
    if o.shape[-1] > norm.MAX_WIDTH:
        raise SpecconvError(f"{op}: the gated norm takes rows of at most {norm.MAX_WIDTH} values (got {o.shape[-1]})")
    _common.check_shape(op, "norm weight", weight, (o.shape[-1],))
    _common.check_shape(op, "gate", gate, tuple(o.shape))
    for name, t in (("norm weight", weight), ("gate", gate)):
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    _common.check_device(op, q, weight, gate)
    return weight, gate, float(eps), out_dtype


def _conv_inputs(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor, conv):
    """(windows, weight) of `conv=`, checked: q, k, v the head views of one pre-conv row block
    [n, C] = [q | k | v] (q at its start), windows [slots of states, K-1, C] float32, weight [C, K]."""
    windows, weight = conv
    n, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    channels = 2 * nk * dk + nv * dv
    size = q.element_size()
    laid_out = (k.dtype == v.dtype == q.dtype and q.stride(1) == k.stride(1) == dk and v.stride(1) == dv
                and (n == 1 or q.stride(0) == k.stride(0) == v.stride(0) >= channels)  # one row: any stride
                and k.data_ptr() == q.data_ptr() + nk * dk * size and v.data_ptr() == q.data_ptr() + 2 * nk * dk * size)
    if not laid_out:
        raise SpecconvError(f"{op}: with conv=, q, k, v must be the [q | k | v] head views of one pre-conv row block")
    if windows.dim() != 3 or weight.dim() != 2 or weight.shape[1] < 2:
        raise SpecconvError(f"{op}: conv= takes windows [slots, K-1, C] and weight [C, K] with K ≥ 2 (got "
                            f"{tuple(windows.shape)}, {tuple(weight.shape)})")
    _common.check_shape(op, "conv weight", weight, (channels, weight.shape[1]))
    _common.check_shape(op, "conv windows", windows, (states.shape[0], weight.shape[1] - 1, channels))
    if windows.dtype != torch.float32:
        raise SpecconvError(f"{op}: conv windows must be float32 (got {windows.dtype})")
    _common.check_float(op, "conv weight", weight)
    for name, t in (("conv windows", windows), ("conv weight", weight)):
        _common.check_last_contiguous(op, name, t)
    _common.check_device(op, q, windows, weight)
    return windows, weight
