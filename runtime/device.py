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


def resolve_devices(spec: str | torch.device | None = "auto") -> list[torch.device]:
    """`cuda:0,cuda:1` (or `cpu,cpu`: several CPU slots, the placement code on one CPU) -> devices."""
    if isinstance(spec, str) and "," in spec:
        devices = [resolve_device(part.strip()) for part in spec.split(",") if part.strip()]
        if len({d.type for d in devices}) > 1:
            raise SpecconvError(f"--device {spec}: mix of device types; give devices of one kind")
        return devices
    return [resolve_device(spec)]


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Compute dtype of the weights and activations. Default: float32 on the CPU (the reference
    precision, and the fastest CPU matrix product); bfloat16 on CUDA (the dtype the models were trained
    in: half the dequantized temporaries and activation memory of float32, full tensor-core rate).
    Reductions (norms, softmax, router, recurrent state) run in float32 whatever the dtype."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise SpecconvError(f"unknown dtype {dtype!r} (use f32, f16, bf16 or f64)")
    return _DTYPES[dtype]


def available_devices() -> list[str]:
    """Devices the tests run on: CPU always, CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor (ids, positions) on `device` without a host sync: on CUDA copied from pinned
    memory without blocking (a pageable copy waits for the stream to drain; the caching host allocator
    keeps the pinned block until the copy is done), elsewhere as `.to` would."""
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
