"""The Gated DeltaNet step over a few tokens in native code (runtime/gdn_step.c, built into the optional
extension of runtime/_dequant.c): the causal conv and the gated delta rule, for decode steps and
speculative verification on the CPU.

The torch batched form (runtime/graphs/gdn.py) evaluates k+1 tokens in ~30 tensor operations with
state-sized temporaries; at the sizes of real models (a 1 MB state per layer) those operations cost
more than the state arithmetic itself, and more for each extra token. Here each head's state stays
in cache while the tokens pass over it, the heads split over torch's threads, and the state after
the batch is written straight into the memory's slot (docs/runtime.md, "Gated DeltaNet steps
(native)"). The conv is one call for all channels and tokens, its kept windows whole input rows.
`SPECCONV_NO_NATIVE=1` or `SPECCONV_NO_NATIVE_GDN=1` switches it off (the torch forms then run).
"""

from __future__ import annotations

import torch

from specconv.runtime import dequant_native
from specconv.runtime.graphs.gdn import PendingStates
from specconv.runtime.stored import StoredWeight

MAX_TOKENS = 16  # the batched torch form and the chunked form take longer inputs (prompts)
MIN_THREAD_VALUES = 1 << 16  # values of work per thread before a call splits


def available() -> bool:
    module = dequant_native._module()
    return (module is not None and hasattr(module, "gdn")
            and not dequant_native.switches() & (dequant_native.NO_NATIVE | dequant_native.NO_NATIVE_GDN))


def _cpu_float32(*tensors) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _threads(threads: int | None, values: int) -> int:
    """Threads for a call of `values` of work: up to `threads` (torch's count by default), each with at
    least MIN_THREAD_VALUES."""
    return max(1, min(torch.get_num_threads() if threads is None else threads, values // MIN_THREAD_VALUES))


def applies(q: torch.Tensor, state: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether `delta_rule_tokens` takes this call: float32 on the CPU, few tokens, contiguous state
    and destination."""
    tensors = (q, state) if out is None else (q, state, out)
    return (q.shape[0] <= MAX_TOKENS and available() and _cpu_float32(*tensors)
            and all(t.is_contiguous() for t in tensors))


def conv_applies(m: torch.Tensor, conv_state: torch.Tensor, weight) -> bool:
    """Whether `conv_tokens` takes this call: float32 on the CPU, few tokens."""
    return m.shape[0] <= MAX_TOKENS and available() and _cpu_float32(m, conv_state, weight)


def conv_tokens(m: torch.Tensor, conv_state: torch.Tensor, weight, keep: int,
                threads: int | None = None):
    """The depthwise causal conv of n inputs m [n, C] after the previous K-1 inputs conv_state
    [K-1, C] (oldest first), weight [C, K]: (sums [n, C] before the activation, the windows after
    each of the last `keep` tokens [keep, K-1, C], contiguous). float32, CPU; the weight a tensor or
    a StoredWeight."""
    n, channels = m.shape
    k_size = weight.shape[1]
    if conv_state.shape != (k_size - 1, channels) or weight.shape != (channels, k_size) or not 0 <= keep <= n:
        raise ValueError(f"causal conv shapes do not agree: inputs {tuple(m.shape)}, state {tuple(conv_state.shape)}, "
                         f"weight {tuple(weight.shape)}, keep {keep}")
    m, conv_state = m.contiguous(), conv_state.contiguous()
    weight = (weight.dense(torch.float32) if isinstance(weight, StoredWeight) else weight).contiguous()
    sums = torch.empty(n, channels, dtype=torch.float32)
    states = torch.empty(keep, k_size - 1, channels, dtype=torch.float32)
    dequant_native._module().gdn_conv(conv_state.data_ptr(), m.data_ptr(), weight.data_ptr(),
                                      sums.data_ptr(), states.data_ptr(), n, channels, k_size, n - keep, keep,
                                      _threads(threads, n * channels * k_size))
    return sums, states


def delta_rule_tokens(q, k, v, g, beta, state, out: torch.Tensor | None = None, threads: int | None = None):
    """q, k [n, nv, dk], v [n, nv, dv], g, beta [n, nv], state S [nv, dk, dv] (float32, CPU).
    Returns (o [n, nv, dv], δ [nv, n, dv], the state after the n tokens): written into `out` when
    given (which may be `state` itself), else a new tensor. `state` is left intact unless it is `out`."""
    n, nv, dk = k.shape
    dv = v.shape[-1]
    if state.shape != (nv, dk, dv) or q.shape != k.shape or v.shape[:2] != (n, nv) or g.shape != (n, nv) \
            or beta.shape != (n, nv):
        raise ValueError(f"gated delta rule shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}, "
                         f"state {tuple(state.shape)}")
    q, k, v, g, beta = (t.to(torch.float32).contiguous() for t in (q, k, v, g, beta))
    if out is None:
        out = torch.empty_like(state)
    o = torch.empty(n, nv, dv, dtype=torch.float32)
    delta = torch.empty(nv, n, dv, dtype=torch.float32)
    dequant_native._module().gdn(state.data_ptr(), out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                 g.data_ptr(), beta.data_ptr(), o.data_ptr(), delta.data_ptr(), n, nv, dk, dv,
                                 _threads(threads, nv * dk * dv * max(n, 1)))
    return o, delta, out


class NativePendingStates(PendingStates):
    """PendingStates of a batch the native step computed: an earlier token's state (a rollback into
    the batch) is the native step run again over the batch's tokens up to that one, from the state
    before the batch, rather than PendingStates' closed form. The step's arithmetic per token does not
    depend on how many tokens it is given, so the kept state has the bits one-token decode steps would
    have left: the closed form's differ in the last place, and an 8-bit activation product
    (runtime/dq_dot_i8.inc) after the rollback turns that into other codes, so a speculative round
    that rejected a draft would continue from other bits than plain decoding."""

    def __init__(self, state, q, k, v, g, beta, delta, first: int, last: torch.Tensor):
        super().__init__(state, k.permute(1, 2, 0), delta, g.t().cumsum(-1), first, last=last)
        self.inputs = (q, k, v, g, beta)

    def state(self, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if i == self.keep - 1:
            return super().state(i, out)
        t = self.first + i + 1
        return delta_rule_tokens(*(x[:t] for x in self.inputs), self.state0, out=out)[2]
