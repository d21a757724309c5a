"""Names in a Hub GGUF repository: quant tags, file names, shard names, and what the Hub accepts.

The layout follows the conventions llama.cpp's `-hf` resolver and the common GGUF publishers rely
on (docs/reference/hub.md §1): `{Base}-{QUANT}.gguf` for a model, `mtp-{Base}-{QUANT}.gguf` for an MTP
sidecar (same quant tag, so the exact-tag sidecar match applies), `eagle3-{Base}-{QUANT}.gguf` /
`dflash-{Base}-{QUANT}.gguf` for draft heads (docs/upload.md, "Draft heads next to their target"), and
`{prefix}-{i:05d}-of-{n:05d}.gguf` for split shards.
"""

from __future__ import annotations

import enum
import re

import gguf

from specconv.errors import SpecconvError

SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# llama.cpp treats a .gguf whose name contains one of these as something other than the main
# model (common/download.cpp, gguf_filename_is_model: std::string::find, case-sensitive), so a model
# name must never contain them. `Tiny-Qwen35-Mtp-2.4M` does not: `Mtp-` is not `mtp-`.
NON_MODEL_MARKERS = ("mtp-", "mmproj", "imatrix", "eagle3-", "dflash-", "dspark-")
# A marker that ends in "-" also forms at the end of a name, from the "-" before the quant tag.
_MARKER_RE = re.compile("|".join(re.escape(m[:-1]) + "(?=-|$)" if m.endswith("-") else re.escape(m)
                                 for m in NON_MODEL_MARKERS))

QUANT_TAG_RE = re.compile(r"^[A-Z0-9_]+$")


class Role(enum.Enum):
    """What a GGUF file is for, detected from its metadata the way llama.cpp does."""

    EMBEDDED = "embedded MTP"  # trunk + MTP block(s) in one file
    TRUNK = "trunk only"  # no nextn key: a plain model (pair it with an mtp- sidecar)
    SIDECAR = "MTP sidecar"  # nextn > 0 and no trunk block: the mtp- file
    EAGLE3 = "EAGLE-3 draft"
    DFLASH = "DFlash drafter"
    ASSISTANT = "Gemma 4 assistant"  # gemma4-assistant drafter, never auto-detected

    @property
    def is_draft(self) -> bool:
        return self in (Role.SIDECAR, Role.EAGLE3, Role.DFLASH, Role.ASSISTANT)

    @property
    def is_head(self) -> bool:
        """A separately trained draft model (EAGLE-3 head, DFlash drafter) named after its target."""
        return self in (Role.EAGLE3, Role.DFLASH)


# The name prefix llama.cpp's -hf sibling discovery looks for (common/download.cpp, find_best_sibling:
# a .gguf whose path contains it, in the model's folder or one of its ancestors).
HEAD_PREFIX = {Role.EAGLE3: "eagle3-", Role.DFLASH: "dflash-"}
_HEAD_MARKER_RE = re.compile(r"(?:^|[-_.])(?:eagle-?3|dflash\d*)(?=$|[-_.])", re.IGNORECASE)


def file_type_tag(file_type: int) -> str | None:
    """`general.file_type` -> quant tag (`7` -> `Q8_0`), or None for unknown / guessed values."""
    try:
        member = gguf.LlamaFileType(file_type)
    except ValueError:
        return None
    if member is gguf.LlamaFileType.GUESSED:
        return None
    return member.name.removeprefix("MOSTLY_").removeprefix("ALL_")


def tensor_type_tag(tensor_type: gguf.GGMLQuantizationType) -> str:
    return tensor_type.name.upper()


def sanitize_base(text: str) -> str:
    """A model name made safe for a file name: `Qwen3.5 9B` -> `Qwen3.5-9B`."""
    name = re.sub(r"\s+", "-", text.strip())
    name = re.sub(r"[^A-Za-z0-9._+-]", "-", name)
    name = re.sub(r"-{2,}", "-", name)
    return name.strip("-._")


def strip_quant_tag(base: str, quant: str) -> str:
    """Drop a trailing `-Q8_0` / `.Q8_0` already carried by a name, so it is not doubled."""
    for sep in ("-", "."):
        suffix = f"{sep}{quant}"
        if base.upper().endswith(suffix.upper()):
            return base[: -len(suffix)]
    return base


def without_markers(name: str) -> str:
    """A name taken from metadata with llama.cpp's non-model markers in capitals (`qwen-mtp-9b` ->
    `qwen-MTP-9b`): its test is case-sensitive, so the model file is still taken for the model."""
    return _MARKER_RE.sub(lambda m: m.group(0).upper(), name)


def scheme_base(name: str | None, basename: str | None = None, size_label: str | None = None,
                finetune: str | None = None, version: str | None = None) -> str | None:
    """`<Name>-<Size>[-<Finetune>][-<Version>]`, the part before the quant tag in llama.cpp's file names
    (gguf-py's naming_convention: the basename, else the name; here a size already in the name is not
    repeated), safe for a file name and for llama.cpp's -hf (without_markers). `convert` names its files
    `{base}-{QUANT}.gguf` and `mtp-{base}-{QUANT}.gguf` with it, `upload` its repository files, from the
    same general.* keys, so the two agree. None when there is no name at all."""
    extras = [x for x in (size_label, finetune, version) if isinstance(x, str) and x.strip()]
    if isinstance(basename, str) and basename.strip():
        base = "-".join([basename.strip(), *extras])
    elif isinstance(name, str) and name.strip():
        base = "-".join([name.strip(), *[x for x in extras if x.lower() not in name.lower()]])
    else:
        return None
    return without_markers(sanitize_base(base)) or None


