"""Read a GGUF model (one file or split shards): the one GGUF reader of the project.

Used by the runtime (loading), convert (inspect, MTP grafting) and the hub pipeline. It is the one
module of `archs/` that touches files: GGUF format knowledge shared by every layer, which may
import nothing but `archs/`.

Everything is memory-mapped: tensor bytes are views into the file and are only touched when they
are copied or re-typed. KV pairs keep their exact GGUF value types (and strings their raw bytes),
so writing them back reproduces the original metadata byte for byte.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
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
    _view: np.ndarray  # the stored bytes: a uint8 slice of the file's memory map

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The numpy/torch order (reverse of ggml)."""
        return tuple(reversed(self.shape))

    @property
    def n_dims(self) -> int:
        return len(self.shape)

    def raw(self) -> np.ndarray:
        """The stored bytes, as a flat uint8 view (no copy)."""
        return self._view

    def to_float32(self) -> np.ndarray:
        """Dequantized values in numpy order (works for every type gguf.quants knows, K-quants included)."""
        from gguf.quants import dequantize

        if self.ggml_type == GGMLQuantizationType.F32:
            return np.array(self._view.view(np.float32)).reshape(self.torch_shape)
        if self.ggml_type == GGMLQuantizationType.F16:
            return self._view.view(np.float16).astype(np.float32).reshape(self.torch_shape)
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        rows = np.asarray(self._view).reshape(-1, self.shape[0] // block * size)
        return dequantize(rows, self.ggml_type).reshape(self.torch_shape).astype(np.float32)


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
        if not value or not isinstance(value, str):
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
        return _int_value(value, f"{self.path.name}: {self.arch_key('block_count')}")

    def nextn_layers(self) -> int:
        value = self.get(self.arch_key("nextn_predict_layers"), 0) or 0
        return _int_value(value, f"{self.path.name}: {self.arch_key('nextn_predict_layers')}")

    def __iter__(self) -> Iterator[GgufTensor]:
        return iter(self.tensors.values())


def _show(name: str) -> str:
    """A key or tensor name from the file as error messages show it: one line, printable, bounded."""
    text = name if name.isprintable() else repr(name)[1:-1]
    return text if len(text) <= 80 else text[:77] + "..."


def _int_value(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecconvError(f"{where} must be an integer, found {value!r}"[:200])
    return value


def decode_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", errors="replace") for v in value]
    return value


def first_shard(path: str | Path) -> Path:
    """Shard 1 of the split model `path` belongs to (the path itself for an unsplit file)."""
    path = Path(path)
    match = _SHARD_RE.match(path.name)
    if match is None:
        return path
    return path.with_name(f"{match['prefix']}-00001-of-{match['count']}.gguf")


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
        raise SpecconvError(f"{path.name}: missing shard(s) of the split model: {', '.join(missing)} next to it")
    return paths


_SCALARS = {  # GGUF scalar value types -> (struct format, size)
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1), GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2), GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1), GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8), GGUFValueType.FLOAT64: ("<d", 8),
}
_GGUF_MAGIC = 0x46554747  # "GGUF" read as a little-endian u32


