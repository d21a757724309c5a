"""`convert --outtype auto:q4_k_m` / `auto:5.2GB`: each tensor group's type chosen by measurement
under a size budget (docs/convert.md, "Auto mix").

1. The budget: a recipe's name gives that recipe's files' size (what `--outtype q4_k_m` writes, with
   the same `--mtp` and `--split-max-size`); a size (decimal units: 5.2GB, 800MB; binary: 5GiB) is
   taken as given, and the largest recipe whose files fit it becomes the mix's recipe (its file type
   and name tag, its per-tensor types one option of each group; the smallest recipe when none fits).
2. The checkpoint is converted once to a lossless reference (its own precision: BF16, F16, else F32)
   in a temporary folder, loaded by the runtime and scored on the calibration text
   (convert/mix_measure.py).
3. For each tensor group (convert/mix_groups.py) and each of its options, only that group takes the
   option and the KL divergence from the reference is measured; sizes are those of the files' bytes.
   The MTP block leaves the trunk's logits alone, so it is judged by acceptance instead: it takes the
   smallest option whose acceptance at draft position 1, teacher-forced on the reference trunk, is
   within MTP_TOLERANCE of the reference head's (the largest measured option when none is), and its
   bytes come off the budget first (a smaller option when the rest would not fit otherwise).
4. The trunk's groups get the options of least summed ΔKLD that fit what is left (an exact
   multiple-choice knapsack, convert/mix_alloc.py). That mix is measured whole, and so is the
   recipe: the mix is written only when its measured KLD is at most the recipe's (the allocation
   adds the groups' ΔKLD as if they did not interact; when they do and the sum misleads, the recipe's
   types are kept and the report says so).
5. The file is planned with those types (ConvertRequest.type_overrides, convert/quant_rules.py
   `choose_types`) and written as any K-quant conversion; the report gives group -> option, bytes,
   measured ΔKLD and acceptance, the predicted and the measured KLD of the mix and the recipe's.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from specconv.archs import plugin_class_for
from specconv.archs.base import MtpMode
from specconv.archs.errors import SpecconvError

from .mix_alloc import Option, allocate
from .mix_groups import MTP_GROUP, GroupOption, group_options, option_bytes, tensor_groups
from .quant_rules import KQUANT_FILE_TYPES
from .writer import GgufOutput

Q = GGMLQuantizationType

PREFIX = "auto:"
# recipes a size budget is matched against, smallest first (q2_k_s needs an imatrix, IQ4 types are not K-quants)
RECIPES = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
MTP_TOLERANCE = 0.01  # acceptance at draft position 1 the MTP block may lose against the reference head
MTP_DRAFT_MAX = 3
DEFAULT_CTX = 512
ALIGNMENT = 32  # GGUF's default data alignment, which the converter keeps
SIZE_TRIES = 3  # allocations tried when the planned files come out larger than the sizes added up
CALIBRATION_NAME = "calibration.txt"  # in specconv/data: written for this package, prose, code and data in a few languages
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?$", re.IGNORECASE)


@dataclass(frozen=True)
class AutoSpec:
    text: str  # as given, e.g. "auto:q4_k_m"
    recipe: str | None = None
    budget: int | None = None  # bytes


def is_auto(outtype: str) -> bool:
    return outtype.strip().lower().startswith(PREFIX)


def parse_auto(outtype: str) -> AutoSpec:
    """`auto:RECIPE` or `auto:SIZE`; anything else is a one-line error."""
    text = outtype.strip()
    arg = text[len(PREFIX):].strip()
    if not arg:
        raise SpecconvError(f"--outtype {text}: give a recipe (auto:q4_k_m) or a size (auto:5.2GB) after 'auto:'")
    if arg.lower() in KQUANT_FILE_TYPES:
        return AutoSpec(text, recipe=arg.lower())
    if arg.startswith("-"):
        raise SpecconvError(f"--outtype {text}: the size must be positive")
    m = _SIZE.match(arg)
    if not m:
        raise SpecconvError(f"--outtype {text}: {arg!r} is neither a recipe ({', '.join(KQUANT_FILE_TYPES)}) nor a "
                            f"size such as 5.2GB or 800MB")
    base = 1024 if m.group(3) else 1000
    if m.group(3) and not m.group(2):
        raise SpecconvError(f"--outtype {text}: {arg!r} is not a size (KiB, MiB, GiB, or KB, MB, GB)")
    value = float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " ")
    if value < 1:
        raise SpecconvError(f"--outtype {text}: the size must be positive")
    return AutoSpec(text, budget=int(value))


def calibration_text() -> Path:
    """The calibration text shipped with the package."""
    import specconv

    return Path(specconv.__file__).resolve().parent / "data" / CALIBRATION_NAME


# ------------------------------------------------------------------------------------------ sizes


def planned_bytes(plan, split_max_size: int = 0) -> int:
    """The bytes of every file (every shard) the plan writes: header, metadata, tensor infos and the
    aligned tensor data, as the writer lays them out (its files opened in a temporary folder, sized
    with holes, and removed)."""
    total = 0
    with tempfile.TemporaryDirectory(prefix="specconv-size-") as tmp:
        for i, f in enumerate(plan.files):
            out = GgufOutput(Path(tmp) / f"{i}.gguf", f.output.arch, f.kv, f.output.tensors, split_max_size)
            out.open()
            try:
                total += sum(os.path.getsize(p) for p in out.temp_paths)
            finally:
                out.close()
    return total


# ------------------------------------------------------------------------------------------ the run


@dataclass
class _Group:
    name: str
    tensors: list
    options: list[GroupOption]
    bytes: list[int]
    recipe: int  # index of the recipe's option
    kld: list = dataclasses.field(default_factory=list)  # MixScore per option (trunk groups)
    acceptance: list = dataclasses.field(default_factory=list)  # SpecStats per option (the MTP block)


def plan_auto_mix(req, spec: AutoSpec, text: Path | None = None, ctx: int = DEFAULT_CTX,
                  n_chunks: int | None = None, threads: int = 0, device: str = "cpu", progress=None):
    """(the final ConversionPlan, the report) for `req` (a ConvertRequest whose outtype is ignored)."""
    from .engine import plan_conversion

    tick = progress or (lambda *a, **k: None)
    content = _read_text(text)
    recipe, recipe_plan, budget = recipe_and_budget(req, spec)
    try:
        groups = _groups(recipe_plan, recipe, fixed_mtp=req.mtp_outtype is not None)
        trunk = [g for g in groups if g.name != MTP_GROUP]
        mtp = next((g for g in groups if g.name == MTP_GROUP), None)
        size_recipe = planned_bytes(recipe_plan, req.split_max_size)
        fixed = size_recipe - sum(g.bytes[g.recipe] for g in groups)
        with tempfile.TemporaryDirectory(prefix="specconv-auto-mix-") as tmp:
            cal = _measure(req, recipe_plan, recipe, trunk, mtp, Path(tmp), content, ctx, n_chunks, threads, device,
                           tick)
            try:
                with cal.swapped(_types(trunk, [g.recipe for g in trunk])):
                    recipe_score = cal.kld()
                slack = 0  # bytes the sizes added up per tensor missed (shard headers of a split file)
                for _ in range(SIZE_TRIES):
                    picks, mtp_pick = _allocate(trunk, mtp, budget - fixed - slack, cal.reference_acceptance)
                    head_types = _types([mtp], [mtp_pick]) if mtp is not None else {}
                    mix_types = _types(trunk, picks) | head_types
                    with cal.swapped(mix_types):
                        allocated = mix_score = cal.kld()
                    kept_recipe = mix_score.kld > recipe_score.kld
                    if kept_recipe:  # the groups' ΔKLD did not add up: the recipe's types, measured better
                        picks, mix_score = [g.recipe for g in trunk], recipe_score
                        mix_types = _types(trunk, picks) | head_types
                    final = plan_conversion(dataclasses.replace(req, outtype=recipe, type_overrides=mix_types,
                                                                override_note="by the auto mix (measured)"))
                    size = planned_bytes(final, req.split_max_size)
                    if size <= budget:
                        break
                    final.close()
                    slack += size - budget
                else:
                    raise SpecconvError(f"no mix found within {budget} bytes: the files' headers ({fixed} bytes with "
                                        "the ungrouped tensors) leave too little; give a larger size")
                positions, chunks, reference_acc = cal.positions, cal.chunks, cal.reference_acceptance
                stride = cal.mtp_stride
            finally:
                cal.close()
    finally:
        recipe_plan.close()
    report = _report(spec, recipe, budget, size, size_recipe, trunk, picks, mtp, mtp_pick, mix_score, recipe_score,
                     allocated, kept_recipe, reference_acc, positions, chunks, text)
    report["fixed_bytes"] = fixed  # header, metadata and the tensors no group holds
    if report["mtp"] is not None:
        report["mtp"]["stride"] = stride  # a draft round at every stride-th position (compare's --mtp-stride)
    return final, report


def _read_text(text: Path | None) -> str:
    path = Path(text) if text is not None else calibration_text()
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecconvError(f"--text {path}: not UTF-8 text") from None
    except OSError as exc:
        raise SpecconvError(f"--text {path}: {exc.strerror or exc}") from None


def recipe_and_budget(req, spec: AutoSpec):
    """(recipe, its plan, the budget in bytes): the recipe named, or the largest one whose files fit the
    size given (the smallest one when none does)."""
    from .engine import plan_conversion

    if spec.recipe is not None:
        plan = plan_conversion(dataclasses.replace(req, outtype=spec.recipe))
        return spec.recipe, plan, planned_bytes(plan, req.split_max_size)
    best = None  # (fits, size, recipe, plan)
    for recipe in RECIPES:
        plan = plan_conversion(dataclasses.replace(req, outtype=recipe))
        size = planned_bytes(plan, req.split_max_size)
        entry = (size <= spec.budget, size if size <= spec.budget else -size, recipe, plan)
        if best is None or entry[:2] > best[:2]:
            best, plan = entry, best[3] if best is not None else None
        if plan is not None:
            plan.close()
    return best[2], best[3], spec.budget


def _groups(plan, recipe: str, fixed_mtp: bool) -> list[_Group]:
    recipe_types = {t.name: t.ggml_type for t in plan.tensors}
    out = []
    for name, tensors in tensor_groups(plan).items():
        if name == MTP_GROUP and fixed_mtp:  # --mtp-outtype decides the MTP block
            continue
        options = group_options(tensors, recipe.upper(), recipe_types)
        recipe_key = tuple((t.name, recipe_types[t.name]) for t in tensors)
        index = next(i for i, o in enumerate(options) if sorted(o.types) == sorted(recipe_key))
        out.append(_Group(name, tensors, options, [option_bytes(tensors, o, ALIGNMENT) for o in options], index))
    return out


def _types(groups, picks) -> dict[str, GGMLQuantizationType]:
    out = {}
    for g, i in zip(groups, picks):
        out.update(g.options[i].assignment)
    return out


def _measure(req, recipe_plan, recipe, trunk, mtp, tmp: Path, content: str, ctx, n_chunks, threads, device, tick):
    """Convert the lossless reference, score it, then every option of every group; the Calibration."""
    from .engine import ConvertRequest, plan_conversion, run_conversion
    from .imatrix import imatrix_plan
    from .mix_measure import Calibration

    ref_req = ConvertRequest(src=req.src, out=str(tmp / "reference.gguf"), outtype=_lossless_outtype(recipe_plan),
                             mtp=MtpMode.EMBED, target=req.target, target_layers=req.target_layers)
    tick("converting the lossless reference")
    ref_plan = plan_conversion(ref_req)
    try:
        paths = run_conversion(ref_plan, threads=threads)
    finally:
        ref_plan.close()

    def weights_for(name, shape, ggml_type):  # what --imatrix gives the tensor at that type
        return imatrix_plan(recipe, req.imatrix, [(name, shape, ggml_type)]).get(name)

    cal = Calibration(paths[0], content, ctx, n_chunks, tmp, MTP_DRAFT_MAX if mtp else 0, weights_for, device,
                      lambda advance=0: tick(None, advance=advance))
    try:
        n = cal.chunks.n_chunks
        tick("measuring the reference", total=n * (1 + sum(len(g.options) for g in trunk) + 2)
             + (n * (1 + len(mtp.options)) if mtp is not None and cal.has_head else 0))
        cal.score_reference()
        for g in trunk:
            for o in g.options:
                tick(f"measuring {g.name} at {o.label}")
                with cal.swapped(o.assignment):
                    g.kld.append(cal.kld())
        if mtp is not None and cal.has_head:
            for o in mtp.options:
                tick(f"measuring the MTP block at {o.label}")
                with cal.swapped(o.assignment):
                    mtp.acceptance.append(cal.acceptance())
        tick("measuring the mix")
    except BaseException:
        cal.close()
        raise
    return cal


def _lossless_outtype(plan) -> str:
    """The checkpoint's own precision (the K-quant rules' starting point, convert/outtype.py)."""
    plugin_cls = plugin_class_for(plan.reader.config)
    headers, _, _ = plan.reader.headers(plugin_cls.normalize_name)
    first = next((h.dtype for h in headers.values() if len(h.shape) >= 2), None)
    return {"BF16": "bf16", "F16": "f16"}.get(first or "", "f32")


def _first_accepted(stats) -> float:
    per = stats.to_json()["per_position"]
    return float(per[0]) if per else 0.0


def _allocate(trunk: list[_Group], mtp: _Group | None, room: int, reference_acceptance):
    """(option index per trunk group, the MTP block's option) fitting `room` bytes."""
    smallest = sum(min(g.bytes) for g in trunk)
    mtp_pick = None
    if mtp is not None:
        order = sorted(range(len(mtp.options)), key=lambda i: mtp.bytes[i])
        if mtp.acceptance and reference_acceptance is not None:
            ref = _first_accepted(reference_acceptance)
            good = [i for i in order if ref - _first_accepted(mtp.acceptance[i]) <= MTP_TOLERANCE]
            wanted = good[0] if good else max(order, key=lambda i: (_first_accepted(mtp.acceptance[i]), -mtp.bytes[i]))
        else:  # no head to run (no draft length): the recipe's types
            wanted = mtp.recipe
        fitting = [i for i in order if mtp.bytes[i] <= mtp.bytes[wanted] and mtp.bytes[i] + smallest <= room]
        if not fitting:
            raise _too_small(room, smallest + min(mtp.bytes))
        mtp_pick = wanted if wanted in fitting else fitting[-1]
        room -= mtp.bytes[mtp_pick]
    options = [[Option(b, s.kld) for b, s in zip(g.bytes, g.kld)] for g in trunk]
    picks = allocate(options, room)
    if picks is None:
        raise _too_small(room, smallest)
    return list(picks), mtp_pick


def _too_small(room: int, need: int) -> SpecconvError:
    return SpecconvError(f"the size budget leaves {room} bytes for the quantized tensors; the smallest mix needs "
                         f"{need}: give a larger size or recipe")


# ------------------------------------------------------------------------------------------ report


def _report(spec, recipe, budget, size, size_recipe, trunk, picks, mtp, mtp_pick, mix_score, recipe_score,
            allocated, kept_recipe, reference_acc, positions, chunks, text) -> dict:
    groups = []
    for g, i in zip(trunk, picks):
        groups.append({
            "group": g.name, "tensors": len(g.tensors), "chosen": g.options[i].label, "types": g.options[i].type_counts(),
            "bytes": g.bytes[i], "delta_kld": g.kld[i].kld, "recipe_option": g.options[g.recipe].label,
            "options": [{"option": o.label, "bytes": b, "delta_kld": s.kld, "same_top": s.same_top}
                        for o, b, s in zip(g.options, g.bytes, g.kld)],
        })
    head = None
    if mtp is not None:
        ref = reference_acc.to_json()["per_position"] if reference_acc is not None else None
        head = {"group": MTP_GROUP, "tensors": len(mtp.tensors), "chosen": mtp.options[mtp_pick].label,
                "types": mtp.options[mtp_pick].type_counts(), "bytes": mtp.bytes[mtp_pick],
                "rule": f"the smallest option whose acceptance at draft position 1 is within {MTP_TOLERANCE} of the "
                        f"reference head's",
                "reference_per_position": ref,
                "per_position": mtp.acceptance[mtp_pick].to_json()["per_position"] if mtp.acceptance else None,
                "options": [{"option": o.label, "bytes": b,
                             "per_position": mtp.acceptance[i].to_json()["per_position"] if mtp.acceptance else None}
                            for i, (o, b) in enumerate(zip(mtp.options, mtp.bytes))]}
    predicted = sum(g["delta_kld"] for g in groups)
    return {
        "spec": spec.text, "recipe": recipe.upper(), "budget_bytes": budget, "file_bytes": size,
        "recipe_file_bytes": size_recipe,
        "calibration": {"text": str(text) if text is not None else "(bundled) " + CALIBRATION_NAME,
                        "ctx": chunks.ctx, "chunks": chunks.n_chunks, "scored_positions": positions},
        "groups": groups, "mtp": head,
        "kld": {"predicted": predicted, "measured": mix_score.kld, "measured_error": mix_score.kld_error,
                "same_top": mix_score.same_top, "recipe_measured": recipe_score.kld,
                "recipe_same_top": recipe_score.same_top, "allocation_measured": allocated.kld},
        "kept_recipe": kept_recipe,
    }
