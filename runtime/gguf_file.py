"""Open a GGUF model (one file or split shards), read its metadata and tensors.

Files are memory-mapped by `gguf.GGUFReader`; a tensor is read (and dequantized) only when asked
for. Split models are found from any shard: the siblings are named
`{prefix}-{i:05d}-of-{n:05d}.gguf`, only shard 1 holds the metadata, and every shard says
`split.count`.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants

from specconv.archs.errors import SpecconvError

_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def shard_paths(path: str | os.PathLike) -> list[Path]:
    """All shards of the model `path` belongs to (just `[path]` for an unsplit file)."""
    path = Path(path)
    m = _SHARD_RE.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise SpecconvError(f"split model {path.name}: missing shard(s) {', '.join(missing)} in {path.parent}")
    return paths


def _open_reader(path: Path) -> GGUFReader:
    if not path.exists():
        raise SpecconvError(f"no such file: {path}")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises assorted errors on short or foreign files
        with open(path, "rb") as fh:
            is_gguf = fh.read(4) == b"GGUF"
        what = "truncated or damaged GGUF file" if is_gguf else "not a readable GGUF file"
        raise SpecconvError(f"{path.name}: {what} ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise SpecconvError(f"{path.name}: truncated file (tensor {t.name} ends past the end of the file)")
    return reader


def field_value(field) -> Any:
    """A metadata field as a plain Python value (scalars, strings, lists)."""
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [v.item() for i in field.data for v in field.parts[i]]
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


class GGUFModelFile:
    """The merged view of one GGUF model: metadata from shard 1, tensors from every shard."""

    def __init__(self, paths: str | os.PathLike | Iterable[str | os.PathLike]):
        if isinstance(paths, (str, os.PathLike)):
            paths = shard_paths(paths)
        else:
            paths = [Path(p) for p in paths]
            if len(paths) == 1:
                paths = shard_paths(paths[0])
        if not paths:
            raise SpecconvError("no GGUF file given")
        self.paths = paths
        self.readers = [_open_reader(p) for p in paths]
        self.kv: dict[str, Any] = {}
        for key, field in self.readers[0].fields.items():
            if not key.startswith("GGUF."):
                self.kv[key] = field_value(field)
        self._check_split()
        self.tensors = {}
        for reader, path in zip(self.readers, self.paths):
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise SpecconvError(f"tensor {t.name} appears twice (again in {path.name})")
                self.tensors[t.name] = t
        expected = self.kv.get("split.tensors.count")
        if expected is not None and expected != len(self.tensors):
            raise SpecconvError(
                f"{self.paths[0].name}: split model declares {expected} tensors but its shards hold {len(self.tensors)}"
            )

    def _check_split(self):
        count = self.kv.get("split.count", 1)
        if count != len(self.readers):
            raise SpecconvError(
                f"{self.paths[0].name}: split.count = {count} but {len(self.readers)} shard file(s) were given"
            )
        for i, reader in enumerate(self.readers):
            field = reader.fields.get("split.no")
            if count > 1 and (field is None or field_value(field) != i):
                raise SpecconvError(f"{self.paths[i].name}: expected split.no = {i}")

    @property
    def arch(self) -> str:
        arch = self.kv.get("general.architecture")
        if not arch:
            raise SpecconvError(f"{self.paths[0].name}: no general.architecture")
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
        shape = tuple(reversed([int(d) for d in t.shape]))
        out = dequantize(t.data, t.tensor_type, shape)
        return out.to(device=device, dtype=dtype if out.is_floating_point() else out.dtype)


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor data (a memory-mapped numpy view) to a float32 (or integer) CPU tensor."""
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        with warnings.catch_warnings():  # read-only map: F32 weights on CPU stay backed by the file, never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(data)).float().reshape(shape)
    if qtype == GGMLQuantizationType.BF16:  # raw uint8 rows: reinterpret the bits, no rounding
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.int16))
        return raw.view(torch.bfloat16).float().reshape(shape)
    if qtype in (GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
                 GGMLQuantizationType.I64):
        return torch.from_numpy(np.array(data)).reshape(shape)
    try:
        values = gguf_quants.dequantize(np.asarray(data), qtype)
    except NotImplementedError:
        raise SpecconvError(f"tensor type {qtype.name} cannot be dequantized by the gguf package") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
