"""What the CUDA backend's parts share (runtime/backend_cuda.py): the kernel module, the devices it
runs on and the checks of which tensors its launches take; the backend's parts (products, norms,
rope and attention in runtime/backend_cuda.py, routed experts in backend_cuda_experts.py, Gated
DeltaNet's ring slots in backend_cuda_recurrent.py) each take a call where these say the kernels
fit and hand it to the torch reference they inherit otherwise."""

from __future__ import annotations

import sys

import torch

from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.stored import StoredWeight

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CudaKernelBase(TorchBackend):
    """The kernel module and the checks the CUDA backend's parts share."""

    def __init__(self, kernels=None, device_types: tuple[str, ...] = ("cuda",)):
        """`kernels`: the kernel module (runtime/kernels_triton; found by itself when None: none without
        Triton). `device_types`: where the kernels run (the CPU too under TRITON_INTERPRET=1, which is
        how the tests run this backend without a GPU)."""
        self.kernels = _triton_kernels() if kernels is None else kernels
        self.device_types = device_types

    def _kernel_for(self, raw: torch.Tensor, qtype) -> bool:
        return (self.kernels is not None and qtype in self.kernels.KERNEL_TYPES
                and raw.device.type in self.device_types and raw.numel() > 0)

    def _pointwise(self, *tensors: torch.Tensor, dtypes=KERNEL_DTYPES) -> bool:
        """Whether the one-launch kernels of norms, rope and activations take these tensors."""
        return (self.kernels is not None and all(t.device.type in self.device_types and t.dtype in dtypes
                                                  and t.device == tensors[0].device for t in tensors))

    def _norm_weight(self, weight, x: torch.Tensor):
        """A norm's weight as a tensor the kernel reads (None: no weight), or False where it cannot."""
        if weight is None:
            return None
        values = weight.dense(torch.float32) if isinstance(weight, StoredWeight) else weight
        fits = values.dim() == 1 and values.shape[0] == x.shape[-1] and self._pointwise(x, values)
        return values if fits else False

    def _norm_fits(self, x: torch.Tensor) -> bool:
        return self._pointwise(x) and x.dim() > 0 and 0 < x.shape[-1] <= self.kernels.MAX_NORM_WIDTH


def count_read(w: StoredWeight) -> None:
    """Add a product's read of w's bytes to its counter (where one is attached)."""
    if w.counter is not None:
        w.counter.bytes += w.raw.numel()


def joined_rows(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces' rows in order: a single piece as it is (no copy, no launch)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _triton_kernels():
    """runtime/kernels_triton where Triton can run its kernels here, else None; on a machine with a
    GPU, why not is said once (the torch reference then runs every operation, far slower)."""
    from specconv.runtime import kernels_triton

    why = kernels_triton.why_unavailable()
    if why is None:
        return kernels_triton
    if torch.cuda.is_available():
        sys.stderr.write(f"warning: the CUDA kernels are off: {why}; the torch reference backend runs instead\n")
    return None
