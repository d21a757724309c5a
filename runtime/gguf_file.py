"""Open a GGUF model (one file or split shards) for the runtime: metadata and lazy tensors.

Parsing is `runtime/gguf_reader.py`'s (memory-mapped; a release-size tokenizer header takes a
fraction of a second, where gguf.GGUFReader takes tens of seconds). Tensors stay in the map until a
model asks for them (runtime/weights.py). A split model may be named by any of its shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from gguf import GGMLQuantizationType

from specconv.archs.errors import SpecconvError
from specconv.runtime.gguf_reader import GgufTensor, decode_value, first_shard, open_gguf

@dataclass(frozen=True)
class ModelTensor:
    """What the runtime needs of a stored tensor: type, ggml-order shape, stored bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order, as GGUF stores it
    stored: GgufTensor

    @property
    def data(self):
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
        from specconv.runtime.weights import load_tensor

        if name not in self.tensors:
            raise SpecconvError(f"{self.paths[0].name}: missing tensor {name}")
        return load_tensor(self, name, torch.device(device), dtype, "dense", False, None)
