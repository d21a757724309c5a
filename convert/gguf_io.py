"""Read an existing GGUF (one file or split shards) for GGUF-to-GGUF work such as MTP grafting.

Everything is memory-mapped: tensor bytes are views into the file and are only touched when they
are copied or re-typed. KV pairs keep their exact GGUF value types (and strings their raw bytes),
so writing them back reproduces the original metadata byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, Keys

from specconv.archs.base import MetaKV
from specconv.archs.errors import SpecconvError

_SHARD_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SPLIT_KEYS = {Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT}


@dataclass
class GgufTensor:
    """One tensor of a GGUF file: its header and a lazy view of its bytes."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order (ne0 first), as GGUF stores it
    n_bytes: int
    shard: int  # 0-based index of the shard holding it
    _view: np.ndarray  # the reader's memory-mapped view

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The numpy/torch order (reverse of ggml)."""
        return tuple(reversed(self.shape))

    @property
    def n_dims(self) -> int:
        return len(self.shape)

    def raw(self) -> np.ndarray:
        """The stored bytes, as a flat uint8 view (no copy)."""
        return self._view.reshape(-1).view(np.uint8)

    def to_float32(self) -> np.ndarray:
        """Dequantized values in numpy order (works for every type gguf.quants knows, K-quants included)."""
        from gguf.quants import dequantize

        if self.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return np.asarray(self._view, dtype=np.float32).reshape(self.torch_shape)
        return dequantize(np.asarray(self._view), self.ggml_type).reshape(self.torch_shape).astype(np.float32)


class GgufFile:
    """A GGUF model as one object: merged KV (without `split.*`) and the tensors of every shard."""

    def __init__(self, paths: list[Path], kv: dict[str, MetaKV], tensors: dict[str, GgufTensor]):
        self.paths = paths
        self.kv = kv
        self.tensors = tensors

    # --- KV helpers ---------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.paths[0]

    @property
    def arch(self) -> str:
        value = self.get("general.architecture")
        if not value:
            raise SpecconvError(f"{self.path.name}: no general.architecture key; is it a model GGUF?")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        """A KV value with strings decoded (arrays of strings too)."""
        kv = self.kv.get(key)
        if kv is None:
            return default
        return decode_value(kv.value)

    def arch_key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def block_count(self) -> int:
        value = self.get(self.arch_key("block_count"))
        if value is None:
            raise SpecconvError(f"{self.path.name}: missing {self.arch_key('block_count')}")
        return int(value)

    def nextn_layers(self) -> int:
        return int(self.get(self.arch_key("nextn_predict_layers"), 0) or 0)

    def __iter__(self) -> Iterator[GgufTensor]:
        return iter(self.tensors.values())


def decode_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", errors="replace") for v in value]
    return value


def shard_paths(path: str | Path) -> list[Path]:
    """All shards of a model given its first shard (or the one file of an unsplit model)."""
    path = Path(path)
    if not path.is_file():
        raise SpecconvError(f"{path}: no such file")
    match = _SHARD_RE.match(path.name)
    if match is None:
        return [path]
    number, count = int(match["no"]), int(match["count"])
    if number != 1:
        first = path.with_name(f"{match['prefix']}-00001-of-{match['count']}.gguf")
        raise SpecconvError(f"{path.name} is shard {number} of {count}; give the first shard ({first.name})")
    paths = [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise SpecconvError(f"{path.name}: missing split shard(s) {', '.join(missing)} next to it")
    return paths


def _field_to_kv(field) -> MetaKV:
    vtype = GGUFValueType(field.types[0])
    if vtype == GGUFValueType.ARRAY:
        sub = GGUFValueType(field.types[-1])
        if len(field.types) > 2:
            raise SpecconvError(f"KV {field.name}: nested arrays are not supported")
        if sub == GGUFValueType.STRING:
            value = [bytes(field.parts[i]) for i in field.data]
        else:
            value = [v for i in field.data for v in field.parts[i].tolist()]
        return MetaKV(field.name, value, vtype, sub)
    if vtype == GGUFValueType.STRING:
        return MetaKV(field.name, bytes(field.parts[-1]), vtype)
    return MetaKV(field.name, field.parts[-1].tolist()[0], vtype)


def open_gguf(path: str | Path) -> GgufFile:
    """Open a GGUF model; for split models give the first shard and the siblings are found by name."""
    paths = shard_paths(path)
    kv: dict[str, MetaKV] = {}
    tensors: dict[str, GgufTensor] = {}
    declared_total = None
    for index, shard in enumerate(paths):
        try:
            reader = GGUFReader(shard, "r")
        except Exception as exc:  # the reader raises bare ValueErrors / struct errors on garbage
            raise SpecconvError(f"{shard.name}: not a readable GGUF file ({exc})") from None
        fields = {f.name: f for f in reader.fields.values() if not f.name.startswith("GGUF.")}
        if len(paths) > 1:
            split_no = fields.get(Keys.Split.LLM_KV_SPLIT_NO)
            split_count = fields.get(Keys.Split.LLM_KV_SPLIT_COUNT)
            if split_no is None or split_count is None:
                raise SpecconvError(f"{shard.name}: named like a split shard but has no split.* keys")
            if int(split_no.parts[-1][0]) != index or int(split_count.parts[-1][0]) != len(paths):
                raise SpecconvError(f"{shard.name}: split.no/split.count do not match its file name")
            total = fields.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
            if total is not None:
                declared_total = int(total.parts[-1][0])
        if index == 0:
            for name, field in fields.items():
                if name not in _SPLIT_KEYS:
                    kv[name] = _field_to_kv(field)
        for t in reader.tensors:
            if t.name in tensors:
                raise SpecconvError(f"{shard.name}: tensor {t.name} appears twice across shards")
            tensors[t.name] = GgufTensor(
                name=t.name,
                ggml_type=GGMLQuantizationType(t.tensor_type),
                shape=tuple(int(d) for d in t.shape),
                n_bytes=int(t.n_bytes),
                shard=index,
                _view=t.data,
            )
    if declared_total is not None and declared_total != len(tensors):
        raise SpecconvError(f"{paths[0].name}: split.tensors.count says {declared_total}, shards hold {len(tensors)}")
    return GgufFile(paths, kv, tensors)


def tensor_nbytes(shape_ggml: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    n = int(np.prod(shape_ggml)) if shape_ggml else 1
    return n // block * size


# --- writing (GGUF-to-GGUF copies: raw bytes, exact KV types) -----------------------------------

@dataclass
class RawTensor:
    """A tensor to write whose bytes are already in their final storage type."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order
    nbytes: int
    produce: Any  # () -> np.ndarray holding exactly `nbytes` bytes


