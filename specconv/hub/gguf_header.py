"""A fast, read-only scan of a GGUF header: scalar KV values, KV entry sizes, tensor infos.

Why not gguf.GGUFReader here: it builds a numpy view per array element, which takes about 25 s for
a real Qwen3.5 tokenizer (248k tokens + merges) on a small machine, and the plan needs only the
scalars, the byte size of each KV entry and the tensor table. Arrays are skipped, not decoded.
(Writing shards still goes through gguf's reader and writer; gguf_info's tests compare this scan
with GGUFReader.)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from specconv.errors import SpecconvError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class HeaderKV:
    key: str
    vtype: GGUFValueType
    value: object  # scalar or str; None for arrays (skipped)
    nbytes: int  # the whole entry: key, type, value


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    dims: tuple[int, ...]  # ggml order (ne0 first)
    tensor_type: GGMLQuantizationType
    offset: int  # absolute offset of the data in the file
    n_bytes: int


@dataclass
class GgufHeader:
    path: Path
    kv: dict[str, HeaderKV]
    tensors: list[HeaderTensor]
    alignment: int
    data_offset: int

    def scalars(self) -> dict[str, object]:
        return {k: e.value for k, e in self.kv.items() if e.value is not None}


class _Scan:
    def __init__(self, buf, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise SpecconvError(f"{self.name}: truncated GGUF header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise SpecconvError(f"{self.name}: truncated GGUF header")
        self.pos += n

    def string(self) -> str:
        n = self.take("<Q")
        start = self.pos
        self.skip(n)
        try:
            return bytes(self.buf[start : self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise SpecconvError(f"{self.name}: a GGUF string is not UTF-8") from None

    def vtype(self) -> GGUFValueType:
        raw = self.take("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise SpecconvError(f"{self.name}: unknown GGUF value type {raw}") from None

    def value(self, vtype: GGUFValueType, decode: bool):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == GGUFValueType.STRING:
            if decode:
                return self.string()
            self.skip(self.take("<Q"))
            return None
        # array: element type, count, elements (skipped)
        sub = self.vtype()
        count = self.take("<Q")
        if sub in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[sub]))
        else:
            for _ in range(count):
                self.value(sub, decode=False)
        return None


def read_header(path: Path) -> GgufHeader:
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise SpecconvError(f"{path.name}: cannot read ({exc})") from None
    try:
        return _parse(buf, path)
    finally:
        buf.close()


def _parse(buf, path: Path) -> GgufHeader:
    scan = _Scan(buf, path.name)
    if len(buf) < 24 or buf[:4] != GGUF_MAGIC:
        raise SpecconvError(f"{path.name}: not a readable GGUF file (bad magic)")
    scan.skip(4)
    version = scan.take("<I")
    if version & 0xFFFF == 0:
        raise SpecconvError(f"{path.name}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise SpecconvError(f"{path.name}: GGUF version {version} is not supported")
    n_tensors, n_kv = scan.take("<Q"), scan.take("<Q")

    kv: dict[str, HeaderKV] = {}
    for _ in range(n_kv):
        start = scan.pos
        key = scan.string()
        vtype = scan.vtype()
        value = scan.value(vtype, decode=True)
        kv[key] = HeaderKV(key, vtype, value, scan.pos - start)

    infos = []
    for _ in range(n_tensors):
        name = scan.string()
        n_dims = scan.take("<I")
        dims = tuple(scan.take("<Q") for _ in range(n_dims))
        raw_type = scan.take("<I")
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise SpecconvError(f"{path.name}: tensor {name} has unknown type {raw_type}") from None
        infos.append((name, dims, ttype, scan.take("<Q")))

    align_kv = kv.get("general.alignment")
    alignment = int(align_kv.value) if align_kv is not None and align_kv.value else DEFAULT_ALIGNMENT
    if alignment & (alignment - 1):
        raise SpecconvError(f"{path.name}: general.alignment {alignment} is not a power of two")
    data_offset = (scan.pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, dims, ttype, rel in infos:
        block, type_size = GGML_QUANT_SIZES[ttype]
        n_elems = 1
        for d in dims:
            n_elems *= d
        n_bytes = n_elems // block * type_size
        if data_offset + rel + n_bytes > len(buf):
            raise SpecconvError(f"{path.name}: tensor {name} lies beyond the end of the file (truncated?)")
        tensors.append(HeaderTensor(name, dims, ttype, data_offset + rel, n_bytes))
    return GgufHeader(path, kv, tensors, alignment, data_offset)
