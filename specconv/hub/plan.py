"""The upload plan: which repository path each output file gets, what must be re-split, the card.

The plan is pure data computed from a folder of GGUF outputs (only headers are read), so a dry run
can print it and tests can check it without any network. `stage()` then writes the files the plan
generates (re-split shards) next to the outputs; the upload sends exactly the plan's files.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from specconv.errors import SpecconvError
from specconv.hub import card as card_mod
from specconv.hub.gguf_info import GgufModel, group_files, read_model
from specconv.hub.naming import (
    HEAD_PREFIX,
    SHARD_RE,
    Role,
    check_model_base,
    head_own_base,
    repo_file_name,
    sanitize_base,
    scheme_base,
    shard_paths,
    strip_quant_tag,
    validate_repo_id,
    validate_repo_path,
    validate_revision,
    without_markers,
)
from specconv.hub.quality import load_compare, match_compares, quality_section
from specconv.hub.report import VerifyReport
from specconv.hub.split import ShardLayout, plan_split
from specconv.hub.verified import load_reports, match_reports

DEFAULT_MAX_FILE_SIZE = 50 * 10**9  # the Hub's hard per-file limit (docs/reference/hub.md §2)
STAGING_DIR = ".specconv-upload"
README = "README.md"


@dataclass
class PlanFile:
    path_in_repo: str
    size: int
    source: Path | None = None  # uploaded verbatim (an input file)
    staged: Path | None = None  # written by stage() (a re-split shard)
    content: bytes | None = None  # generated in memory (README.md)
    artifact: str | None = None  # the unsplit file name it belongs to
    sha256: bytes | None = None  # known digest (a staged shard's, from its manifest)

    @property
    def local_path(self) -> Path | None:
        return self.source or self.staged


@dataclass
class Artifact:
    name: str  # unsplit repository file name, e.g. Model-Q8_0.gguf
    base: str
    quant: str
    role: Role
    arch: str
    sources: list[Path]
    files: list[PlanFile]
    layout: ShardLayout | None = None  # set when the plan re-splits the sources
    type_bytes: dict[str, int] = field(default_factory=dict)  # tensor bytes per ggml type
    report: VerifyReport | None = None  # the verify report run on this model file
    verified_with: str | None = None  # a sidecar: the model whose report verified it

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def paths(self) -> list[str]:
        return [f.path_in_repo for f in self.files]


@dataclass
class UploadPlan:
    repo_id: str
    folder: Path
    max_file_size: int
    artifacts: list[Artifact]
    readme: PlanFile
    base_model: str | None
    license: str | None
    revision: str | None = None
    ignored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[PlanFile]:
        """Every file the upload sends, models first and the card last."""
        return [f for a in self.artifacts for f in a.files] + [self.readme]

    @property
    def staging_dir(self) -> Path:
        return self.folder / STAGING_DIR

    def to_dict(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "max_file_size": self.max_file_size,
            "base_model": self.base_model,
            "license": self.license,
            "artifacts": [
                {
                    "name": a.name,
                    "quant": a.quant,
                    "role": a.role.value,
                    "arch": a.arch,
                    "size": a.size,
                    "resplit": a.layout is not None,
                    "sources": [str(p) for p in a.sources],
                    "files": [{"path_in_repo": f.path_in_repo, "size": f.size} for f in a.files],
                    "tensor_types": a.type_bytes,
                    "verify": _verify_summary(a.report),
                    "verified_with": a.verified_with,
                }
                for a in self.artifacts
            ],
            "files": [
                {"path_in_repo": f.path_in_repo, "size": f.size, "local": str(f.local_path) if f.local_path else None}
                for f in self.files
            ],
            "ignored": self.ignored,
            "warnings": self.warnings,
        }


def _verify_summary(report: VerifyReport | None) -> dict | None:
    """The card's figures of one file, for scripts (`--json`)."""
    if report is None:
        return None
    spec = report.speculative
    return {"report": report.source, "passed": report.passed,
            "max_abs_logit_diff": report.parity.get("max_abs_logit_diff"),
            "parity_reference": report.parity.get("reference"),
            **{k: spec.get(k) for k in ("acceptance_rate", "acceptance_length", "tokens_per_target_forward",
                                        "speedup")}}


# --- scanning --------------------------------------------------------------------------------