def check_model_base(base: str) -> str:
    """Refuse a base name llama.cpp would misread (a trunk named `...mtp-...` looks like a sidecar)."""
    if not base:
        raise SpecconvError("empty model name; pass --name NAME")
    for marker in NON_MODEL_MARKERS:
        if marker in base:
            raise SpecconvError(
                f"model name {base!r} contains {marker!r}, which llama.cpp reserves for non-model files; "
                "pass --name NAME"
            )
    return base


def repo_file_name(base: str, quant: str, role: Role) -> str:
    """The file name (no folder) of one unsplit GGUF in the repository."""
    if not QUANT_TAG_RE.match(quant):
        raise SpecconvError(f"quant tag {quant!r} is not upper-case letters, digits and '_'")
    check_model_base(base)
    if role is Role.SIDECAR:
        return f"mtp-{base}-{quant}.gguf"
    if role is Role.ASSISTANT:
        # An mtp- name lets llama.cpp's sidecar discovery find it (docs/reference/hub.md §1.3).
        return f"mtp-{base}-assistant-{quant}.gguf"
    if role.is_head:
        return f"{HEAD_PREFIX[role]}{base}-{quant}.gguf"
    return f"{base}-{quant}.gguf"


def head_own_base(text: str) -> str:
    """A draft head's own name without its kind marker, for when no target names it:
    `EAGLE3-LLaMA3.1-Instruct-8B` -> `LLaMA3.1-Instruct-8B`, `Qwen3-8B_eagle3` -> `Qwen3-8B`,
    `Qwen3-4B-DFlash-b16` -> `Qwen3-4B-b16` (the prefix the file name gets says the kind)."""
    return sanitize_base(_HEAD_MARKER_RE.sub("", text))


def shard_name(stem: str, index: int, count: int) -> str:
    """`stem-00001-of-00003.gguf` with a 1-based index, as gguf-py and llama.cpp spell it."""
    return gguf.SHARD_NAME_FORMAT.format(stem, index, count)


def shard_paths(file_name: str, count: int, role: Role) -> list[str]:
    """Repository paths of the shards of `file_name` (`X-Q8_0.gguf`).

    Model shards go in a folder named after the stem (`X-Q8_0/X-Q8_0-00001-of-00002.gguf`), the
    bartowski/unsloth layout; drafts stay at the root so that llama.cpp's sidecar discovery, which
    looks in the model's folder and its ancestors, still finds them.
    """
    stem = file_name.removesuffix(".gguf")
    names = [shard_name(stem, i + 1, count) for i in range(count)]
    if role.is_draft:
        return names
    return [f"{stem}/{name}" for name in names]


# --- what the Hub accepts --------------------------------------------------------------------

_REPO_PART_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_PATH_PART_RE = re.compile(r"^[A-Za-z0-9._+-]+$")
MAX_REPO_NAME = 96


def validate_repo_id(repo_id: str, *, namespace_required: bool = True, what: str = "--repo") -> str:
    """`USER/NAME` with the Hub's rules (no `--` or `..`, no `.git` suffix, at most 96 characters)."""
    parts = repo_id.split("/")
    if len(parts) != 2 and not (len(parts) == 1 and not namespace_required):
        form = "USER/NAME" if namespace_required else "NAME or USER/NAME"
        raise SpecconvError(f"{what} must be {form}, got {repo_id!r}")
    for part in parts:
        if (
            not _REPO_PART_RE.match(part)
            or "--" in part
            or ".." in part
            or part.endswith(".git")
            or len(part) > MAX_REPO_NAME
        ):
            raise SpecconvError(
                f"{what} {repo_id!r} is not a valid Hub repository id (letters, digits, '-', '_', '.'; "
                "no '--' or '..'; not ending in .git; at most 96 characters per part)"
            )
    return repo_id


def validate_repo_path(path: str) -> str:
    """A relative POSIX path inside the repository: no traversal, no `.git`, only safe characters."""
    if not path or path.startswith("/") or "\\" in path or len(path) > 1000:
        raise SpecconvError(f"refusing repository path {path!r}: not a relative POSIX path")
    for part in path.split("/"):
        if part in ("", ".", "..") or part == ".git" or not _PATH_PART_RE.match(part):
            raise SpecconvError(f"refusing repository path {path!r}: bad component {part!r}")
    return path


def validate_revision(revision: str) -> str:
    """A branch name or `refs/pr/N`; no traversal or whitespace."""
    if re.fullmatch(r"refs/pr/\d+", revision):
        return revision
    if (
        not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", revision)
        or ".." in revision
        or revision.endswith((".lock", "/"))
        or "//" in revision
        or len(revision) > 200
    ):
        raise SpecconvError(f"--revision {revision!r} is not a valid branch name")
    return revision


SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """`50G` -> 50_000_000_000. Decimal units, as llama.cpp's gguf-split and the Hub use."""
    match = SIZE_RE.match(str(text))
    if not match:
        raise SpecconvError(f"cannot read size {text!r}: use a number with an optional K, M, G or T suffix")
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise SpecconvError(f"size {text!r} must be positive")
    return value


def human_size(n: int) -> str:
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
