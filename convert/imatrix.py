"""llama.cpp's importance matrix (`--imatrix FILE`): read it, write it, and give each tensor its weights
as llama.cpp's quantize tool does (docs/convert.md, "importance matrix").

Two file formats, told apart by the GGUF magic:

* GGUF (what llama-imatrix writes today): per weight tensor NAME, an F32 tensor `NAME.in_sum2`
  (ggml shape [n_per_row, n_mat]: sums of squared activations, one row per expert) and an F32
  `NAME.counts` ([1, n_mat]: how many activations each sum holds); KV `imatrix.datasets` (string
  array), `imatrix.chunk_count`, `imatrix.chunk_size` (u32), all three required by the tool. A
  tensor's weights are in_sum2 / count per expert (count rounded to an integer first; an expert
  with count <= 0 gets weights 1).
* legacy `.dat`: int32 entry count; per entry int32 name length, the name, int32 ncall, int32
  value count, that many float32 (already mean * ncall); then optionally int32 chunk count and an
  int32-length dataset name. Weights are value / ncall (the values as they are when ncall <= 0).

Reads are bounds-checked (no pickle, no trust in sizes): a broken or mismatched file is one
`SpecconvError` line naming the file and the entry. The quantizer then looks each tensor up by its
GGUF name: no entry means no weights for it; an entry whose size is not row length x experts is an
error (except for token_embd, which the tool then quantizes without weights); a 3-D expert tensor's
expert e uses slice e. A non-finite weight anywhere is refused, as the tool refuses it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from specconv.archs.base import MetaKV
from specconv.archs.errors import SpecconvError

Q = GGMLQuantizationType
_GGUF_MAGIC = b"GGUF"
# Types whose encoders take weights (the others, Q8_0 and the float types, ignore an imatrix).
WEIGHTED_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL,
                            Q.IQ4_XS})
_KV_LIMIT = 127  # the tool copies file and dataset names into 128-byte override slots


@dataclass
class Imatrix:
    """A loaded importance matrix: per tensor name, its weights (float32, n_mat * n_per_row values)."""

    source: str  # the path as the user gave it (the tool writes that string into the output)
    weights: dict[str, np.ndarray]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    legacy: bool = False

    def for_tensor(self, name: str, shape: Sequence[int]) -> np.ndarray | None:
        """The weights of tensor `name` (torch-order shape: [..., rows, row length]), [n_mat * row] float32,
        or None when the file has no entry for it."""
        w = self.weights.get(name)
        if w is None:
            return None
        row = int(shape[-1])
        n_mat = int(shape[0]) if len(shape) >= 3 else 1
        if w.size != row * n_mat:
            if name in ("token_embd.weight", "per_layer_token_embd.weight"):
                return None  # the tool quantizes token embeddings without weights then
            raise SpecconvError(f"imatrix {self.source}: {name} has {w.size} weights, but the tensor needs "
                                f"{row * n_mat} ({n_mat} x rows of {row}); was the imatrix computed for another model?")
        return w

    def kv(self) -> list[MetaKV]:
        """The `quantize.imatrix.*` KV pairs llama.cpp's quantize appends to its output."""
        out = [MetaKV("quantize.imatrix.file", _clip(self.source), GGUFValueType.STRING)]
        if self.datasets:
            out.append(MetaKV("quantize.imatrix.dataset", _clip(self.datasets[0]), GGUFValueType.STRING))
        out.append(MetaKV("quantize.imatrix.entries_count", len(self.weights), GGUFValueType.UINT32))
        if self.chunk_count > 0:
            out.append(MetaKV("quantize.imatrix.chunks_count", self.chunk_count, GGUFValueType.UINT32))
        return out


def _clip(text: str) -> str:
    raw = text.encode()
    if len(raw) <= _KV_LIMIT:
        return text
    return raw[:_KV_LIMIT].decode(errors="ignore")  # the tool's strncpy; a split character is dropped


