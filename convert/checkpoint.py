"""Lazy reading of Hugging Face safetensors checkpoints (one file, or shards with an index).

Only headers are parsed up front; tensor bytes are memory-mapped. `view` gives a tensor in its own
dtype straight over the map (no copy, nothing read yet), `read_into` copies a piece of such a view
with a positioned read (never faulting the map's pages in), `read_tensor` gives a float32 or int64
copy; `release` hands the pages of a consumed tensor back to the OS (they stay in the page cache),
so a conversion's resident memory does not grow with the model: mapped pages count in a process's
RSS until released. Every way a checkpoint can
be broken (missing shard, truncated file, corrupt header, unknown dtype) becomes a one-line
SpecconvError naming the file. Pickled weights (`pytorch_model.bin`) are never opened.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from specconv.archs.base import SourceTensor
from specconv.archs.errors import SpecconvError

INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON header

# safetensors dtype -> bytes per element
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
# safetensors float dtype -> the numpy dtype its values travel in. numpy has no bfloat16: BF16 tensors
# are uint16 arrays of their bit patterns (exact for every layout-only operation; `as_float32` widens).
FLOAT_DTYPES = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32, "F64": np.float64}
BF16_BITS = np.dtype(np.uint16)
_PAGE = mmap.PAGESIZE
_DONTNEED = getattr(mmap, "MADV_DONTNEED", 0)
INT_DTYPES = {"I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes live."""

    raw_name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """One safetensors file: a validated header, a lazily created read-only memory map, and a file
    descriptor for positioned reads."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors = _parse_header(path)
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        self.address = 0  # where the map starts in this process's memory (0: not mapped)

    def buffer(self) -> mmap.mmap:
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.address = np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data
        return self._map

    def read_at(self, offset: int, out: np.ndarray) -> None:
        """Fill `out` (contiguous) with the file's bytes from `offset` (GIL released while reading)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        target, done = memoryview(out).cast("B"), 0
        while done < len(target):
            n = os.preadv(self._fd, [target[done:]], offset + done)
            if n <= 0:
                raise SpecconvError(f"{self.path.name}: file shrank while being read (at byte {offset + done})")
            done += n

    def advise(self, start: int, end: int, advice: int) -> None:
        """madvise over the pages covering file bytes [start, end) (no-op where unsupported)."""
        if self._map is None or not hasattr(self._map, "madvise") or end <= start:
            return
        first = start // _PAGE * _PAGE
        length = min(end, len(self._map)) - first
        if length > 0:
            self._map.madvise(advice, first, length)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor view is still alive somewhere: the map closes with it
                pass
            self._map = None
            self.address = 0


