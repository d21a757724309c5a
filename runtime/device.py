"""Device and compute-dtype choice. Same code path on every device; CUDA is only preferred."""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError

_DTYPES = {
    "f32": torch.float32, "float32": torch.float32,
    "f16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "f64": torch.float64, "float64": torch.float64,  # for exact comparisons against float64 references
}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`auto` = CUDA when available, else CPU; anything torch understands otherwise."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpecconvError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecconvError("device cuda asked for, but torch sees no CUDA GPU")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Compute dtype of the weights and activations. Default float32 (the reference precision);
    reductions (norms, softmax, router, recurrent state) always run in float32 anyway."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise SpecconvError(f"unknown dtype {dtype!r} (use f32, f16, bf16 or f64)")
    return _DTYPES[dtype]


def available_devices() -> list[str]:
    """Devices the tests run on: CPU always, CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
