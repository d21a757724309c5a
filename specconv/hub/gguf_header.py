"""A fast, read-only scan of a GGUF header for the hub plan: scalar KV values, KV entry sizes, tensor infos.

The parsing is runtime/gguf_reader's (one GGUF header reader in the project); this module only shapes
its result for the plan: strings decoded, arrays skipped rather than decoded (a release tokenizer's
248k tokens + merges would cost seconds and the plan needs none of them), absolute tensor offsets.
The tests compare this scan with gguf.GGUFReader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFValueType

from specconv.runtime.gguf_reader import read_header as read_gguf_header
from specconv.errors import SpecconvError


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


def read_header(path: Path) -> GgufHeader:
    path = Path(path)
    header = read_gguf_header(path, arrays=False)
    kv = {key: HeaderKV(key, entry.vtype, _decoded(entry.value, path), header.kv_nbytes[key])
          for key, entry in header.kv.items()}
    tensors = [HeaderTensor(t.name, t.shape, t.ggml_type, t.offset, t.n_bytes) for t in header.tensors]
    return GgufHeader(path, kv, tensors, header.alignment, header.data_offset)


def _decoded(value: object, path: Path) -> object:
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecconvError(f"{path.name}: a GGUF string is not UTF-8") from None
