"""Move MTP (nextn) heads between GGUF files without touching the trunk.

* extract: an embedded file (trunk + MTP blocks) -> an MTP-only sidecar in the llama.cpp `--mtp`
  layout: same arch, same KV and tokenizer, `block_count = N + k`, `nextn_predict_layers = k`,
  tensors `token_embd`, `output_norm`, `output` (when untied) and `blk.N .. blk.N+k-1`.
* merge: a trunk-only file (any quantization, e.g. a third-party quant) + a sidecar (or an
  embedded file) -> one embedded file. Trunk tensors are copied byte for byte; only the grafted
  tensors may be re-typed, on request.

The result of either is a `GraftPlan` (KV list + tensor list with lazy data); `write_plan` writes it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

from specconv.archs.base import MetaKV
from specconv.archs.errors import SpecconvError

from specconv.runtime.gguf_reader import GgufFile, GgufTensor, decode_value, tensor_nbytes
from .outtype import encode, is_forced_f32
from .writer import AtomicOutputs, GgufOutput, TensorEntry

SHARED_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")

# Per-layer arrays the graft knows how to pad when the MTP file gives no value for its blocks.
# Every other per-layer array takes its MTP entries from the MTP file (array or scalar).
_PAD_WHEN_UNKNOWN = {"attention.recurrent_layers": False}  # MTP blocks are full attention


# --- storage types ------------------------------------------------------------------------------

# Types gguf.quants can produce in pure Python (K-quants need llama-quantize).
PRODUCIBLE_TYPES = {t.name: t for t in (
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1)}


def parse_type(name: str) -> GGMLQuantizationType:
    """A user-facing type name ("q8_0", "F16", ...) -> GGML type; only types we can produce."""
    key = name.strip().upper()
    if key not in PRODUCIBLE_TYPES:
        choices = ", ".join(t.lower() for t in PRODUCIBLE_TYPES)
        raise SpecconvError(f"unknown or unsupported storage type {name!r}; choose one of {choices}")
    return PRODUCIBLE_TYPES[key]


def forced_f32(name: str, n_dims: int) -> bool:
    """The converter's rule (convert/outtype.py): norms, 1-D, routers, conv and non-`.weight` stay F32."""
    return is_forced_f32(name, n_dims)


@dataclass(frozen=True)
class TypeOverride:
    pattern: str  # a regular expression, searched in the GGUF tensor name (as llama-quantize's --tensor-type)
    ggml_type: GGMLQuantizationType

    @classmethod
    def parse(cls, text: str) -> "TypeOverride":
        pattern, sep, tname = text.rpartition("=")
        if not sep or not pattern or not tname:
            raise SpecconvError(f"type override {text!r}: expected PATTERN=TYPE, e.g. 'nextn\\.eh_proj=q8_0'")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise SpecconvError(f"type override {text!r}: bad regular expression ({exc})") from None
        return cls(pattern, parse_type(tname))

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


# --- the plan -------------------------------------------------------------------------------------

@dataclass
class OutTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order
    nbytes: int
    source: GgufTensor
    note: str = ""  # why the type differs from the source, when it does

    @property
    def copied(self) -> bool:
        return self.ggml_type == self.source.ggml_type

    def data(self) -> np.ndarray:
        """The bytes to write: a view of the source when the type is kept, else re-typed values."""
        if self.copied:
            return self.source.raw()
        return retype(self.source, self.ggml_type)


@dataclass
class GraftPlan:
    arch: str
    kv: list[MetaKV]
    tensors: list[OutTensor]
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def retype(src: GgufTensor, target: GGMLQuantizationType) -> np.ndarray:
    """Dequantize (any readable type) and encode as `target`; flat uint8 bytes."""
    return encode(src.to_float32(), target)


