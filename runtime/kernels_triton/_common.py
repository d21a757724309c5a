"""What the Triton kernel wrappers share: Triton imported on first use (the package imports without
it), the device rule, and the one-line input errors."""

from __future__ import annotations

import importlib
import os
import re

import torch

from specconv.archs.errors import SpecconvError

# Activation / value dtypes the kernels read and write (computed in float32 inside).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read when a kernel
    module is first imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# The oldest Triton the kernels are known to compile and run on: the version a GPU run used
# (docs/benchmarks.md); older releases refuse some of their forms (tl.dot over narrow tiles, a
# constexpr rebound in a static loop), so they are not tried.
MIN_TRITON = (3, 6)


def why_unavailable() -> str | None:
    """Why the kernels cannot run here (one line), or None: Triton missing or older than MIN_TRITON,
    or neither a CUDA device nor the interpreter."""
    try:
        triton = importlib.import_module("triton")
    except ImportError:
        return "the `triton` package is not installed (pip install triton)"
    version = triton.__version__
    if _version(version) < MIN_TRITON:
        return (f"Triton {version} is older than {'.'.join(map(str, MIN_TRITON))}, the oldest the "
                "kernels are tested on (pip install -U triton)")
    if not (interpreting() or torch.cuda.is_available()):
        return "no CUDA device (and TRITON_INTERPRET is not 1)"
    return None


def available() -> bool:
    """Whether the kernels can run here (`why_unavailable`)."""
    return why_unavailable() is None


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.6.0" or "3.7.0+git1234"; (0, 0) if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def jit_module(name: str):
    """The module of jitted kernels `name` (in this package), importing Triton on first use."""
    try:
        importlib.import_module("triton")
    except ImportError as e:
        raise SpecconvError("the Triton kernels need the `triton` package (pip install triton)") from e
    return importlib.import_module(f"{__package__}.{name}")


def check_device(op: str, *tensors: torch.Tensor) -> torch.device:
    """The one device all `tensors` are on: CUDA, or the CPU under the interpreter."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise SpecconvError(f"{op}: tensors on different devices ({device} and {t.device})")
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return device
    raise SpecconvError(f"{op}: the Triton kernels run on CUDA tensors (CPU tensors only under "
                        f"TRITON_INTERPRET=1), got {device}")


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise SpecconvError(f"{op}: {name} must be float32, bfloat16 or float16 (got {t.dtype})")


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise SpecconvError(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_last_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    """The kernels step through the last dimension one element at a time and take the other
    strides as they are (views of a larger buffer are fine)."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise SpecconvError(f"{op}: {name} must have a contiguous last dimension (strides {t.stride()})")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


MIN_DOT = 16  # tl.dot's smallest inner dimension on a GPU (the interpreter takes any)


def dot_width(n: int) -> int:
    """A tile side that tl.dot multiplies over: n padded to a power of two, at least MIN_DOT (the padding
    is masked to zero, adding nothing to the products)."""
    return max(MIN_DOT, next_power_of_2(n))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_MULTIPROCESSORS: dict[int, int] = {}
INTERPRETER_MULTIPROCESSORS = 2  # under the interpreter: a small stand-in, so that the tests cut matrices too


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (read once per device: no call into the driver per product)."""
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]


# Per-tile arrival counters of the products cut along their inner dimension (matmul.py: the last
# piece of a tile to finish adds the pieces). Zero at rest: the last piece resets its tile's counter.
COUNTERS_MIN = 1 << 14  # int32 slots (64 KiB): every cut product of the planned models fits at once
_counters: dict[torch.device, list[torch.Tensor]] = {}


def capturing(device: torch.device) -> bool:
    """Whether the current stream is recording a CUDA graph (launches recorded, not run)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def tile_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """An int32 tensor of at least `count` zeros on `device`, shared by every launch (launches on one
    stream run one after another, and each leaves its counters at zero), or None when none that
    large exists and none may be made now: while a CUDA graph is being captured (an allocation there
    would belong to the graph's pool and its zeroing to the graph); the caller then adds the pieces
    by a second launch. A larger buffer is made outside a capture; the smaller ones are kept, since a
    captured graph holds their addresses."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    held = _counters.setdefault(device, [])
    if held and held[-1].numel() >= count:
        return held[-1]
    if capturing(device):
        return None
    held.append(torch.zeros(max(COUNTERS_MIN, next_power_of_2(count)), dtype=torch.int32, device=device))
    return held[-1]