def output_paths(out_path: Path, n_shards: int) -> list[Path]:
    from gguf.gguf_writer import SHARD_NAME_FORMAT

    if n_shards == 1:
        return [out_path]
    return [out_path.with_name(SHARD_NAME_FORMAT.format(out_path.stem, i + 1, n_shards)) for i in range(n_shards)]


def write_gguf(out_path: str | Path, arch: str, kv: list[MetaKV], tensors: list[RawTensor],
               split_max_size: int = 0, overwrite: bool = False, on_tensor=None) -> list[Path]:
    """Write a GGUF (split by size when asked) under temporary names, renamed only when complete."""
    import os

    from gguf import GGUFWriter

    out_path = Path(out_path)
    if out_path.suffix != ".gguf":
        raise SpecconvError(f"{out_path}: the output name must end in .gguf")
    tmp = out_path.with_name(f".{out_path.stem}.partial-{os.getpid()}.gguf")
    writer = GGUFWriter(tmp, arch, split_max_size=split_max_size)
    for entry in kv:
        if entry.key == "general.architecture":
            continue  # the writer adds it first, from `arch`
        if entry.vtype == GGUFValueType.ARRAY and len(entry.value) == 0:
            continue  # GGUF writers cannot encode empty arrays; readers treat absent and empty alike
        writer.add_key_value(entry.key, entry.value, entry.vtype, entry.sub_type)
    for t in tensors:
        # A non-uint8 dtype makes the writer take the shape as given (numpy order).
        writer.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
    finals = output_paths(out_path, len(writer.tensors))
    existing = [p for p in finals if p.exists()]
    if existing and not overwrite:
        raise SpecconvError(f"{existing[0]} already exists (use --force to overwrite)")
    temps = writer.format_shard_names(tmp)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            data = np.ascontiguousarray(t.produce()).reshape(-1).view(np.uint8)
            if data.nbytes != t.nbytes:
                raise SpecconvError(f"{t.name}: produced {data.nbytes} bytes, expected {t.nbytes}")
            writer.write_tensor_data(data)
            if on_tensor is not None:
                on_tensor(t)
        writer.close()
        for src, dst in zip(temps, finals):
            os.replace(src, dst)
    except BaseException:
        writer.close()
        for p in temps:
            p.unlink(missing_ok=True)
        raise
    return finals
