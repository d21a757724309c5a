"""Re-split a GGUF model into shards no larger than a byte limit, tensor by tensor.

The shards follow the GGUF split convention llama.cpp loads natively (docs/reference/gguf-layout.md §5):
`{stem}-00001-of-0000N.gguf`, every shard carries `split.no` (u16, 0-based), `split.count` (u16)
and `split.tensors.count` (i32); every other KV pair is written only in shard 1. The KV comes from
the project's GGUF header reader and is written by the converter's writer (convert/writer.py), with
the shard boundaries given; tensor bytes are copied verbatim file to file (`copy_file_range` where
the kernel can), so nothing is re-quantized and nothing is held in memory.

Unlike `GGUFWriter(split_max_size=...)`, which counts tensor data only, the limit here applies to
the whole file (header, KV, tensor infos and padding included), because the Hub's limit is per
file. Sizes are computed exactly before anything is written, so a dry run can show them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf

from specconv.runtime.gguf_reader import read_header as read_full_header
from specconv.convert.writer import AtomicOutputs, GgufOutput, TensorEntry
from specconv.errors import SpecconvError
from specconv.hub.gguf_header import GgufHeader, read_header
from specconv.hub.gguf_info import SPLIT_KEYS

HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, kv count


def _kv_entry_bytes(key: str, value_bytes: int) -> int:
    return 8 + len(key.encode()) + 4 + value_bytes


# split.no (u16), split.count (u16), split.tensors.count (i32)
SPLIT_KV_BYTES = (
    _kv_entry_bytes(gguf.Keys.Split.LLM_KV_SPLIT_NO, 2)
    + _kv_entry_bytes(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 2)
    + _kv_entry_bytes(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, 4)
)


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class TensorRef:
    source: int  # index into the source paths
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (ggml's dims reversed)
    offset: int  # absolute byte offset of the data in its source file
    n_bytes: int
    n_dims: int

    @property
    def info_bytes(self) -> int:
        return 8 + len(self.name.encode()) + 4 + 8 * self.n_dims + 4 + 8


@dataclass
class ShardLayout:
    sources: list[Path]
    alignment: int
    kv_bytes: int  # KV section of shard 1 without the split keys
    shards: list[list[TensorRef]]
    sizes: list[int]  # exact file size of each shard

    @property
    def count(self) -> int:
        return len(self.shards)


def _tensor_refs(paths: list[Path]) -> tuple[list[TensorRef], GgufHeader]:
    refs: list[TensorRef] = []
    headers = [read_header(p) for p in paths]
    for index, header in enumerate(headers):
        for t in header.tensors:
            np_dims = tuple(reversed(t.dims))
            refs.append(
                TensorRef(
                    source=index,
                    name=t.name,
                    tensor_type=t.tensor_type,
                    shape=np_dims,
                    offset=t.offset,
                    n_bytes=t.n_bytes,
                    n_dims=len(np_dims),
                )
            )
    return refs, headers[0]


def _empty_array(e) -> bool:
    """An empty array entry (key, u32 type, u32 item type, u64 count 0): the writer leaves it out, as
    GGUF readers treat absent and empty alike (convert/writer.py)."""
    return e.vtype == gguf.GGUFValueType.ARRAY and e.nbytes == 8 + len(e.key.encode()) + 4 + 4 + 8


def _shard_size(kv_bytes: int, tensors: list[TensorRef], align: int) -> int:
    meta = HEADER_BYTES + kv_bytes + sum(t.info_bytes for t in tensors)
    return _pad(meta, align) + sum(_pad(t.n_bytes, align) for t in tensors)


def plan_split(paths: list[Path], max_size: int) -> ShardLayout:
    """Greedy, order-preserving assignment of tensors to shards of at most `max_size` bytes."""
    refs, first = _tensor_refs(paths)
    align = first.alignment
    garbled = next((k for k in first.kv if "\ufffd" in k), None)
    if garbled is not None:  # read with replacement characters, it could not be written back byte for byte
        raise SpecconvError(f"{paths[0].name}: KV key {garbled!r} is not UTF-8; the file cannot be re-split"[:300])
    kv_bytes = sum(e.nbytes for k, e in first.kv.items() if k not in SPLIT_KEYS and not _empty_array(e))
    shards: list[list[TensorRef]] = [[]]
    for ref in refs:
        current = shards[-1]
        kv = kv_bytes + SPLIT_KV_BYTES if len(shards) == 1 else SPLIT_KV_BYTES
        if current and _shard_size(kv, current + [ref], align) > max_size:
            shards.append([])
            current = shards[-1]
            kv = SPLIT_KV_BYTES
        if _shard_size(kv, [ref], align) > max_size:
            raise SpecconvError(
                f"tensor {ref.name} ({ref.n_bytes} bytes) does not fit in a file of --max-file-size {max_size} bytes"
            )
        current.append(ref)
    if len(shards) == 1:
        sizes = [_shard_size(kv_bytes, shards[0], align)]
    else:
        sizes = [_shard_size(kv_bytes + SPLIT_KV_BYTES, shards[0], align)]
        sizes += [_shard_size(SPLIT_KV_BYTES, s, align) for s in shards[1:]]
    return ShardLayout(sources=list(paths), alignment=align, kv_bytes=kv_bytes, shards=shards, sizes=sizes)


def write_split(layout: ShardLayout, out_paths: list[Path]) -> None:
    """Write the shards of `layout` to `out_paths`, replacing what is there: each under a temporary
    name next to its own, all renamed when complete (convert/writer.py's AtomicOutputs: on an error,
    Ctrl-C or SIGTERM nothing is left and the files it would replace are untouched)."""
    if len(out_paths) != layout.count:
        raise ValueError("one output path per shard is required")
    first = read_full_header(layout.sources[0])
    arch = first.kv.get("general.architecture")
    if arch is None or not isinstance(arch.value, bytes):
        raise SpecconvError(f"{layout.sources[0].name}: no general.architecture key")
    kv = [entry for key, entry in first.kv.items() if key not in SPLIT_KEYS]
    refs = [ref for shard in layout.shards for ref in shard]
    entries = [TensorEntry(ref.name, ref.shape, ref.tensor_type, ref.n_bytes) for ref in refs]
    output = GgufOutput(out_paths[0], arch.value.decode("utf-8"), kv, entries,
                        shard_counts=[len(shard) for shard in layout.shards], shard_names=out_paths)
    sources: list[int] = []
    try:
        for p in layout.sources:
            sources.append(os.open(p, os.O_RDONLY))
        with AtomicOutputs([output], overwrite=True):
            for tmp, size in zip(output.temp_paths, layout.sizes):  # laid out and sized at open
                if tmp.stat().st_size != size:
                    raise SpecconvError(f"internal error: shard {tmp.name} is {tmp.stat().st_size} bytes, "
                                        f"planned {size}")
            for ref in refs:
                output.copy(ref.name, sources[ref.source], ref.offset)
    finally:
        for fd in sources:
            os.close(fd)
