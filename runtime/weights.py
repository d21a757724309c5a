"""The weights of a loaded model: which tensors, in what form, on which device.

Two forms (`mode`):
* "stored" (default): every tensor of two or more dimensions stays in its GGUF type as a
  `StoredWeight` (runtime/stored.py) — on the CPU a view of the memory map (nothing copied at
  load), on a GPU a copy of the stored bytes — and is dequantized per use. Memory ≈ the file.
* "dense": every tensor dequantized into the compute dtype at load (float32 for the tensors a graph
  keeps wide). Memory ≈ parameters × dtype size; kept as the reference the stored form is tested
  against, and for the benchmarks.
One-dimensional tensors (norms, biases, decays) are always materialized: they are tiny and used
element-wise. With `placement.offload` the stored bytes stay in the memory map whatever the compute
device, and each use brings the rows it needs there.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType

from specconv.archs.errors import SpecconvError
from specconv.runtime.backend import for_device
from specconv.runtime.dequant import SUPPORTED, require_supported, row_bytes
from specconv.runtime.gguf_file import GGUFModelFile
from specconv.runtime.placement import Placement
from specconv.runtime.rows_first import RowsFirstType, moved_as_rows
from specconv.runtime.stored import ReadCounter, StoredWeight

MODES = ("stored", "dense")
_INTEGER = {
    GGMLQuantizationType.I8: torch.int8, GGMLQuantizationType.I16: torch.int16,
    GGMLQuantizationType.I32: torch.int32, GGMLQuantizationType.I64: torch.int64,
}


class Weights(dict):
    """name -> torch.Tensor | StoredWeight, with the placement the graphs move activations by."""

    def __init__(self, placement: Placement, counter: ReadCounter):
        super().__init__()
        self.placement = placement
        self.counter = counter


def _file_bytes(file: GGUFModelFile, name: str) -> torch.Tensor:
    """The stored bytes of a tensor as a uint8 torch view of the memory map, one row per last axis."""
    t = file.tensors[name]
    raw = t.data
    shape = t.stored.torch_shape
    if t.tensor_type not in _INTEGER:
        require_supported(t.tensor_type)
    width = (row_bytes(t.tensor_type, shape[-1]) if t.tensor_type in SUPPORTED
             else shape[-1] * torch.empty(0, dtype=_INTEGER[t.tensor_type]).element_size())
    expected = int(np.prod(shape[:-1], dtype=np.int64)) * width
    if raw.size != expected:
        raise SpecconvError(f"{file.paths[0].name}: tensor {name} holds {raw.size} bytes, its shape "
                            f"{list(shape)} and type {t.tensor_type.name} need {expected}")
    with warnings.catch_warnings():  # a read-only map: the runtime never writes to these bytes
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).reshape(*shape[:-1], width)


def load_tensor(file: GGUFModelFile, name: str, device: torch.device, dtype: torch.dtype, mode: str,
                offload: bool, counter: ReadCounter):
    """One tensor in the form `mode` asks for (see the module docstring)."""
    t = file.tensors[name]
    raw = _file_bytes(file, name)
    shape = t.stored.torch_shape
    if t.tensor_type in _INTEGER:
        return raw.view(_INTEGER[t.tensor_type]).reshape(shape).to(device)
    if mode == "dense" or len(shape) < 2:
        return for_device(device).dequantize_rows(raw.to(device), t.tensor_type, dtype).reshape(shape)
    qtype = t.tensor_type
    if not offload:  # resident: in the type the device's backend keeps it in (the file's, on the CPU)
        qtype = for_device(device).stored_type(qtype, shape)
        if isinstance(qtype, RowsFirstType):  # rearranged where it will stay, one copy of the bytes there
            raw = moved_as_rows(raw, qtype, device)
        elif device.type != "cpu":
            raw = raw.to(device)  # resident on the device, still packed
    return StoredWeight(raw, qtype, shape, dtype, device, counter)