class _Cursor:
    """Sequential little-endian reads over a memory map.

    gguf.GGUFReader builds one numpy array per string, which takes tens of seconds on a real
    vocabulary (150k-250k tokens); plain struct reads take a fraction of a second.
    """

    def __init__(self, buf, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def take(self, fmt: str, size: int):
        if self.pos + size > len(self.buf):
            raise SpecconvError(f"{self.name}: truncated GGUF header")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> bytes:
        n = self.take("<Q", 8)
        if self.pos + n > len(self.buf):
            raise SpecconvError(f"{self.name}: truncated GGUF header")
        value = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return value

    def value(self, vtype: GGUFValueType, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.take(*_SCALARS[vtype])
        raise SpecconvError(f"{self.name}: KV {_show(key)} has unknown value type {int(vtype)}")

    def kv(self, arrays: bool = True) -> MetaKV:
        """One KV entry; with arrays=False an array's elements are skipped and its value is None."""
        key = self.string().decode("utf-8", errors="replace")
        vtype = self._vtype(key)
        if vtype != GGUFValueType.ARRAY:
            return MetaKV(key, self.value(vtype, key), vtype)
        sub = self._vtype(key)
        count = self.take("<Q", 8)
        if not arrays:
            self._skip_array(sub, count, key)
            return MetaKV(key, None, vtype, sub)
        if sub == GGUFValueType.ARRAY:
            raise SpecconvError(f"{self.name}: KV {_show(key)}: nested arrays are not supported")
        if sub == GGUFValueType.STRING:
            return MetaKV(key, [self.string() for _ in range(count)], vtype, sub)
        fmt, size = _SCALARS[sub]
        end = self.pos + size * count
        if end > len(self.buf):
            raise SpecconvError(f"{self.name}: truncated GGUF header")
        values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos).tolist()
        self.pos = end
        return MetaKV(key, values, vtype, sub)

    def _skip_array(self, sub: GGUFValueType, count: int, key: str) -> None:
        if sub in _SCALARS:
            self.skip(count * _SCALARS[sub][1])
        elif sub == GGUFValueType.STRING:
            for _ in range(count):
                self.skip(self.take("<Q", 8))
        elif sub == GGUFValueType.ARRAY:
            for _ in range(count):
                self._skip_array(self._vtype(key), self.take("<Q", 8), key)
        else:
            raise SpecconvError(f"{self.name}: KV {_show(key)} has unknown value type {int(sub)}")

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise SpecconvError(f"{self.name}: truncated GGUF header")
        self.pos += n

    def _vtype(self, key: str) -> GGUFValueType:
        raw = self.take("<I", 4)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise SpecconvError(f"{self.name}: KV {_show(key)} has unknown value type {raw}") from None


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF tensor table, with its data's absolute place in the file."""

    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    ggml_type: GGMLQuantizationType
    offset: int  # absolute offset of the data in the file
    n_bytes: int


@dataclass
class GgufHeader:
    """What precedes the tensor data of one GGUF file: KV entries (with their byte sizes) and tensor infos."""

    kv: dict[str, MetaKV]
    kv_nbytes: dict[str, int]  # each whole entry as stored: key, type and value
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int


def scan_header(buf, name: str, arrays: bool = True) -> GgufHeader:
    """Parse a GGUF header from a byte buffer (a memory map); with arrays=False array values are
    skipped (None), which keeps a scan of a release-size tokenizer fast."""
    cur = _Cursor(buf, name)
    if len(buf) < 24 or cur.take("<I", 4) != _GGUF_MAGIC:
        raise SpecconvError(f"{name}: not a GGUF file (bad magic), so not a readable GGUF model")
    version = cur.take("<I", 4)
    if version & 0xFFFF == 0:
        raise SpecconvError(f"{name}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise SpecconvError(f"{name}: GGUF version {version} is not supported")
    n_tensors, n_kv = cur.take("<Q", 8), cur.take("<Q", 8)
    kv: dict[str, MetaKV] = {}
    kv_nbytes: dict[str, int] = {}
    for _ in range(n_kv):
        start = cur.pos
        entry = cur.kv(arrays)
        kv[entry.key], kv_nbytes[entry.key] = entry, cur.pos - start
    infos = []
    for _ in range(n_tensors):
        tensor_name = cur.string().decode("utf-8", errors="replace")
        n_dims = cur.take("<I", 4)
        if n_dims > 4:  # GGML_MAX_DIMS; also stops a huge count from looping over the header
            raise SpecconvError(f"{name}: tensor {_show(tensor_name)} has {n_dims} dimensions (at most 4)")
        dims = tuple(cur.take("<Q", 8) for _ in range(n_dims))
        raw_type, offset = cur.take("<I", 4), cur.take("<Q", 8)
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise SpecconvError(f"{name}: tensor {_show(tensor_name)} has unknown type {raw_type}") from None
        infos.append((tensor_name, dims, ggml_type, offset))
    align_kv = kv.get("general.alignment")
    align = align_kv.value if align_kv is not None else 32
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise SpecconvError(f"{name}: general.alignment {align!r} is not a power of two"[:200])
    data_start = (cur.pos + align - 1) // align * align
    tensors = []
    for tensor_name, dims, ggml_type, offset in infos:
        nbytes = tensor_nbytes(dims, ggml_type, f"{name}: tensor {tensor_name}")
        if offset % align:
            raise SpecconvError(f"{name}: tensor {_show(tensor_name)} data offset {offset} is not a multiple of the "
                                f"alignment {align}")
        start = data_start + offset
        if start + nbytes > len(buf):
            raise SpecconvError(f"{name}: tensor {_show(tensor_name)} lies beyond the end of the file (truncated?)")
        tensors.append(TensorInfo(tensor_name, dims, ggml_type, start, nbytes))
    return GgufHeader(kv, kv_nbytes, tensors, align, data_start)


def _map(path: Path) -> np.memmap:
    try:
        return np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise SpecconvError(f"{path.name}: cannot map the file ({exc})") from None


def read_header(path: str | Path, arrays: bool = True) -> GgufHeader:
    """The header of one GGUF file (no tensor data is touched)."""
    path = Path(path)
    return scan_header(_map(path), path.name, arrays)


def _read_shard(path: Path, index: int) -> tuple[dict[str, MetaKV], list[GgufTensor]]:
    buf = _map(path)
    header = scan_header(buf, path.name)
    tensors = [GgufTensor(t.name, t.ggml_type, t.shape, t.n_bytes, index, buf[t.offset:t.offset + t.n_bytes])
               for t in header.tensors]
    return header.kv, tensors


def open_gguf(path: str | Path) -> GgufFile:
    """Open a GGUF model; for split models give the first shard and the siblings are found by name."""
    paths = shard_paths(path)
    kv: dict[str, MetaKV] = {}
    tensors: dict[str, GgufTensor] = {}
    declared_total = None
    for index, shard in enumerate(paths):
        shard_kv, shard_tensors = _read_shard(shard, index)
        if len(paths) > 1:
            split_no = shard_kv.get(Keys.Split.LLM_KV_SPLIT_NO)
            split_count = shard_kv.get(Keys.Split.LLM_KV_SPLIT_COUNT)
            if split_no is None or split_count is None:
                raise SpecconvError(f"{shard.name}: named like a split shard but has no split.* keys")
            if (_int_value(split_no.value, f"{shard.name}: split.no") != index
                    or _int_value(split_count.value, f"{shard.name}: split.count") != len(paths)):
                raise SpecconvError(f"{shard.name}: split.no/split.count do not match its file name")
            total = shard_kv.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
            if total is not None:
                declared_total = _int_value(total.value, f"{shard.name}: split.tensors.count")
        if index == 0:
            kv = {k: v for k, v in shard_kv.items() if k not in _SPLIT_KEYS}
        for t in shard_tensors:
            if t.name in tensors:
                raise SpecconvError(f"{shard.name}: tensor {_show(t.name)} appears twice")
            tensors[t.name] = t
    if declared_total is not None and declared_total != len(tensors):
        raise SpecconvError(f"{paths[0].name}: split.tensors.count says {declared_total}, shards hold {len(tensors)}")
    return GgufFile(paths, kv, tensors)


def tensor_nbytes(shape_ggml: tuple[int, ...], ggml_type: GGMLQuantizationType, where: str = "tensor") -> int:
    """Bytes of a tensor, in Python integers (numpy's product wraps around on hostile shapes)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    n = math.prod(int(d) for d in shape_ggml)
    if n >= 1 << 62:
        raise SpecconvError(f"{where}: ggml shape {list(shape_ggml)} has too many elements")
    if shape_ggml and shape_ggml[0] % block:
        raise SpecconvError(f"{where}: rows of {shape_ggml[0]} are not whole {ggml_type.name} blocks of {block}")
    return n // block * size