def _row_fits(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> bool:
    block = GGML_QUANT_SIZES[ggml_type][0]
    return shape[0] % block == 0


def _plan_tensor(t: GgufTensor, requested: GGMLQuantizationType | None, strict: bool, warnings: list[str]) -> OutTensor:
    """The output entry for `t` with the requested type, after the F32-forced rules."""
    target = t.ggml_type if requested is None else requested
    note = ""
    if requested is not None and forced_f32(t.name, t.n_dims):
        target = GGMLQuantizationType.F32 if t.ggml_type != GGMLQuantizationType.F32 else t.ggml_type
        note = "F32 forced (norm / 1-D / non-weight tensor)"
    elif target != t.ggml_type and not _row_fits(t.shape, target):
        block = GGML_QUANT_SIZES[target][0]
        if strict:
            raise SpecconvError(f"{t.name}: rows of {t.shape[0]} values cannot be stored as {target.name} (blocks of {block})")
        warnings.append(f"{t.name}: rows of {t.shape[0]} are not a multiple of {block}; stored as F16 instead of {target.name}")
        target, note = GGMLQuantizationType.F16, f"F16 fallback ({target.name} needs rows of {block})"
    return OutTensor(t.name, target, t.shape, tensor_nbytes(t.shape, target), t, note)


def _apply_types(tensors: Sequence[GgufTensor], outtype: GGMLQuantizationType | None,
                 overrides: Sequence[TypeOverride], warnings: list[str]) -> list[OutTensor]:
    used = [False] * len(overrides)
    planned = []
    for t in tensors:
        requested, strict = outtype, False
        for i, ov in enumerate(overrides):  # the last matching override wins, as on a command line
            if ov.matches(t.name):
                requested, strict, used[i] = ov.ggml_type, True, True
        planned.append(_plan_tensor(t, requested, strict, warnings))
    unused = [ov.pattern for ov, u in zip(overrides, used) if not u]
    if unused:
        raise SpecconvError(f"type override pattern(s) {', '.join(map(repr, unused))} match no tensor that is written "
                            f"(candidates: {tensors[0].name} ... {tensors[-1].name})" if tensors else "no tensors")
    return planned


# --- shared inspection ----------------------------------------------------------------------------

def block_index(name: str) -> int | None:
    m = _BLOCK_RE.match(name)
    return int(m.group(1)) if m else None


def mtp_tensors(f: GgufFile) -> tuple[int, int, list[GgufTensor]]:
    """(N, k, the tensors of blocks N..N+k-1) of a file that carries an MTP head."""
    k = f.nextn_layers()
    if k <= 0:
        raise SpecconvError(f"{f.path.name} has no MTP head ({f.arch_key('nextn_predict_layers')} is absent or 0)")
    total = f.block_count()
    if k > total:
        raise SpecconvError(f"{f.path.name}: nextn_predict_layers={k} exceeds block_count={total}")
    n = total - k
    blocks = [t for t in f if (b := block_index(t.name)) is not None and b >= n]
    for i in range(n, total):
        if f"blk.{i}.nextn.eh_proj.weight" not in f.tensors:
            raise SpecconvError(f"{f.path.name} declares {k} MTP block(s) but blk.{i}.nextn.eh_proj.weight is missing")
    return n, k, blocks


def tokenizer_fingerprint(f: GgufFile) -> str | None:
    """sha256 over the token strings and merges; None when the file has no token list."""
    tokens = f.kv.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    h = hashlib.sha256()
    for part in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        kv = f.kv.get(part)
        h.update(part.encode() + b"\x01")
        items = kv.value if kv is not None and isinstance(kv.value, list) else [kv.value] if kv is not None else []
        for item in items:  # a hostile file may hold any type here: hashed as it is
            h.update(item if isinstance(item, bytes) else str(item).encode())
            h.update(b"\x00")
    return h.hexdigest()[:16]


def file_type_for(t: GGMLQuantizationType) -> int | None:
    """`general.file_type` of a file mostly stored as `t` (LlamaFileType ALL_F32 / MOSTLY_<type>)."""
    if t == GGMLQuantizationType.F32:
        return int(LlamaFileType.ALL_F32)
    ft = LlamaFileType.__members__.get(f"MOSTLY_{t.name}")
    return int(ft) if ft is not None else None


def default_sidecar_path(model_path: Path) -> Path:
    """mtp-<name>.gguf next to the model (shard suffix dropped), keeping the name's quant tag."""
    from specconv.runtime.gguf_reader import _SHARD_RE

    m = _SHARD_RE.match(model_path.name)
    stem = m["prefix"] if m else model_path.stem
    return model_path.with_name(f"mtp-{stem}.gguf")


# --- extract --------------------------------------------------------------------------------------

def plan_extract(src: GgufFile, outtype: GGMLQuantizationType | None = None,
                 overrides: Sequence[TypeOverride] = ()) -> GraftPlan:
    n, k, blocks = mtp_tensors(src)
    missing = [name for name in SHARED_TENSORS[:2] if name not in src.tensors]
    if missing:
        raise SpecconvError(f"{src.path.name}: missing {', '.join(missing)}, which the sidecar must carry")
    keep = {t.name for t in blocks} | {name for name in SHARED_TENSORS if name in src.tensors}
    chosen = [t for t in src if t.name in keep]  # source order
    warnings: list[str] = []
    tensors = _apply_types(chosen, outtype, overrides, warnings)
    kv = list(src.kv.values())
    if outtype is not None and (ft := file_type_for(outtype)) is not None:
        kv = [replace(e, value=ft) if e.key == "general.file_type" else e for e in kv]
    kv = _relabel_size(kv, src, tensors)
    return GraftPlan(src.arch, kv, tensors, warnings)


# --- merge ----------------------------------------------------------------------------------------

def _embd_shape(f: GgufFile) -> tuple[int, int] | None:
    t = f.tensors.get("token_embd.weight")
    return (t.shape[0], t.shape[1]) if t is not None and t.n_dims == 2 else None


def mismatches(trunk: GgufFile, mtp: GgufFile, n_trunk: int, n_mtp_trunk: int) -> list[str]:
    """Every reason the two files do not belong together (one short phrase each)."""
    found = []
    if trunk.arch != mtp.arch:
        found.append(f"architecture differs ({trunk.arch} vs {mtp.arch})")
    if n_trunk != n_mtp_trunk:
        found.append(f"trunk layer count differs ({n_trunk} vs {n_mtp_trunk} in the MTP file)")
    te, me = _embd_shape(trunk), _embd_shape(mtp)
    h_t = trunk.get(trunk.arch_key("embedding_length"), te[0] if te else None)
    h_m = mtp.get(mtp.arch_key("embedding_length"), me[0] if me else None)
    if h_t != h_m or (te and me and te[0] != me[0]):
        found.append(f"hidden size differs ({h_t} vs {h_m})")
    v_t = te[1] if te else len(trunk.kv["tokenizer.ggml.tokens"].value) if "tokenizer.ggml.tokens" in trunk.kv else None
    v_m = me[1] if me else len(mtp.kv["tokenizer.ggml.tokens"].value) if "tokenizer.ggml.tokens" in mtp.kv else None
    if v_t != v_m:
        found.append(f"vocabulary size differs ({v_t} vs {v_m})")
    f_t, f_m = tokenizer_fingerprint(trunk), tokenizer_fingerprint(mtp)
    if f_t != f_m:
        found.append(f"tokenizer fingerprint differs ({f_t} vs {f_m})")
    return found


def _hparam_differences(trunk: GgufFile, mtp: GgufFile, per_layer: set[str]) -> list[str]:
    """Arch keys (other than layer counts and per-layer arrays) whose values differ: worth a warning."""
    skip = {trunk.arch_key("block_count"), trunk.arch_key("nextn_predict_layers"), trunk.arch_key("context_length")}
    prefix = trunk.arch + "."
    out = []
    for key, kv in trunk.kv.items():
        if not key.startswith(prefix) or key in skip or key in per_layer:
            continue
        other = mtp.kv.get(key)
        if other is not None and (other.value != kv.value):
            out.append(f"{key}: trunk {decode_value(kv.value)!r}, MTP file {decode_value(other.value)!r}")
    return out


def _extend_per_layer(trunk: GgufFile, mtp: GgufFile, n: int, n_m: int, k: int, force: bool,
                      warnings: list[str]) -> tuple[dict[str, MetaKV], set[str]]:
    """New values for the trunk's per-layer arrays (length N) extended to N + k entries.

    The MTP entries come from the MTP file (N_m trunk layers + k; N_m == N unless forced)."""
    prefix = trunk.arch + "."
    updated: dict[str, MetaKV] = {}
    for key, kv in trunk.kv.items():
        if not key.startswith(prefix) or kv.vtype != GGUFValueType.ARRAY or len(kv.value) != n:
            continue
        other = mtp.kv.get(key)
        suffix = key[len(prefix):]
        if other is not None and other.vtype == GGUFValueType.ARRAY:
            if len(other.value) == len(kv.value):
                continue  # a fixed-length array (e.g. rope sections) that happens to have N entries
            if len(other.value) != n_m + k:
                raise SpecconvError(f"{key}: {len(other.value)} entries in the MTP file, expected {n_m + k}")
            tail = list(other.value[n_m:])
        elif other is not None:
            tail = [other.value] * k  # the MTP file stores one value for every layer
        elif suffix in _PAD_WHEN_UNKNOWN:
            tail = [_PAD_WHEN_UNKNOWN[suffix]] * k
        elif force:
            tail = [kv.value[-1]] * k
            warnings.append(f"{key}: the MTP file has no value for its blocks; repeated the last trunk entry")
        else:
            raise SpecconvError(f"{key} is per-layer in the trunk but absent from the MTP file; "
                                "cannot tell the MTP blocks' value (use --force to repeat the last trunk entry)")
        updated[key] = replace(kv, value=list(kv.value) + tail)
    # The trunk may store a scalar where the MTP file has a per-layer array: expand only if needed.
    for key, other in mtp.kv.items():
        kv = trunk.kv.get(key)
        if (key.startswith(prefix) and kv is not None and kv.vtype != GGUFValueType.ARRAY
                and other.vtype == GGUFValueType.ARRAY and len(other.value) == n_m + k):
            tail = list(other.value[n_m:])
            if any(v != kv.value for v in tail):
                updated[key] = MetaKV(key, [kv.value] * n + tail, GGUFValueType.ARRAY, other.sub_type)
    return updated, set(updated)


def trunk_layers(trunk: GgufFile) -> tuple[int, bool]:
    """(N, stripped) for the file to graft onto.

    A trunk-only file has no nextn key. A "stripped" file still declares k MTP layers (block_count =
    N + k, per-layer arrays with N + k entries) but lost their tensors, as some quantization tools do;
    llama.cpp loads such glm4moe / deepseek2 files as trunk-only. Both can receive a head.
    """
    k = trunk.nextn_layers()
    total = trunk.block_count()
    if k <= 0:
        return total, False
    n = total - k
    if any(f"blk.{i}.nextn.eh_proj.weight" in trunk.tensors for i in range(n, total)):
        raise SpecconvError(f"{trunk.path.name} already has an MTP head (nextn_predict_layers={k}); "
                            "give a trunk-only file, or extract its head instead")
    return n, True


def plan_merge(trunk: GgufFile, mtp: GgufFile, overrides: Sequence[TypeOverride] = (),
               force: bool = False) -> GraftPlan:
    n, stripped = trunk_layers(trunk)
    if not any(block_index(t.name) == 0 for t in trunk):
        raise SpecconvError(f"{trunk.path.name} has no trunk blocks (blk.0.*); is it a sidecar?")
    n_m, k, blocks = mtp_tensors(mtp)
    if stripped and trunk.nextn_layers() != k:  # its per-layer arrays are sized for its own k
        raise SpecconvError(f"{trunk.path.name} declares {trunk.nextn_layers()} MTP layer(s) but "
                            f"{mtp.path.name} has {k}")
    problems = mismatches(trunk, mtp, n, n_m)
    warnings: list[str] = []
    if problems and not force:
        raise SpecconvError(f"{trunk.path.name} and {mtp.path.name} do not belong together: "
                            + "; ".join(problems) + " (use --force to graft anyway)")
    warnings += [f"forced despite: {p}" for p in problems]
    if n != n_m:  # renumber the grafted blocks so they follow this trunk
        blocks = [_renamed(t, n - n_m) for t in blocks]

    if stripped:  # the trunk's KV already describes N + k layers; only leftovers of blk.N.. go
        updated, per_layer = {}, set()
        leftovers = [t.name for t in trunk if (b := block_index(t.name)) is not None and b >= n]
        if leftovers:
            warnings.append(f"replaced {len(leftovers)} leftover tensor(s) of the trunk's MTP blocks")
        trunk_tensors = [t for t in trunk if t.name not in set(leftovers)]
        kv = list(trunk.kv.values())
    else:
        updated, per_layer = _extend_per_layer(trunk, mtp, n, n_m, k, force, warnings)
        trunk_tensors = list(trunk)
        kv = _merged_kv(trunk, mtp, n, k, updated)
    warnings += [f"hyper-parameter differs, trunk value kept: {d}" for d in _hparam_differences(trunk, mtp, per_layer)]

    grafted = _apply_types(blocks, None, overrides, warnings)
    trunk_out = [OutTensor(t.name, t.ggml_type, t.shape, t.n_bytes, t) for t in trunk_tensors]
    at = _graft_position(trunk_out, mtp, n_m)
    tensors = trunk_out[:at] + grafted + trunk_out[at:]
    extra = [t.name for t in mtp if block_index(t.name) is None and t.name not in SHARED_TENSORS and t.name not in trunk.tensors]
    if extra:
        warnings.append(f"not grafted (global tensors of the MTP file the trunk lacks): {', '.join(extra)}")
    kv = _relabel_size(kv, trunk, tensors)
    return GraftPlan(trunk.arch, kv, tensors, warnings)


def _graft_position(trunk_out: Sequence[OutTensor], mtp: GgufFile, n_mtp_trunk: int) -> int:
    """Where the MTP blocks go among the trunk's tensors: where the MTP file has them.

    Converters write tensors in checkpoint order, so the blocks sit before `output_norm` for
    GLM / DeepSeek (`model.layers.N` precedes `model.norm`) and last for Qwen (`mtp.*` follows it).
    The MTP file shows which: the first shared tensor after its blocks, if any, follows them.
    """
    order = list(mtp.tensors)
    last = max(i for i, name in enumerate(order) if (b := block_index(name)) is not None and b >= n_mtp_trunk)
    names = [t.name for t in trunk_out]
    for name in order[last + 1:]:
        if name in SHARED_TENSORS and name in names:
            return names.index(name)
    return len(trunk_out)


def _renamed(t: GgufTensor, shift: int) -> GgufTensor:
    b = block_index(t.name)
    return replace(t, name=f"blk.{b + shift}." + t.name.split(".", 2)[2])


def _merged_kv(trunk: GgufFile, mtp: GgufFile, n: int, k: int, updated: dict[str, MetaKV]) -> list[MetaKV]:
    block_key, nextn_key = trunk.arch_key("block_count"), trunk.arch_key("nextn_predict_layers")
    nextn_vtype = mtp.kv[mtp.arch_key("nextn_predict_layers")].vtype if mtp.arch == trunk.arch else GGUFValueType.UINT32
    # Put the new key where the MTP file (written by the same converter as the trunk, usually) has
    # it: after the key that precedes it there; else right after block_count.
    mtp_keys = list(mtp.kv)
    anchor = block_key
    if nextn_key in mtp_keys and mtp_keys.index(nextn_key) > 0:
        before = mtp_keys[mtp_keys.index(nextn_key) - 1]
        anchor = before if before in trunk.kv else block_key
    out: list[MetaKV] = []
    for key, kv in trunk.kv.items():
        out.append(replace(kv, value=n + k) if key == block_key else updated.get(key, kv))
        if key == anchor:
            out.append(MetaKV(nextn_key, k, nextn_vtype))
    return out


def size_label_of(tensors: Sequence[tuple[str, tuple[int, ...]]]) -> str:
    """The `general.size_label` gguf-py derives from a tensor list (names, ggml shapes)."""
    from gguf import GGUFWriter
    from gguf.utility import size_label

    counter = GGUFWriter(None, "counter")
    for name, shape in tensors:
        if 0 in shape:  # no parameters; gguf-py would divide by its expert count of 0
            continue
        counter.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), 0)
    return size_label(*counter.get_total_parameter_count())