def load(path: str | Path) -> Imatrix:
    """Read an imatrix file in either format; weights normalised as the quantize tool normalises them."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            head = fh.read(4)
    except OSError as e:
        raise SpecconvError(f"imatrix {path}: cannot read it ({e.strerror or e})") from None
    imatrix = _load_gguf(p, str(path)) if head == _GGUF_MAGIC else _load_legacy(p, str(path))
    for name, w in imatrix.weights.items():
        if not np.isfinite(w).all():
            raise SpecconvError(f"imatrix {path}: {name} holds a non-finite weight (llama.cpp's quantize refuses it too)")
    return imatrix


def _load_gguf(p: Path, source: str) -> Imatrix:
    from specconv.runtime.gguf_reader import open_gguf

    try:
        f = open_gguf(p)
    except (SpecconvError, OSError, ValueError) as e:
        raise SpecconvError(f"imatrix {source}: not a readable GGUF file ({e})") from None
    missing = [k for k in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size") if k not in f.kv]
    if missing:
        raise SpecconvError(f"imatrix {source}: missing imatrix metadata ({', '.join(missing)}); llama.cpp's quantize "
                            "refuses such a file")
    datasets: list[str] = []
    entry = f.kv["imatrix.datasets"]
    if entry.vtype == GGUFValueType.ARRAY and isinstance(entry.value, (list, tuple)) and \
            all(isinstance(v, (str, bytes)) for v in entry.value):
        datasets = [v.decode(errors="replace") if isinstance(v, bytes) else v for v in entry.value]
    chunk_count = _u32(f.kv["imatrix.chunk_count"], source)
    _u32(f.kv["imatrix.chunk_size"], source)
    pairs: dict[str, list] = {}
    for t in f:
        for suffix, slot in ((".in_sum2", 0), (".counts", 1)):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                pairs.setdefault(t.name[:-len(suffix)], [None, None])[slot] = t
    if not f.tensors:
        raise SpecconvError(f"imatrix {source}: no data (no tensors)")
    weights = {}
    for name, (sums_t, counts_t) in sorted(pairs.items()):
        if sums_t is None or counts_t is None:
            raise SpecconvError(f"imatrix {source}: {name} has {'no in_sum2' if sums_t is None else 'no counts'} "
                                "tensor (mismatched sums and counts)")
        if sums_t.ggml_type != Q.F32 or counts_t.ggml_type != Q.F32:
            raise SpecconvError(f"imatrix {source}: {name}'s sums and counts must be F32")
        sums = np.array(sums_t.raw().view(np.float32))
        counts = np.array(counts_t.raw().view(np.float32))
        if counts.size == 0 or sums.size % counts.size:
            raise SpecconvError(f"imatrix {source}: {name} has {sums.size} sums for {counts.size} counts "
                                "(not a whole row per count)")
        weights[name] = _normalise(name, sums.reshape(counts.size, -1), counts, source)
    return Imatrix(source, weights, datasets, _int32(chunk_count), legacy=False)


def _normalise(name: str, sums: np.ndarray, counts: np.ndarray, source: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        if not np.isfinite(counts).all() or (np.abs(counts) >= 2.0 ** 62).any():
            raise SpecconvError(f"imatrix {source}: {name} has a count that is not a finite integer")
        rounded = np.where(counts >= 0, np.floor(counts.astype(np.float64) + 0.5),
                           np.ceil(counts.astype(np.float64) - 0.5))  # lround: halves away from zero
        count = rounded.astype(np.int64).astype(np.float32)[:, None]
        out = np.where(count > 0, sums / np.where(count > 0, count, np.float32(1)), np.float32(1))
    return np.ascontiguousarray(out, dtype=np.float32).reshape(-1)


def _u32(entry: MetaKV, source: str) -> int:
    if entry.vtype != GGUFValueType.UINT32:
        raise SpecconvError(f"imatrix {source}: {entry.key} must be a u32, not {entry.vtype.name}")
    return int(entry.value)


def _int32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


class _Cursor:
    def __init__(self, data: bytes, source: str):
        self.data, self.pos, self.source = data, 0, source

    def int32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise SpecconvError(f"imatrix {self.source}: truncated at byte {self.pos} reading {what} "
                                f"({len(self.data)} bytes in the file; is it an imatrix file?)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out


def _load_legacy(p: Path, source: str) -> Imatrix:
    data = p.read_bytes()
    cur = _Cursor(data, source)
    if len(data) < 4:
        raise SpecconvError(f"imatrix {source}: neither GGUF nor llama.cpp's legacy imatrix format (too short)")
    n_entries = cur.int32("the entry count")
    if n_entries < 1:
        raise SpecconvError(f"imatrix {source}: no data (entry count {n_entries}); is it an imatrix file?")
    weights: dict[str, np.ndarray] = {}
    for i in range(n_entries):
        length = cur.int32(f"entry {i + 1}'s name length")
        if length < 0 or length > len(data):
            raise SpecconvError(f"imatrix {source}: entry {i + 1} has a name length of {length}; is it an imatrix file?")
        name = cur.take(length, f"entry {i + 1}'s name").split(b"\0", 1)[0].decode(errors="replace")
        ncall = cur.int32(f"{name}'s call count")
        nval = cur.int32(f"{name}'s value count")
        if nval < 1:
            raise SpecconvError(f"imatrix {source}: {name} has {nval} values")
        values = np.frombuffer(cur.take(4 * nval, f"{name}'s {nval} values"), dtype="<f4").astype(np.float32)
        weights[name] = values / np.float32(ncall) if ncall > 0 else values.copy()
    datasets, chunk_count = [], 0
    if cur.pos + 4 <= len(data):  # optional trailer: chunk count, then the dataset name
        chunk_count = cur.int32("the chunk count")
        if cur.pos + 4 <= len(data):
            length = cur.int32("the dataset name length")
            if 0 < length <= len(data) - cur.pos:
                datasets.append(cur.take(length, "the dataset name").split(b"\0", 1)[0].decode(errors="replace"))
    return Imatrix(source, weights, datasets, chunk_count, legacy=True)


# ------------------------------------------------------------------------------ use in quantizing


def imatrix_plan(file_type: str, imatrix: Imatrix | None,
                 quantized: Sequence[tuple[str, Sequence[int], GGMLQuantizationType]]) -> dict[str, np.ndarray]:
    """{name: weights} for the tensors the tool quantizes (name, torch-order shape, new type; in its
    order) that the imatrix weighs. Refuses, as the tool does, a tensor that needs weights and has
    none (Q2_K in a Q2_K_S file) and an entry whose size does not fit its tensor."""
    from .quant_rules import requires_imatrix

    out = {}
    for name, shape, new_type in quantized:
        w = imatrix.for_tensor(name, shape) if imatrix is not None else None
        if w is None and requires_imatrix(file_type, name, new_type):
            if imatrix is None:
                raise SpecconvError(f"{file_type.upper()} needs an importance matrix (--imatrix FILE): llama.cpp's "
                                    f"quantize refuses to make {name} {new_type.name} without one")
            raise SpecconvError(f"imatrix {imatrix.source} has no entry for {name}, which {file_type.upper()} makes "
                                f"{new_type.name}: llama.cpp's quantize refuses that (the result would be garbage); "
                                "llama-imatrix never runs MTP / nextn layers: `specconv convert --mtp-outtype q8_0` "
                                "keeps them at another type")
        if w is not None and new_type in WEIGHTED_TYPES:
            out[name] = w
    return out


def encode_weighted_run(values: np.ndarray, ggml_type: GGMLQuantizationType, weights: np.ndarray | None,
                        n_per_row: int, rows_per_group: int, first_row: int) -> np.ndarray:
    """Whole rows of one tensor (float32, float16, or BF16 bits as uint16; row `first_row` of the
    tensor first) -> their bytes with importance weights (row r uses slice r // rows_per_group).
    weights None: IQ4_NL / IQ4_XS without an imatrix (the tool's bytes then)."""
    from gguf.constants import GGML_QUANT_SIZES

    from .checkpoint import BF16_BITS
    from .native import kquants_weighted_native

    encode = kquants_weighted_native()
    flat = values.reshape(-1)
    bf16 = flat.dtype == BF16_BITS
    if not bf16 and flat.dtype != np.float32:
        flat = flat.astype(np.float32)
    block, size = GGML_QUANT_SIZES[ggml_type]
    if encode is not None:
        out = np.empty(flat.size // block * size, dtype=np.uint8)
        ok = encode(int(ggml_type), flat, out, bf16, n_per_row, weights, rows_per_group, first_row)
    else:  # the numpy fallback (convert/kq_weighted.py), same bytes
        from .kq_weighted import encode_rows

        x = (flat.astype(np.uint32) << 16).view(np.float32) if bf16 else flat
        rows = x.reshape(-1, n_per_row)
        groups = (first_row + np.arange(rows.shape[0])) // rows_per_group
        if weights is None:
            out = encode_rows(rows, ggml_type, None)
        else:
            table = np.asarray(weights, dtype=np.float32).reshape(-1, n_per_row)
            if groups.size and groups[-1] >= table.shape[0]:
                raise SpecconvError(f"internal: {table.shape[0]} weight slices do not cover row "
                                    f"{first_row + rows.shape[0] - 1}")
            out = encode_rows(rows, ggml_type, table[groups])
        ok = out is not None
    if not ok:
        raise SpecconvError(f"a tensor to be stored as {ggml_type.name} holds an infinity or NaN "
                            "(llama.cpp's quantize refuses such tensors too)")
    return out


# ------------------------------------------------------------------------------------- writers


def write_gguf(path: str | Path, sums: dict[str, np.ndarray], counts: dict[str, np.ndarray],
               datasets: Sequence[str] = (), chunk_count: int = 0, chunk_size: int = 512) -> None:
    """An imatrix file in llama-imatrix's GGUF layout: sums[name] is [n_mat, n_per_row] raw sums of
    squares, counts[name] [n_mat] activations per expert; tensors sorted by name."""
    kv = [("general.type", GGUFValueType.STRING, "imatrix"),
          ("imatrix.datasets", GGUFValueType.ARRAY, list(datasets)),
          ("imatrix.chunk_count", GGUFValueType.UINT32, chunk_count),
          ("imatrix.chunk_size", GGUFValueType.UINT32, chunk_size)]
    tensors = []
    for name in sorted(sums):
        s = np.ascontiguousarray(sums[name], dtype=np.float32)
        s = s.reshape(1, -1) if s.ndim == 1 else s
        c = np.ascontiguousarray(counts[name], dtype=np.float32).reshape(-1, 1)
        tensors += [(f"{name}.in_sum2", s), (f"{name}.counts", c)]
    _write_gguf_file(Path(path), kv, tensors)


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _write_gguf_file(path: Path, kv, tensors, alignment: int = 32) -> None:
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, vtype, value in kv:
        out += _gguf_string(key) + struct.pack("<I", int(vtype))
        if vtype == GGUFValueType.STRING:
            out += _gguf_string(value)
        elif vtype == GGUFValueType.UINT32:
            out += struct.pack("<I", value)
        else:  # an array of strings
            out += struct.pack("<IQ", int(GGUFValueType.STRING), len(value)) + b"".join(_gguf_string(v) for v in value)
    offset, blobs = 0, []
    for name, arr in tensors:
        dims = tuple(reversed(arr.shape))
        while len(dims) > 1 and dims[-1] == 1:  # ggml_n_dims: trailing dimensions of 1 are not written
            dims = dims[:-1]
        out += _gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", int(Q.F32), offset)
        blob = arr.tobytes()
        blobs.append(blob + bytes(-len(blob) % alignment))
        offset += len(blobs[-1])
    out += bytes(-len(out) % alignment)
    path.write_bytes(bytes(out) + b"".join(blobs))


def write_legacy(path: str | Path, sums: dict[str, np.ndarray], counts: dict[str, np.ndarray], chunk_size: int = 512,
                 chunk_count: int = 0, dataset: str = "") -> None:
    """An imatrix file in llama-imatrix's legacy `.dat` layout from the same raw sums and counts:
    values stored as (sum / count) * ncall with ncall = ceil(max count / chunk_size), an expert
    without activations stored as 1 * ncall; entries sorted by name."""
    out = bytearray(struct.pack("<i", len(sums)))
    for name in sorted(sums):
        s = np.asarray(sums[name], dtype=np.float32).reshape(-1)
        c = np.asarray(counts[name], dtype=np.int64).reshape(-1)
        ncall = int((c.max() + chunk_size - 1) // chunk_size)
        per = np.repeat(c.astype(np.float32), s.size // c.size)
        value = np.where(per == 0, np.float32(1), s)
        per = np.where(per == 0, np.float32(1), per)
        stored = (value / per).astype(np.float32) * np.float32(ncall)
        raw = name.encode()
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, s.size) + stored.astype("<f4").tobytes()
    raw = dataset.encode()
    out += struct.pack("<ii", chunk_count, len(raw)) + raw
    Path(path).write_bytes(bytes(out))
