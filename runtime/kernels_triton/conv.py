"""The depthwise causal conv + SiLU before a Gated DeltaNet rule, for 1-16 tokens in one Triton launch,
each kept token's window in its own slot.

    causal_conv(m, states, weight, src_slot, dst_slots, out=None) -> activations [n, C] (m's dtype)

m [n, C]: the pre-conv inputs; states [slots, K-1, C]: the ring of the sequence's conv windows for this
layer (runtime/memory.py `Memory.conv[layer][seq]`, token-major: a window is the last K-1 input rows,
oldest first); weight [C, K] (dense values). The window before the batch is read from slot
`src_slot` and the window after token n - keep + i written to slot `dst_slots[i]` (keep =
len(dst_slots) ≤ n). Slots as in kernels_triton.gdn (int64 tensors on the device, or ints). The
source may also be the last destination (a ring of one), not an earlier one: the kernel writes the
windows in order and would read a row it had overwritten. Sums in float32, as runtime/graphs/gdn.py's
`causal_conv`, the oracle of the tests.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common
from specconv.runtime.kernels_triton.gdn import MAX_TOKENS, slot_index

BLOCK_C = 128  # channels per program


def causal_conv(m: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, src_slot, dst_slots,
                out: torch.Tensor | None = None) -> torch.Tensor:
    op = "causal_conv"
    if m.dim() != 2 or weight.dim() != 2 or states.dim() != 3:
        raise SpecconvError(f"{op}: expected m [n, C], states [slots, K-1, C], weight [C, K] (got m "
                            f"{tuple(m.shape)}, states {tuple(states.shape)}, weight {tuple(weight.shape)})")
    n, channels = m.shape
    k_size = weight.shape[1]
    _common.check_shape(op, "weight", weight, (channels, k_size))
    _common.check_shape(op, "states", states, (states.shape[0], k_size - 1, channels))
    if not 1 <= n <= MAX_TOKENS or k_size < 2:
        raise SpecconvError(f"{op}: {n} tokens (1..{MAX_TOKENS}) and a kernel of {k_size} taps (2 or more)")
    for name, t in (("m", m), ("states", states), ("weight", weight)):
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    device = _common.check_device(op, m, states, weight)
    src = slot_index(op, "src_slot", src_slot, states.shape[0], device, length=1)
    dst = slot_index(op, "dst_slots", dst_slots, states.shape[0], device)
    keep = dst.shape[0]
    if keep > n:
        raise SpecconvError(f"{op}: {keep} destination slots for {n} tokens")
    if not isinstance(src_slot, torch.Tensor) and not isinstance(dst_slots, torch.Tensor):  # values known here
        source = src_slot if isinstance(src_slot, int) else list(src_slot)[0]
        if source in ([dst_slots] if isinstance(dst_slots, int) else list(dst_slots))[:-1]:
            raise SpecconvError(f"{op}: the source slot {source} may only be the last destination")
    if out is None:
        out = torch.empty(n, channels, dtype=m.dtype, device=device)
    _common.check_shape(op, "out", out, (n, channels))
    _common.check_device(op, m, out)
    _common.check_last_contiguous(op, "out", out)
    jit = _common.jit_module("_recurrent_jit")
    jit.causal_conv_kernel[(_common.cdiv(channels, BLOCK_C),)](
        m, states, weight, src, dst, out, n, keep, channels, m.stride(0), states.stride(0), states.stride(1),
        weight.stride(0), out.stride(0), K=k_size, BLOCK_C=BLOCK_C,
        enable_fp_fusion=False)  # no FMA: the bits of gdn_step's folded conv (kernels_triton.gdn `conv=`)
    return out
