"""What the upload plan needs to know about one GGUF model (a single file or a complete shard set).

Only the header is read (gguf_header's scan), so this is cheap even for 50 GB files.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from specconv.archs import plugin_classes_writing
from specconv.errors import SpecconvError
from specconv.hub.gguf_header import read_header
from specconv.hub.naming import SHARD_RE, Role, file_type_tag, tensor_type_tag

SPLIT_KEYS = (
    gguf.Keys.Split.LLM_KV_SPLIT_NO,
    gguf.Keys.Split.LLM_KV_SPLIT_COUNT,
    gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
)


@dataclass
class GgufModel:
    """One model as found on disk: `paths` has one file, or every shard in order."""

    paths: list[Path]
    arch: str
    role: Role
    quant: str
    kv: dict[str, object]  # scalar/string KV of the first file (arrays left out)
    tensor_types: dict[str, str]  # tensor name -> ggml type name
    size: int  # bytes on disk, all shards
    shard_sizes: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    type_bytes: dict[str, int] = field(default_factory=dict)  # ggml type name -> tensor bytes of that type

    @property
    def is_split(self) -> bool:
        return len(self.paths) > 1

    def get(self, key: str, default=None):
        return self.kv.get(key, default)


def detect_role(arch: str, kv: dict[str, object], tensor_names: set[str]) -> Role:
    """llama.cpp's rule (docs/reference/gguf-layout.md §4.3): nextn > 0 without `blk.0.attn_norm` is a
    sidecar; no nextn key (or 0) is a trunk-only model."""
    if arch == "eagle3":
        return Role.EAGLE3
    if arch == "dflash":
        return Role.DFLASH
    if any(p.standalone_drafter for p in plugin_classes_writing(arch)):  # the Gemma 4 assistant
        return Role.ASSISTANT
    nextn = kv.get(f"{arch}.nextn_predict_layers")
    if not nextn:
        return Role.TRUNK
    if "blk.0.attn_norm.weight" not in tensor_names:
        return Role.SIDECAR
    return Role.EMBEDDED


def dominant_tensor_type(types: dict[str, gguf.GGMLQuantizationType], sizes: dict[str, int]) -> str:
    """The storage type holding most bytes among matrices: what `general.file_type` would say."""
    weight = collections.Counter()
    for name, ttype in types.items():
        weight[ttype] += sizes[name]
    non_f32 = {t: w for t, w in weight.items() if t != gguf.GGMLQuantizationType.F32}
    pool = non_f32 or weight
    return tensor_type_tag(max(pool, key=pool.get))


def _split_int(value, key: str, path: Path, default: int) -> int:
    """A split.* value as an integer, or a one-line error (a hostile file may hold any type there)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecconvError(f"{path.name}: {key} must be an integer, found {value!r}"[:200])
    return value


def read_model(paths: list[Path]) -> GgufModel:
    """Inspect one file or an ordered, complete shard set (headers only)."""
    first = read_header(paths[0])
    kv = first.scalars()
    if _split_int(kv.get(gguf.Keys.Split.LLM_KV_SPLIT_NO), gguf.Keys.Split.LLM_KV_SPLIT_NO, paths[0], 0) != 0:
        raise SpecconvError(f"{paths[0].name}: split.no does not match its position 0 in the shard set")
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise SpecconvError(f"{paths[0].name}: no general.architecture key")
    count = _split_int(kv.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT), gguf.Keys.Split.LLM_KV_SPLIT_COUNT, paths[0], 1) or 1
    if count != len(paths):
        raise SpecconvError(
            f"{paths[0].name}: split.count is {count} but {len(paths)} shard file(s) were found"
        )

    types: dict[str, gguf.GGMLQuantizationType] = {}
    sizes: dict[str, int] = {}
    declared_total = kv.get(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    for index, path in enumerate(paths):
        header = first if index == 0 else read_header(path)
        if len(paths) > 1:
            field_no = header.kv.get(gguf.Keys.Split.LLM_KV_SPLIT_NO)
            if field_no is None or _split_int(field_no.value, gguf.Keys.Split.LLM_KV_SPLIT_NO, path, -1) != index:
                raise SpecconvError(f"{path.name}: split.no does not match its position {index} in the shard set")
        for tensor in header.tensors:
            if tensor.name in types:
                raise SpecconvError(f"{path.name}: tensor {tensor.name} appears in two shards")
            types[tensor.name] = tensor.tensor_type
            sizes[tensor.name] = tensor.n_bytes
    declared_total = _split_int(declared_total, gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, paths[0], None)
    if len(paths) > 1 and declared_total is not None and declared_total != len(types):
        raise SpecconvError(
            f"{paths[0].name}: split.tensors.count is {declared_total} but the shards hold {len(types)} tensors"
        )
    if not types:
        raise SpecconvError(f"{paths[0].name}: the file holds no tensors")

    warnings: list[str] = []
    file_type = kv.get("general.file_type")
    quant = file_type_tag(int(file_type)) if isinstance(file_type, int) else None
    from_tensors = dominant_tensor_type(types, sizes)
    if quant is None:
        quant = from_tensors
        if file_type is not None:
            warnings.append(f"{paths[0].name}: unknown general.file_type {file_type}; using {quant} from the tensors")
    role = detect_role(arch, kv, set(types))
    shard_sizes = [p.stat().st_size for p in paths]
    type_bytes: dict[str, int] = collections.Counter()
    for name, ttype in types.items():
        type_bytes[tensor_type_tag(ttype)] += sizes[name]
    return GgufModel(
        paths=list(paths),
        arch=arch,
        role=role,
        quant=quant,
        kv=kv,
        tensor_types={n: tensor_type_tag(t) for n, t in types.items()},
        size=sum(shard_sizes),
        shard_sizes=shard_sizes,
        warnings=warnings,
        type_bytes=dict(type_bytes),
    )


def group_files(files: list[Path]) -> list[list[Path]]:
    """Group `.gguf` files into single files and complete, ordered shard sets (by file name)."""
    groups: dict[tuple[Path, str, int], dict[int, Path]] = {}
    singles: list[list[Path]] = []
    for path in sorted(files):
        match = SHARD_RE.match(path.name)
        if not match:
            singles.append([path])
            continue
        key = (path.parent, match.group("prefix"), int(match.group("count")))
        groups.setdefault(key, {})[int(match.group("no"))] = path
    out = list(singles)
    for (parent, prefix, count), members in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        missing = [i for i in range(1, count + 1) if i not in members]
        if missing or count < 1:
            raise SpecconvError(
                f"incomplete shard set {prefix}-*-of-{count:05d}.gguf in {parent}: missing shard(s) "
                + ", ".join(f"{i:05d}" for i in missing)
            )
        out.append([members[i] for i in range(1, count + 1)])
    return out
