"""The conversion engine: checkpoint -> plugin plan -> storage types -> one or two GGUF files.

`plan_conversion` reads only headers and decides everything (files, names, KV, every tensor's type,
shape and size), which is also what `--dry-run` shows. `run_conversion` then streams the tensors
(stream.py): each output tensor is made once, encoded in chunks on all cores, and written to every
file that holds it (`--mtp separate` writes the trunk-only file and the sidecar in the same pass).

Routing by MTP mode (docs/reference/gguf-layout.md §4.2), by the plugin's `Role` of each tensor:
  embed    one file: TRUNK + SHARED + MTP, block_count = N + k, nextn_predict_layers = k
  none     one file: TRUNK + SHARED, block_count = N, no nextn key
  only     the mtp- sidecar: SHARED + MTP, with the embedded file's KV and the full tokenizer
  separate both `none` and `only`, byte-identical to two separate runs
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from gguf import GGMLQuantizationType

from specconv.archs import plugin_class_for
from specconv.archs.base import Checkpoint, MetaKV, MtpMode, Role, TensorPlan
from specconv.archs.errors import SpecconvError

from . import kv as kvmod
from .checkpoint import CheckpointReader, read_config
from .naming import output_names
from .outtype import KQuantFileType, choose_storage, file_type, lossless_type, nbytes, resolve_outtype, type_label
from .imatrix import imatrix_plan
from .ladder import LadderPlan, is_ladder, ladder_calls, plan_ladder
from .pipeline import OrderedPool, default_workers
from .quant_rules import Hparams, TensorInfo, choose_types, ggml_shape, loader_order, requantized_kv
from .stream import Buffers, Sources, stream_tensor
from .tokenizer import tokenizer_kv
from .writer import AtomicOutputs, GgufOutput, TensorEntry

ROLES = {  # file kind -> roles it holds
    "embedded": {Role.TRUNK, Role.SHARED, Role.MTP},
    "trunk": {Role.TRUNK, Role.SHARED},
    "sidecar": {Role.SHARED, Role.MTP},
}


@dataclass(frozen=True)
class ConvertRequest:
    src: Path
    out: str
    outtype: str = "auto"
    mtp: MtpMode = MtpMode.EMBED
    split_max_size: int = 0
    target: Path | None = None  # the target model folder of a draft head (EAGLE-3)
    mtp_outtype: str | None = None  # K-quant files: the MTP / nextn tensors' type instead of the tool's
    target_layers: tuple[int, ...] | None = None  # --target-layers: a head's target layers (layer inputs)
    imatrix: object = None  # --imatrix: a loaded convert.imatrix.Imatrix, used by K-quant files
    # K-quant files: name -> type replacing llama.cpp's choice for those tensors (a measured mix,
    # convert/auto_mix.py); `override_note` says why in the plan
    type_overrides: Mapping[str, GGMLQuantizationType] | None = None
    override_note: str = ""


@dataclass(frozen=True)
class PlannedTensor:
    plan: TensorPlan
    ggml_type: GGMLQuantizationType
    nbytes: int
    note: str = ""
    file_shape: tuple[int, ...] | None = None  # as written in the file, when not the plan's shape
    weights: object = field(default=None, compare=False, repr=False)  # importance weights (--imatrix)

    @property
    def name(self) -> str:
        return self.plan.name

    def entry(self) -> TensorEntry:
        return TensorEntry(self.plan.name, self.file_shape or tuple(self.plan.shape), self.ggml_type, self.nbytes)


@dataclass
class PlannedFile:
    kind: str  # "embedded" | "trunk" | "sidecar"
    output: GgufOutput
    tensors: list[PlannedTensor]

    @property
    def path(self) -> Path:
        return self.output.path

    @property
    def kv(self) -> list[MetaKV]:
        return self.output.kv


@dataclass
class ConversionPlan:
    src: Path
    arch: str
    hf_architecture: str
    outtype: GGMLQuantizationType | KQuantFileType
    mode: MtpMode
    n_trunk: int
    n_mtp: int
    files: list[PlannedFile]
    reader: CheckpointReader
    raw_of: dict[str, str]  # normalised HF name -> name in the checkpoint
    tensors: list[PlannedTensor]  # every tensor of the plugin's plan, in write order
    skipped: dict[str, str] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.reader.close()


def _file_kinds(mode: MtpMode, k: int, notices: list[str]) -> list[str]:
    if mode in (MtpMode.ONLY, MtpMode.SEPARATE) and k == 0:
        raise SpecconvError(f"--mtp {mode.value}: the checkpoint has no MTP tensors (mtp.* / nextn layers), "
                            "so there is no MTP head to write")
    if mode == MtpMode.EMBED:
        if k == 0:
            notices.append("the checkpoint has no MTP tensors; writing the trunk only")
        return ["embedded"]
    return {MtpMode.NONE: ["trunk"], MtpMode.ONLY: ["sidecar"], MtpMode.SEPARATE: ["trunk", "sidecar"]}[mode]


def plan_conversion(req: ConvertRequest) -> ConversionPlan | LadderPlan:
    """Everything a conversion will do, decided from headers alone (nothing is written)."""
    reader = CheckpointReader(req.src)
    try:
        if is_ladder(req.outtype):  # --outtype q8_0,q6_k,q4_k_m: one plan per type, one read (convert/ladder.py)
            return plan_ladder(req, reader, _plan)
        return _plan(req, reader)
    except BaseException:
        reader.close()
        raise


def _plan(req: ConvertRequest, reader: CheckpointReader, tool_order: bool = False) -> ConversionPlan:
    plugin_cls = plugin_class_for(reader.config)
    headers, raw_of, skipped = reader.headers(plugin_cls.normalize_name)
    uses_target = plugin_cls.uses_target
    if req.target is not None and not uses_target:
        raise SpecconvError("--target is only for draft heads converted against their target (EAGLE-3)")
    if req.target_layers is not None and not uses_target:
        raise SpecconvError("--target-layers is only for draft heads that read their target's layers (EAGLE-3)")
    target_config = read_config(Path(req.target)) if req.target is not None and uses_target else None
    plugin = plugin_cls(Checkpoint(reader.config, headers, skipped, target_config,
                                   str(req.target) if target_config is not None else None, str(reader.dir),
                                   target_layers=req.target_layers))
    plans = plugin.tensor_plan()
    k, notices = plugin.n_mtp_layers, list(plugin.notices)
    if plugin.missing_mtp and req.mtp != MtpMode.NONE:
        raise SpecconvError(f"{plugin.missing_mtp}; use --mtp none to convert the trunk only")
    if plugin.missing_mtp:
        notices.append(plugin.missing_mtp)
    drafter_file = uses_target or plugin_cls.standalone_drafter
    kinds = _file_kinds(req.mtp, k, [] if drafter_file else notices)  # a draft head has no MTP layers to miss
    if skipped:
        reasons = Counter(skipped.values())
        notices += [f"skipped {n} tensor(s): {why}" for why, n in reasons.items()]

    first_matrix = next((h.dtype for h in headers.values() if len(h.shape) >= 2), None)
    outtype = resolve_outtype(req.outtype, first_matrix)
    storage = lossless_type(outtype, first_matrix)  # a K-quant's types are chosen per file, below
    planned = []
    for p in plans:
        choice = choose_storage(p.name, tuple(p.shape), storage, p.force_type)
        planned.append(PlannedTensor(p, choice.ggml_type, nbytes(tuple(p.shape), choice.ggml_type), choice.note))

    meta = kvmod.load_model_metadata(reader.dir, sum(_numel(p.plan.shape) for p in planned))
    tok_dir = plugin.tokenizer_dir or reader.dir  # a draft head carries its target's
    tok_kv = tokenizer_kv(tok_dir, plugin.vocab_size(), plugin.tokenizer_model, plugin.tokenizer_pre,
                          plugin.special_tokens)
    if tool_order:  # a ladder with a K-quant: every file in llama.cpp's quantize order
        rank = {name: i for i, name in enumerate(loader_order([t.name for t in planned]))}
        planned.sort(key=lambda t: rank[t.name])
    selected = {kind: [t for t in planned if t.plan.role in ROLES[kind]] for kind in kinds}
    if req.mtp_outtype is not None and not isinstance(outtype, KQuantFileType):
        raise SpecconvError("--mtp-outtype is for K-quant files (--outtype q2_k ... q6_k); with other types the "
                            "MTP layers already get --outtype")
    if isinstance(outtype, KQuantFileType):
        mtp_type = resolve_outtype(req.mtp_outtype, first_matrix) if req.mtp_outtype else None
        if isinstance(mtp_type, KQuantFileType):
            raise SpecconvError(f"--mtp-outtype {req.mtp_outtype}: choose f32, f16, bf16, q8_0 or q4_0 (a K-quant "
                                "file type is a rule set for a whole file)")
        planned, selected = _kquant_types(outtype, plugin, k, planned, selected, mtp_type, req.imatrix,
                                          req.type_overrides, req.override_note)
    labels = {kind: kvmod.parameter_label((t.name, tuple(t.plan.shape)) for t in ts) for kind, ts in selected.items()}
    model_kind = next((kind for kind in kinds if kind != "sidecar"), None)
    # the sidecar's name carries its model's size label, also when the model is not written (--mtp only)
    model_label = labels[model_kind] if model_kind else kvmod.parameter_label(
        (t.name, tuple(t.plan.shape)) for t in planned if t.plan.role in ROLES["trunk"])
    names = output_names(req.out, want_model=model_kind is not None, want_sidecar="sidecar" in kinds, meta=meta,
                         type_label=type_label(outtype), model_size_label=meta.size_label or model_label)
    files = []
    for kind in kinds:
        keep_mtp = kind != "trunk" and k > 0
        arch_kv = kvmod.with_file_type(plugin.gguf_arch, plugin.metadata(keep_mtp), file_type(outtype))
        kv = kvmod.general_kv(meta, labels[kind]) + arch_kv + tok_kv
        if isinstance(outtype, KQuantFileType):
            kv = requantized_kv(kv) + (req.imatrix.kv() if req.imatrix is not None else [])
        path = names.sidecar if kind == "sidecar" else names.model
        output = GgufOutput(path, plugin.gguf_arch, kv, [t.entry() for t in selected[kind]], req.split_max_size)
        files.append(PlannedFile(kind, output, selected[kind]))
    listed = reader.config.get("architectures") or []
    hf_arch = next((a for a in listed if a in plugin_cls.hf_architectures), listed[0] if listed else "")
    return ConversionPlan(reader.dir, plugin.gguf_arch, hf_arch, outtype, req.mtp, plugin.n_trunk_layers, k,
                          files, reader, raw_of, planned, skipped, notices)


def _kquant_types(outtype: KQuantFileType, plugin, k: int, planned: list[PlannedTensor],
                  selected: dict[str, list[PlannedTensor]], mtp_type: GGMLQuantizationType | None = None,
                  imatrix=None, overrides: Mapping[str, GGMLQuantizationType] | None = None, override_note: str = ""):
    """Each file's tensor types as llama.cpp's quantize gives them from our lossless file, and every
    tensor in that tool's order and with its shape (no trailing ggml sizes of 1: [64, 1] is written
    [64]) (convert/quant_rules.py). A tensor in two files (`separate`: the
    embedding and output) gets the same type in both, which is checked."""
    chosen: dict[str, GGMLQuantizationType] = {}
    for kind, ts in selected.items():
        hp = Hparams.from_kv(plugin.gguf_arch, plugin.metadata(kind != "trunk" and k > 0))
        infos = [TensorInfo(t.name, tuple(t.plan.shape), t.ggml_type) for t in ts]
        for name, ggml_type in choose_types(outtype.key, hp, infos, imatrix is not None, overrides).items():
            if chosen.setdefault(name, ggml_type) != ggml_type:
                raise SpecconvError(f"internal: {name} would be {chosen[name].name} in one file and "
                                    f"{ggml_type.name} in another")

    def retyped(t: PlannedTensor) -> PlannedTensor:
        ggml_type = chosen.get(t.name, t.ggml_type)
        note = t.note if ggml_type == t.ggml_type else \
            "" if ggml_type == outtype.default else f"{ggml_type.name} by llama.cpp's {outtype.name} rules"
        if overrides and t.name in overrides:
            note = f"{ggml_type.name} {override_note}".rstrip()
        if mtp_type is not None and t.plan.role == Role.MTP and ggml_type != t.ggml_type:
            # --mtp-outtype: what the tool would quantize in the MTP block gets the converter's type instead;
            # the trunk's types are unchanged (the counters still see the MTP block)
            choice = choose_storage(t.name, tuple(t.plan.shape), mtp_type, t.plan.force_type)
            ggml_type, note = choice.ggml_type, choice.note or f"{choice.ggml_type.name} by --mtp-outtype"
            return PlannedTensor(t.plan, ggml_type, nbytes(tuple(t.plan.shape), ggml_type), note,
                                 ggml_shape(tuple(t.plan.shape)))  # the converter's bytes: no imatrix
        weights = imatrix_plan(outtype.key, imatrix, [(t.name, tuple(t.plan.shape), ggml_type)]) \
            if ggml_type != t.ggml_type else {}  # what the tool quantizes (convert/imatrix.py)
        return PlannedTensor(t.plan, ggml_type, nbytes(tuple(t.plan.shape), ggml_type), note,
                             ggml_shape(tuple(t.plan.shape)), weights.get(t.name))

    rank = {name: i for i, name in enumerate(loader_order([t.name for t in planned]))}
    planned = [retyped(t) for t in sorted(planned, key=lambda t: rank[t.name])]  # the tool's order: its first refusal
    return planned, {kind: [t for t in planned if t.plan.role in ROLES[kind]] for kind in selected}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def run_conversion(plan: ConversionPlan | LadderPlan, overwrite: bool = False,
                   on_tensor: Callable[[str, int], None] | None = None, threads: int = 0) -> list[Path]:
    """Write every planned file; returns the written paths (shards included). Atomic as a whole.

    `threads` encoding threads (0: one per available core plus spares, see `default_workers`; 1:
    everything on this thread). The
    bytes written do not depend on it. `on_tensor(name, n)` reports n more bytes written.
    """
    if isinstance(plan, LadderPlan):  # several types: each tensor once per distinct type, to every file
        calls = ladder_calls(plan)
    else:
        members = [{t.name for t in f.tensors} for f in plan.files]
        calls = [(t, [f.output for f, m in zip(plan.files, members) if t.name in m]) for t in plan.tensors]
        calls = [(t, outputs) for t, outputs in calls if outputs]
    sources, buffers = Sources(plan.reader, plan.raw_of, [t.plan for t, _ in calls]), Buffers()
    with AtomicOutputs([f.output for f in plan.files], overwrite=overwrite), \
            OrderedPool(threads or default_workers()) as pool:
        for i, (t, outputs) in enumerate(calls):
            if i + 1 < len(calls):
                sources.prefetch(calls[i + 1][0].plan)  # the OS reads ahead while this one is encoded
            stream_tensor(t.plan, t.ggml_type, t.nbytes, sources, outputs, pool, buffers, on_tensor, t.weights)
    return [p for f in plan.files for p in f.output.final_paths]

