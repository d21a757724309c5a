"""Open a GGUF model (one file or split shards) for the runtime: metadata and lazy tensors.

Parsing is `archs/gguf_reader.py`'s (memory-mapped; a release-size tokenizer header takes a
fraction of a second, where gguf.GGUFReader takes tens of seconds). A tensor is read and
dequantized only when asked for. A split model may be named by any of its shards.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from specconv.archs.errors import SpecconvError
from specconv.archs.gguf_reader import GgufTensor, decode_value, first_shard, open_gguf

_INTEGER_VIEWS = {
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class ModelTensor:
    """What the runtime needs of a stored tensor: type, ggml-order shape, stored bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order, as GGUF stores it
    stored: GgufTensor

    @property
    def data(self) -> np.ndarray:
        """The stored bytes (a read-only uint8 view into the file)."""
        return self.stored.raw()


class GGUFModelFile:
    """The merged view of one GGUF model: metadata from shard 1, tensors from every shard."""

    def __init__(self, paths: str | os.PathLike | Iterable[str | os.PathLike]):
        given = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
        if not given:
            raise SpecconvError("no GGUF file given")
        model = open_gguf(first_shard(given[0]))
        if len(given) > 1 and sorted(given) != sorted(model.paths):
            raise SpecconvError(f"{given[0].name}: the files given are not the shards of one model "
                                f"(expected {', '.join(p.name for p in model.paths)})")
        self.paths = model.paths
        self.kv: dict[str, Any] = {key: decode_value(entry.value) for key, entry in model.kv.items()}
        self.tensors = {name: ModelTensor(name, t.ggml_type, t.shape, t) for name, t in model.tensors.items()}

    @property
    def arch(self) -> str:
        arch = self.kv.get("general.architecture")
        if not arch or not isinstance(arch, str):
            raise SpecconvError(f"{self.paths[0].name}: no general.architecture string")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.kv.get(key, default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self.tensors[name].tensor_type

    def load(self, name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor `name` in torch order (the reverse of ggml's), dequantized, on `device` as `dtype`."""
        t = self.tensors.get(name)
        if t is None:
            raise SpecconvError(f"{self.paths[0].name}: missing tensor {name}")
        out = dequantize(t.stored)
        return out.to(device=device, dtype=dtype if out.is_floating_point() else out.dtype)


def dequantize(t: GgufTensor) -> torch.Tensor:
    """A stored tensor as a float32 (or integer) CPU tensor in torch order."""
    raw, shape, qtype = t.raw(), t.torch_shape, t.ggml_type
    with warnings.catch_warnings():  # read-only map: F32 weights on CPU stay backed by the file, never written
        warnings.simplefilter("ignore", UserWarning)
        if qtype == GGMLQuantizationType.F32:
            return torch.from_numpy(raw.view(np.float32)).reshape(shape)
        if qtype == GGMLQuantizationType.F16:
            return torch.from_numpy(raw.view(np.float16)).float().reshape(shape)
        if qtype == GGMLQuantizationType.BF16:  # reinterpret the bits, no rounding
            return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).float().reshape(shape)
        if qtype in _INTEGER_VIEWS:
            return torch.from_numpy(np.array(raw.view(_INTEGER_VIEWS[qtype]))).reshape(shape)
    try:
        values = t.to_float32()
    except NotImplementedError:
        raise SpecconvError(f"tensor type {qtype.name} cannot be dequantized by the gguf package") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