def _parse_header(path: Path) -> dict[str, StoredTensor]:
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SpecconvError(f"{name}: truncated safetensors file ({size} bytes, no header)")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER or 8 + n > size:
                raise SpecconvError(f"{name}: corrupt or truncated safetensors header (declares {n} header bytes, "
                                    f"file has {size})")
            raw = f.read(n)
    except OSError as exc:
        raise SpecconvError(f"{name}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecconvError(f"{name}: corrupt safetensors header (not valid JSON: {exc})") from None
    if not isinstance(header, dict):
        raise SpecconvError(f"{name}: corrupt safetensors header (not a JSON object)")
    data_start, data_size = 8 + n, size - 8 - n
    out: dict[str, StoredTensor] = {}
    for tname, meta in header.items():
        if tname == "__metadata__":
            continue
        out[tname] = _entry(name, path, tname, meta, data_start, data_size)
    return out


def _entry(fname: str, path: Path, tname: str, meta: Any, data_start: int, data_size: int) -> StoredTensor:
    try:
        dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise SpecconvError(f"{fname}: corrupt safetensors header entry for {tname}") from None
    if dtype not in DTYPE_SIZES:
        raise SpecconvError(f"{fname}: tensor {tname} has unsupported dtype {dtype}")
    expected = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
    if any(d < 0 for d in shape) or begin < 0 or end - begin != expected:
        raise SpecconvError(f"{fname}: corrupt safetensors header: {tname} {dtype}{list(shape)} "
                            f"does not match its byte range [{begin}, {end})")
    if end > data_size:
        raise SpecconvError(f"{fname}: truncated safetensors file: {tname} ends at data byte {end}, "
                            f"but the file holds only {data_size}")
    return StoredTensor(tname, dtype, shape, path, data_start + begin, end - begin)


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read, in llama.cpp's converter order (sorted by file name)."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise SpecconvError(f"{INDEX_NAME}: cannot be parsed ({exc})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SpecconvError(f"{INDEX_NAME} has no weight_map")
        files = sorted(set(map(str, weight_map.values())))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise SpecconvError(f"shard {missing[0]}{more} named in {INDEX_NAME} is missing from {model_dir}")
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = f" ({pickles[0]} is a pickle, which specconv never loads)" if pickles else ""
        raise SpecconvError(f"no safetensors weights in {model_dir}{hint}")
    return files


class CheckpointReader:
    """config.json plus every tensor header of a checkpoint folder, read lazily.

    `tensors` keeps llama.cpp's converter order: files sorted by name, and tensors sorted by name
    within each file (what its safetensors reader does), so plugins can reproduce its GGUF order.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise SpecconvError(f"{model_dir}: not a checkpoint folder")
        self.config = read_config(self.dir)
        self.files = [SafetensorsFile(p) for p in _weight_files(self.dir)]
        self.tensors: dict[str, StoredTensor] = {}
        for f in self.files:
            for raw_name in sorted(f.tensors):
                if raw_name in self.tensors:
                    raise SpecconvError(f"tensor {raw_name} appears in both {self.tensors[raw_name].file.name} "
                                        f"and {f.path.name}")
                self.tensors[raw_name] = f.tensors[raw_name]
        self._check_index()
        self._by_path = {f.path: f for f in self.files}
        self.reads: dict[str, int] = {}  # raw name -> times copied out (each should be copied at most once)
        self.viewed: dict[str, int] = {}  # raw name -> times viewed in place (free: no copy)

    def _check_index(self) -> None:
        index = self.dir / INDEX_NAME
        if not index.is_file():
            return
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        for tname, fname in weight_map.items():
            stored = self.tensors.get(tname)
            if stored is None or stored.file.name != fname:
                raise SpecconvError(f"{INDEX_NAME} places {tname} in {fname}, but that shard does not hold it "
                                    "(incomplete or mismatched shard)")

    def headers(self, normalize: Callable[[str], Any]) -> tuple[dict[str, SourceTensor], dict[str, str], dict[str, str]]:
        """(normalised name -> header, normalised -> raw name, skipped raw name -> reason)."""
        out: dict[str, SourceTensor] = {}
        raw_of: dict[str, str] = {}
        skipped: dict[str, str] = {}
        for raw_name, st in self.tensors.items():
            name = normalize(raw_name)
            if isinstance(name, tuple):
                skipped[raw_name] = name[1]
                continue
            if name is None:
                skipped[raw_name] = "not used"
                continue
            if name in out:
                raise SpecconvError(f"tensors {raw_of[name]} and {raw_name} both map to {name}")
            out[name] = SourceTensor(name, st.shape, st.dtype)
            raw_of[name] = raw_name
        return out, raw_of, skipped

    def read_tensor(self, raw_name: str) -> np.ndarray:
        """Floating tensors as float32, integer ones (e.g. EAGLE-3 d2t) as int64, both exact copies."""
        st = self.tensors[raw_name]
        if st.dtype in FLOAT_DTYPES:
            return self.read_float32(raw_name)
        if st.dtype not in INT_DTYPES:
            raise SpecconvError(f"tensor {raw_name} has dtype {st.dtype}, which cannot be converted")
        self.reads[raw_name] = self.reads.get(raw_name, 0) + 1
        np_dtype = INT_DTYPES[st.dtype]
        count = st.nbytes // np.dtype(np_dtype).itemsize
        arr = np.frombuffer(self._by_path[st.file].buffer(), dtype=np_dtype, count=count, offset=st.offset)
        return arr.reshape(st.shape).astype(np.int64, copy=True)

    def read_float32(self, raw_name: str) -> np.ndarray:
        """The tensor as float32 (a private copy; the memory map is not kept alive by it)."""
        st = self.tensors[raw_name]
        if st.dtype not in FLOAT_DTYPES:
            raise SpecconvError(f"tensor {raw_name} has dtype {st.dtype}; a floating-point tensor is needed")
        self.reads[raw_name] = self.reads.get(raw_name, 0) + 1
        return as_float32(self._array(st), copy=True)

    def view(self, raw_name: str) -> np.ndarray:
        """A floating tensor in its stored dtype (`FLOAT_DTYPES`), directly over the memory map
        (read-only, no copy)."""
        st = self.tensors[raw_name]
        if st.dtype not in FLOAT_DTYPES:
            raise SpecconvError(f"tensor {raw_name} has dtype {st.dtype}; a floating-point tensor is needed")
        self.viewed[raw_name] = self.viewed.get(raw_name, 0) + 1
        return self._array(st)

    def _array(self, st: StoredTensor) -> np.ndarray:
        np_dtype = np.dtype(FLOAT_DTYPES[st.dtype])
        if not st.nbytes:
            return np.empty(st.shape, dtype=np_dtype)
        buf = self._by_path[st.file].buffer()
        return np.frombuffer(buf, dtype=np_dtype, count=st.nbytes // np_dtype.itemsize, offset=st.offset).reshape(st.shape)

    def prefetch(self, raw_name: str) -> None:
        """Ask the OS to start reading a tensor's bytes (overlaps disk reads with work on earlier tensors)."""
        st = self.tensors[raw_name]
        f = self._by_path[st.file]
        f.buffer()
        f.advise(st.offset, st.offset + st.nbytes, getattr(mmap, "MADV_WILLNEED", 0))

    def release(self, raw_name: str) -> None:
        """Drop a tensor's mapped pages from this process (they stay in the page cache)."""
        st = self.tensors[raw_name]
        self._by_path[st.file].advise(st.offset, st.offset + st.nbytes, _DONTNEED)

    def is_mapped(self, t: np.ndarray) -> bool:
        """Whether `t` is a view made by `view` (as opposed to, e.g., a transform's result)."""
        return self._mapped_at(t) is not None

    def read_into(self, t: np.ndarray, out: np.ndarray) -> None:
        """Copy a contiguous view made by `view` into `out` with a positioned read instead of through the
        map: no page faults, and the map's pages stay untouched (nothing to release)."""
        where = self._mapped_at(t)
        if where is None:
            raise ValueError("read_into: not a view of a checkpoint file")
        f, offset = where
        f.read_at(offset, out)

    def _mapped_at(self, t: np.ndarray) -> tuple[SafetensorsFile, int] | None:
        """(file, byte offset) of a view lying in one of the memory maps."""
        start = t.ctypes.data
        for f in self.files:
            if f.address and f.address <= start and start + t.nbytes <= f.address + len(f.buffer()):
                return f, start - f.address
        return None

    def close(self) -> None:
        for f in self.files:
            f.close()


def as_float32(values: np.ndarray, copy: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """Float values in a `FLOAT_DTYPES` dtype (BF16 as uint16 bits) -> float32, exactly (F64 rounds to
    nearest). With `out` (float32, same size) the values are written there and it is returned;
    otherwise, without `copy`, float32 input is returned as it is."""
    if out is not None:
        if values.dtype == BF16_BITS:
            np.left_shift(values, 16, out=out.view(np.uint32), dtype=np.uint32)
        else:
            np.copyto(out, values, casting="same_kind")
        return out
    if values.dtype == BF16_BITS:
        return np.left_shift(values, 16, dtype=np.uint32).view(np.float32)
    return values.astype(np.float32, copy=copy)


def read_config(model_dir: Path) -> Mapping[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise SpecconvError(f"{model_dir} has no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecconvError(f"config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise SpecconvError("config.json is not a JSON object")
    return config