def scan_folder(folder: Path) -> tuple[list[Path], list[str]]:
    """`.gguf` files under `folder` (hidden entries skipped) and the names of everything ignored.

    A symbolic link that leads outside the folder is refused: the upload must never send a file
    the user did not put in the output folder.
    """
    root = folder.resolve()
    ggufs: list[Path] = []
    ignored: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if name.startswith("."):
                continue
            if not path.resolve().is_relative_to(root):
                raise SpecconvError(f"refusing {rel}: it is a link to a file outside {folder}")
            if not path.is_file():
                ignored.append(rel)
            elif name.endswith(".gguf"):
                ggufs.append(path)
            else:
                ignored.append(rel)
    return ggufs, ignored


def collect_inputs(inputs) -> tuple[Path, list[Path], list[str]]:
    """(folder, .gguf files, ignored names) from one folder or from .gguf files: a folder is scanned as
    `scan_folder` does; a named file brings the other shards of its set and its `mtp-` sidecar(s) from
    the same folder (what `specconv convert` wrote next to it). The folder of files is their common one."""
    paths = [Path(p) for p in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    if not paths:
        raise SpecconvError("give a folder of GGUF outputs, or .gguf files")
    if len(paths) == 1 and paths[0].is_dir():
        ggufs, ignored = scan_folder(paths[0])
        return paths[0], ggufs, ignored
    chosen: dict[Path, Path] = {}
    for path in paths:
        if path.is_dir():
            raise SpecconvError(f"{path} is a folder: give one folder, or .gguf files")
        if not path.is_file() or path.suffix != ".gguf":
            raise SpecconvError(f"{path} is not a .gguf file")
        siblings = [path]
        match = SHARD_RE.match(path.name)
        stem = match.group("prefix") if match else path.name.removesuffix(".gguf")
        if match:
            siblings += sorted(path.parent.glob(f"{glob_escape(stem)}-?????-of-{match.group('count')}.gguf"))
        if not stem.startswith(("mtp-", "eagle3-", "dflash-")):
            siblings += [p for p in sorted(path.parent.glob(f"mtp-{glob_escape(stem)}*.gguf"))
                         if p.name == f"mtp-{stem}.gguf" or SHARD_RE.match(p.name)
                         and SHARD_RE.match(p.name).group("prefix") == f"mtp-{stem}"]
        for p in siblings:
            chosen.setdefault(p.resolve(), p)
    folder = Path(os.path.commonpath([str(p.parent.resolve()) for p in chosen]))
    return folder, sorted(chosen), []


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


# --- naming ----------------------------------------------------------------------------------


def _hf_repo_from_url(url: str) -> str | None:
    match = re.match(r"^https?://(?:www\.)?huggingface\.co/([^/?#]+/[^/?#]+?)/?$", url.strip())
    return match.group(1) if match else None


def model_base(model: GgufModel, name: str | None) -> str:
    """The `{Base}` of `{Base}-{QUANT}.gguf`: --name, else the GGUF's general.* naming keys, else the
    file name without its prefix, shard suffix and quant tag."""
    return check_model_base(_raw_base(model, name))


def _raw_base(model: GgufModel, name: str | None) -> str:
    if name:
        base = sanitize_base(name)
    else:
        base = scheme_base(*(model.get(f"general.{k}") for k in ("name", "basename", "size_label", "finetune",
                                                                  "version")))
        if base is None:  # no name in the file: its own, without prefix, shard suffix (and quant tag, below)
            stem = model.paths[0].name
            match = SHARD_RE.match(stem)
            stem = match.group("prefix") if match else stem.removesuffix(".gguf")
            for prefix in ("mtp-", "eagle3-", "dflash-"):
                stem = stem.removeprefix(prefix)
            base = without_markers(sanitize_base(stem))
        if model.role is Role.ASSISTANT:
            base = re.sub(r"-assistant(?=-|$)", "", base, flags=re.IGNORECASE)  # the name adds it back
    return strip_quant_tag(base, model.quant)


def head_base(head: GgufModel, name: str | None, target_bases: list[str], warnings: list[str]) -> str:
    """The `{Base}` of an EAGLE-3 / DFlash head: its target's, so that `eagle3-{Target}-{QUANT}.gguf` sits next to
    `{Target}-{QUANT}.gguf` (llama.cpp's -hf finds it by the prefix; the card pairs them by the base). --name
    names every file; with no model file, or several, the head keeps its own name without its kind marker."""
    if name or len(target_bases) == 1:
        return target_bases[0] if not name else model_base(head, name)
    own = strip_quant_tag(head_own_base(_raw_base(head, None)), head.quant)
    if target_bases:
        warnings.append(f"{head.paths[0].name}: several models here ({', '.join(target_bases)}); the "
                        f"{head.role.value} keeps its own name {own!r}, and llama.cpp's -hf takes any "
                        f"{HEAD_PREFIX[head.role]} file of the repository: publish one target per repository")
    return check_model_base(own)


def check_head_fits(head: GgufModel, targets: list[GgufModel]) -> None:
    """An EAGLE-3 head reads target hidden states of `eagle3.target_hidden_size`: refuse to publish it next to
    model files of another width (llama.cpp would pair them and fail to build the draft context)."""
    want = head.get("eagle3.target_hidden_size") if head.role is Role.EAGLE3 else None
    widths = sorted({w for t in targets if isinstance(w := t.get(f"{t.arch}.embedding_length"), int)})
    if isinstance(want, int) and widths and want not in widths:
        raise SpecconvError(f"{head.paths[0].name}: the EAGLE-3 head reads target hidden states of width {want}, "
                            f"but the model files here have width {', '.join(map(str, widths))}: it belongs to "
                            f"another target")


def _draft_max(model: GgufModel) -> int | None:
    """A DFlash drafter drafts at most block_size - 1 tokens per round (llama.cpp clamps to it)."""
    block = model.get("dflash.block_size") if model.role is Role.DFLASH else None
    return block - 1 if isinstance(block, int) and block > 1 else None


def sidecar_base(sidecar: GgufModel, name: str | None, targets: list[GgufModel]) -> str | None:
    """An `mtp-` sidecar is named after the model of its quant (`mtp-{Base}-{QUANT}.gguf`, docs/reference/hub.md
    §1.3): its own general.size_label counts the sidecar's parameters, not the model's."""
    same = sorted({model_base(t, name) for t in targets if t.quant == sidecar.quant})
    if len(same) == 1:
        return same[0]
    every = sorted({model_base(t, name) for t in targets})
    return every[0] if len(every) == 1 else None


def _artifact(model: GgufModel, name: str | None, max_file_size: int, staging: Path, base: str | None = None) -> Artifact:
    base = base or model_base(model, name)
    file_name = repo_file_name(base, model.quant, model.role)
    layout = None
    if all(size <= max_file_size for size in model.shard_sizes):
        paths = [file_name] if not model.is_split else shard_paths(file_name, len(model.paths), model.role)
        files = [PlanFile(p, s, source=src) for p, s, src in zip(paths, model.shard_sizes, model.paths)]
    else:
        layout = plan_split(model.paths, max_file_size)
        paths = [file_name] if layout.count == 1 else shard_paths(file_name, layout.count, model.role)
        files = [PlanFile(p, s, staged=staging / p) for p, s in zip(paths, layout.sizes)]
    for f in files:
        f.artifact = file_name
    return Artifact(file_name, base, model.quant, model.role, model.arch, list(model.paths), files, layout,
                    dict(model.type_bytes))


def build_plan(
    folder,
    *,
    repo_id: str,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    report: VerifyReport | Path | None = None,
    reports=(),
    base_model: str | None = None,
    name: str | None = None,
    license: str | None = None,
    quantized_by: str = "specconv",
    revision: str | None = None,
    compares=(),
) -> UploadPlan:
    validate_repo_id(repo_id)
    if revision is not None:
        validate_revision(revision)
    if base_model is not None:
        validate_repo_id(base_model, namespace_required=False, what="--base-model")
    """The plan for `folder` (a folder of outputs, or a list of .gguf files: collect_inputs); `report` and
    `reports` are verify reports (paths or parsed), each matched to the model file it verified; `compares` are
    `specconv compare --json` reports (paths), each quant matched to the uploaded file it measured."""
    if isinstance(folder, (str, Path)) and not Path(folder).is_dir():
        raise SpecconvError(f"{folder} is not a folder")
    reports = load_reports([*([report] if report is not None else []), *reports])

    folder, ggufs, ignored = collect_inputs(folder)
    if not ggufs:
        raise SpecconvError(f"no .gguf files in {folder}")
    staging = folder / STAGING_DIR
    models = [read_model(group) for group in group_files(ggufs)]
    warnings = [w for m in models for w in m.warnings]
    targets = [m for m in models if not m.role.is_draft]
    target_bases = sorted({model_base(m, name) for m in targets})
    for m in models:
        if m.role.is_head:
            check_head_fits(m, targets)
    artifacts = [_artifact(m, name, max_file_size, staging,
                           head_base(m, name, target_bases, warnings) if m.role.is_head else
                           sidecar_base(m, name, targets) if m.role is Role.SIDECAR else None) for m in models]
    order = {Role.EMBEDDED: 0, Role.TRUNK: 0, Role.SIDECAR: 1, Role.ASSISTANT: 1, Role.EAGLE3: 2, Role.DFLASH: 2}
    artifacts.sort(key=lambda a: (a.base, a.quant, order[a.role], a.name))
    by_source = {m.paths[0]: m for m in models}

    seen: dict[str, Artifact] = {}
    for a in artifacts:
        for f in a.files:
            validate_repo_path(f.path_in_repo)
            other = seen.get(f.path_in_repo.lower())
            if other is not None and {other.role, a.role} == {Role.EMBEDDED, Role.TRUNK}:
                raise SpecconvError(
                    f"{other.sources[0].name} and {a.sources[0].name} are the embedded-MTP and trunk-only "
                    f"variants of {a.name}; publish them in separate repositories (llama.cpp's -hf picks one "
                    "model file per quant tag)"
                )
            if other is not None:
                raise SpecconvError(
                    f"{other.sources[0].name} and {a.sources[0].name} would both be uploaded as "
                    f"{f.path_in_repo}; keep one or pass --name"
                )
            seen[f.path_in_repo.lower()] = a
        if a.role.is_draft and len(a.files) > 1:
            warnings.append(f"{a.name} is split; llama.cpp then needs an explicit --spec-type (the card shows it)")
    if README.lower() in seen:
        raise SpecconvError("an input file would be uploaded as README.md")

    if base_model is None:
        for m in models:
            url = m.get("general.base_model.0.repo_url") or m.get("general.source.repo_url")
            base_model = _hf_repo_from_url(url) if isinstance(url, str) else None
            if base_model:
                break
    if base_model is None:
        warnings.append("base model unknown (no general.base_model.0.repo_url): pass --base-model ORG/NAME")
    if license is None:
        license = next((m.get("general.license") for m in models if isinstance(m.get("general.license"), str)), None)
    if any(a.role is Role.SIDECAR for a in artifacts) and not any(
        a.role in (Role.TRUNK, Role.EMBEDDED) for a in artifacts
    ):
        warnings.append("the folder has an mtp- sidecar but no model file for it")
    if any(a.role.is_head for a in artifacts) and not targets:
        warnings.append("the folder has a draft head but no model file: llama.cpp's -hf finds eagle3- / dflash- files "
                        "next to the model of the same repository (docs/upload.md)")

    digests = match_reports(reports, artifacts, warnings)
    for a in artifacts:  # hashed to match a report: the upload need not hash it again
        if a.layout is None and a.sources[0] in digests:
            a.files[0].sha256 = digests[a.sources[0]]
    quality = match_compares([load_compare(p) for p in compares], artifacts, warnings)
    entries = [card_mod.CardEntry(a.name, a.paths, a.base, a.quant, a.role, a.size, _draft_max(m), a.type_bytes,
                                  a.report, a.verified_with)
               for a, m in zip(artifacts, [by_source[a.sources[0]] for a in artifacts])]
    text = card_mod.render_card(
        repo_id=repo_id,
        entries=entries,
        base_model=base_model,
        license=license,
        quantized_by=quantized_by,
        quality=quality_section(quality),
    )
    data = text.encode("utf-8")
    readme = PlanFile(README, len(data), content=data)
    return UploadPlan(
        repo_id=repo_id,
        folder=folder,
        max_file_size=max_file_size,
        artifacts=artifacts,
        readme=readme,
        base_model=base_model,
        license=license,
        revision=revision,
        ignored=ignored,
        warnings=warnings,
    )