def _relabel_size(kv: list[MetaKV], src: GgufFile, out: Sequence[OutTensor]) -> list[MetaKV]:
    """Recompute general.size_label when the source's label was derived from its own tensors."""
    label = src.get("general.size_label")
    if label is None or label != size_label_of([(t.name, t.shape) for t in src]):
        return kv  # absent, or a label from model metadata (e.g. "27B"): keep it
    new = size_label_of([(t.name, t.shape) for t in out]).encode()
    return [replace(e, value=new) if e.key == "general.size_label" else e for e in kv]


# --- summary for users ----------------------------------------------------------------------------

def describe(plan: GraftPlan) -> list[str]:
    copied = sum(1 for t in plan.tensors if t.copied)
    lines = [f"{len(plan.tensors)} tensors ({copied} copied byte for byte, {len(plan.tensors) - copied} re-typed), "
             f"{plan.total_bytes / 2**20:.1f} MiB of tensor data"]
    for t in plan.tensors:
        if not t.copied:
            lines.append(f"  {t.name}: {t.source.ggml_type.name} -> {t.ggml_type.name}" + (f" ({t.note})" if t.note else ""))
    return lines


def write_plan(plan: GraftPlan, out_path, split_max_size: int = 0, overwrite: bool = False,
               inputs: Sequence[GgufFile] = (), on_tensor: Callable[[OutTensor], None] | None = None) -> list[Path]:
    """Write the plan atomically (temporary names, renamed when complete); returns the written paths."""
    out = Path(out_path)
    if out.suffix != ".gguf":
        raise SpecconvError(f"{out}: the output name must end in .gguf")
    entries = [TensorEntry(t.name, tuple(reversed(t.shape)), t.ggml_type, t.nbytes) for t in plan.tensors]
    output = GgufOutput(out, plan.arch, plan.kv, entries, split_max_size=split_max_size)
    sources = {p.resolve() for f in inputs for p in f.paths}
    if any(p.resolve() in sources for p in output.final_paths):
        raise SpecconvError(f"{out_path}: the output would replace an input file; choose another name")
    with AtomicOutputs([output], overwrite=overwrite):
        for t in plan.tensors:
            output.write(t.name, t.data())
            if on_tensor is not None:
                on_tensor(t)
    return output.final_paths
