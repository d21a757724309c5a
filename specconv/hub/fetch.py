"""Models from the Hugging Face Hub by id: which files to fetch, and fetching them into the cache.

* `OWNER/NAME[@REVISION]`, a transformers checkpoint for `convert`: config, tokenizer files, the
  model card and the safetensors weights (those named by `model.safetensors.index.json` when there
  is one), nothing else.
* `OWNER/NAME[@REVISION][:QUANT]`, a GGUF repository for the commands that read GGUF files: the
  model file chosen by its quant tag, all shards of a split one, and on request the `mtp-`,
  `eagle3-` or `dflash-` file next to it, chosen as llama.cpp's `-hf` chooses them
  (docs/reference/hub.md §1.2).

The revision is resolved to one commit first and every file is taken from that commit. Files go
through huggingface_hub into its usual cache (or `local_dir`): HF_ENDPOINT and HF_TOKEN are honoured,
a file already there is not fetched again, and a dropped connection resumes where it stopped.
With HF_HUB_OFFLINE=1, or when the Hub cannot be reached, the same choice is made among the files
of the cached snapshot, and what is missing is named in a one-line error.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi, RepoFile, cached_assets_path, constants, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name

from specconv.errors import SpecconvError
from specconv.hub.client import _server_message, _status, _version, is_transient, resolve_endpoint
from specconv.hub.naming import NON_MODEL_MARKERS, validate_repo_id

INDEX_NAME = "model.safetensors.index.json"  # as convert/checkpoint.py reads it

# What `convert` reads besides the weights: config, tokenizer (gguf-py's vocabulary readers), chat
# templates, and the model card and generation config that the GGUF's general.* keys come from.
CHECKPOINT_SIDE_FILES = ("config.json", "generation_config.json", "README.md", "tokenizer*", "special_tokens_map.json",
                         "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
                         "chat_template.json", "chat_template.jinja", "additional_chat_templates/*.jinja")

# --spec drafter -> the name part llama.cpp's sibling discovery looks for (docs/reference/hub.md §1.2 rule 4)
DRAFT_KEYWORDS = {"mtp": "mtp-", "eagle3": "eagle3-", "dflash": "dflash-"}

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's preference without a tag, then the first model file
DOWNLOAD_WORKERS = 4

_QUANT_RE = re.compile(r"^[A-Za-z0-9_]+$")
_SPLIT_RE = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG_RE = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


# --- ids -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubRef:
    """A repository on the Hub, at a revision (default branch when None), with an optional quant tag."""

    repo_id: str
    revision: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")


def parse_ref(text: str, *, quant: bool) -> HubRef:
    """`OWNER/NAME[@REVISION]`, and with `quant` also `[:QUANT]` at the end."""
    rest, tag = text, None
    if quant and ":" in text:
        rest, tag = text.rsplit(":", 1)
        if not _QUANT_RE.match(tag):
            raise SpecconvError(f"{text!r}: the quant tag after ':' is letters, digits and '_' (e.g. Q4_K_M)")
    repo_id, at, revision = rest.partition("@")
    form = "OWNER/NAME[@REVISION]" + ("[:QUANT]" if quant else "")
    if repo_id.count("/") != 1:
        raise SpecconvError(f"{text!r} is not a Hub id ({form})")
    validate_repo_id(repo_id, what="Hub id")
    if at and (not revision or re.search(r"\s|\.\.", revision)):
        raise SpecconvError(f"{text!r}: give a branch, tag or commit after '@' ({form})")
    return HubRef(repo_id, revision or None, tag)


def looks_like_hub_id(text: str) -> bool:
    """`OWNER/NAME[@REVISION]` by the Hub's naming rules (a local path that exists is never asked)."""
    try:
        parse_ref(text, quant=False)
    except SpecconvError:
        return False
    return True


# --- which files: a checkpoint -----------------------------------------------------------------


def checkpoint_side_files(paths) -> list[str]:
    """Config, tokenizer, chat template and model card files among the repository's paths."""
    return sorted(p for p in paths if any(fnmatch.fnmatchcase(p, pat) for pat in CHECKPOINT_SIDE_FILES)
                  and (p.count("/") == 0 or p.startswith("additional_chat_templates/")))


def weight_files(paths, index: dict | None) -> list[str]:
    """The safetensors files convert reads (convert/checkpoint.py's rule): those the index names, else
    `model*.safetensors` at the root, else every root `*.safetensors`."""
    if index is not None:
        return sorted(set(index.get("weight_map", {}).values()))
    root = sorted(p for p in paths if "/" not in p and p.endswith(".safetensors"))
    return [p for p in root if p.startswith("model")] or root


# --- which files: a GGUF repository (llama.cpp's rules, docs/reference/hub.md §1.2) -------------


@dataclass(frozen=True)
class GgufName:
    prefix: str  # the path without .gguf and the shard suffix (quant tag included)
    tag: str  # the quant tag, upper case ("" when there is none)
    index: int  # shard number, 1 for an unsplit file
    count: int


def gguf_name(path: str) -> GgufName | None:
    if not path.endswith(".gguf"):
        return None
    prefix, index, count = path[: -len(".gguf")], 1, 1
    if m := _SPLIT_RE.match(prefix):
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    tag = m.group(1).upper() if (m := _TAG_RE.search(prefix)) else ""
    return GgufName(prefix, tag, index, count)


def is_model_file(path: str) -> bool:
    """A .gguf whose file name carries none of the markers of sidecars, projectors and matrices."""
    return path.endswith(".gguf") and not any(k in path.rsplit("/", 1)[-1] for k in NON_MODEL_MARKERS)


def _bits(tag: str) -> int:
    """The first number of a quant tag: Q4_K_M -> 4, BF16 -> 16, no number -> 0."""
    m = re.search(r"\d+", tag)
    return int(m.group()) if m else 0


def pick_model(paths, quant: str | None) -> str | None:
    """The model file for `quant` (case-insensitive `QUANT[.-]` anywhere in the path), or without one
    Q4_K_M, then Q8_0, then the first model file; of a split model only its first shard."""
    candidates = [p for p in sorted(paths) if is_model_file(p) and gguf_name(p).index == 1]
    for tag in [quant] if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + "[.-]", re.IGNORECASE)
        for p in candidates:
            if pattern.search(p):
                return p
    return candidates[0] if candidates and not quant else None


def split_set(paths, first: str) -> list[str]:
    """Every shard of the model whose first shard (or only file) is `first`, in order."""
    name = gguf_name(first)
    if name.count <= 1:
        return [first]
    return sorted(p for p in paths if (n := gguf_name(p)) is not None and n.count == name.count
                  and n.prefix == name.prefix)


def pick_sibling(paths, model: str, keyword: str, quant: str | None) -> str | None:
    """The file containing `keyword` (`mtp-`, ...) in the model's folder or one above it: the deepest
    folder first, then an exact `-QUANT.` match, then the closest bit count."""
    want = quant.upper() if quant else ""
    model_bits = _bits(want) if want else _bits(gguf_name(model).tag)
    model_dirs = model.split("/")[:-1]
    best, best_key = None, None
    for p in sorted(paths):
        name = gguf_name(p)
        if name is None or keyword not in p or name.index != 1:
            continue
        dirs = p.split("/")[:-1]
        if dirs != model_dirs[: len(dirs)]:
            continue
        exact = bool(want) and f"-{want}." in p.upper()
        key = (len(dirs), exact, -abs(_bits(name.tag) - model_bits))
        if best_key is None or key > best_key:
            best, best_key = p, key
    return best


# --- the repository at one commit --------------------------------------------------------------


class DownloadEvents:
    """Progress callbacks for downloads; the CLI draws progress bars from them. All optional no-ops."""

    def start(self, source: str, todo: list[tuple[str, int | None]]) -> None: ...
    def advance(self, path: str, n: int) -> None: ...
    def finish(self, path: str) -> None: ...
    def summary(self, source: str, fetched: int, cached: int, folder: Path) -> None: ...
    def notice(self, text: str) -> None: ...


def _progress_class(path: str, events: DownloadEvents):
    """A class with the part of tqdm's interface huggingface_hub's downloaders call (plain HTTP and Xet),
    reporting the bytes written for `path` to `events`."""

    class FileProgress:
        total = None
        n = 0

        def __init__(self, *args, initial: int = 0, **kwargs):
            self.n = initial
            if initial:
                events.advance(path, initial)

        def update(self, n=1) -> None:
            self.n += n or 0
            events.advance(path, int(n or 0))

        def update_transfer(self, n=1) -> None:  # network bytes of a Xet download: the bytes written count
            pass

        def set_postfix_str(self, *args, **kwargs) -> None: ...
        def set_transfer_postfix_str(self, *args, **kwargs) -> None: ...
        def set_description(self, *args, **kwargs) -> None: ...
        def refresh(self, *args, **kwargs) -> None: ...
        def close(self) -> None: ...

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None: ...

    return FileProgress


def _more(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def hub_error(exc: BaseException, ref: HubRef, action: str) -> SpecconvError:
    """One line naming the cause and what to do."""
    where = ref.repo_id
    if isinstance(exc, GatedRepoError):
        return SpecconvError(f"{where} is gated: accept its conditions on the Hub, then set HF_TOKEN or run "
                             "`hf auth login`")
    if isinstance(exc, RevisionNotFoundError):
        return SpecconvError(f"{where} has no revision {ref.revision!r} (a branch, tag or commit)")
    if isinstance(exc, RepositoryNotFoundError):
        return SpecconvError(f"{where}: no such repository on the Hub, or it is private and no token with access "
                             "was sent (set HF_TOKEN or run `hf auth login`)")
    if isinstance(exc, RemoteEntryNotFoundError):
        return SpecconvError(f"{where}: a listed file is missing from the Hub while {action} ({_server_message(exc)})")
    status = _status(exc)
    if status == 401:
        return SpecconvError(f"the Hub rejected the token (401 Unauthorized) while {action}: set a valid HF_TOKEN "
                             "or run `hf auth login`")
    if is_transient(exc) or (isinstance(exc, OSError) and status is None):
        return SpecconvError(f"{action} failed ({_server_message(exc)}); rerun the same command to resume (complete "
                             "files are kept)")
    if status is not None:
        return SpecconvError(f"the Hub refused {action} (HTTP {status}: {_server_message(exc)})")
    return SpecconvError(f"{action} failed: {type(exc).__name__}: {_server_message(exc)}")


@dataclass
class HubRepo:
    """The files of `ref` at one commit: listed on the Hub, or, offline, those of the cached snapshot
    (or of `local_dir`); `get` brings files into `folder`."""

    ref: HubRef
    local_dir: Path | None = None
    events: DownloadEvents = field(default_factory=DownloadEvents)
    commit: str | None = field(init=False, default=None)
    files: dict[str, int | None] = field(init=False, default_factory=dict)  # repository path -> size
    offline_reason: str | None = field(init=False, default=None)  # why only the cache is read

    def __post_init__(self):
        self.api = HfApi(endpoint=resolve_endpoint(), library_name="specconv", library_version=_version())
        if constants.HF_HUB_OFFLINE:
            self._read_cache("HF_HUB_OFFLINE is set")
            return
        try:
            self.api.repo_info(self.ref.repo_id, revision=self.ref.revision)  # is the Hub there? (one back-off)
            # the commit, recorded in the cache's refs/ for offline use by the revision's name
            self.commit = str(self.api.resolve_revision(self.ref.repo_id, revision=self.ref.revision).resolved)
            tree = self.api.list_repo_tree(self.ref.repo_id, revision=self.commit, recursive=True)
            self.files = {f.path: f.size for f in tree if isinstance(f, RepoFile)}
        except Exception as exc:  # noqa: BLE001 - classified: the cache answers when the Hub cannot
            if not is_transient(exc):
                raise hub_error(exc, self.ref, f"listing {self.ref.repo_id}") from exc
            self._read_cache(f"the Hub cannot be reached ({_server_message(exc)[:120]})")
            self.events.notice(f"{self.offline_reason}: reading the cached snapshot of {self.label}")

    # -- where files are --------------------------------------------------------------------------

    @property
    def storage(self) -> Path:
        return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=self.ref.repo_id, repo_type="model")

    @property
    def folder(self) -> Path:
        return self.local_dir if self.local_dir is not None else self.storage / "snapshots" / self.commit

    @property
    def label(self) -> str:
        return f"{self.ref.repo_id}@{self.commit[:7]}" if self.commit else self.ref.repo_id

    @staticmethod
    def _remedy() -> str:
        return "unset HF_HUB_OFFLINE to download" if constants.HF_HUB_OFFLINE else "retry when the Hub is reachable"

    def _read_cache(self, reason: str) -> None:
        self.offline_reason = reason
        if self.local_dir is None:
            revision = self.ref.revision or "main"
            ref_file = self.storage / "refs" / revision
            commit = revision if _COMMIT_RE.match(revision) else (
                ref_file.read_text().strip() if ref_file.is_file() else None)
            if commit is None or not (self.storage / "snapshots" / commit).is_dir():
                raise SpecconvError(f"{reason} and {self.ref.repo_id}@{revision} is not in the cache "
                                    f"({self.storage}): {self._remedy()} it")
            self.commit = commit
        elif not self.local_dir.is_dir():
            raise SpecconvError(f"{reason} and --local-dir {self.local_dir} does not exist: {self._remedy()} into it")
        self.files = {p.relative_to(self.folder).as_posix(): p.stat().st_size for p in self.folder.rglob("*")
                      if p.is_file() and ".cache" not in p.relative_to(self.folder).parts}

    def missing_error(self, what: str) -> SpecconvError:
        """`what` could not be found among the cached files."""
        where = f"--local-dir {self.local_dir}" if self.local_dir is not None else f"the cache of {self.label}"
        return SpecconvError(f"{self.offline_reason} and {where} lacks {what}: {self._remedy()}")

    # -- fetching ---------------------------------------------------------------------------------

    def get(self, paths: list[str], *, last: bool = True) -> None:
        """Bring `paths` into `folder` (from the cache, online; a check that they are there, offline);
        `last`: the final fetch of this repository (its summary is reported)."""
        paths = list(dict.fromkeys(paths))
        if self.offline_reason is not None:
            missing = [p for p in paths if not (self.folder / p).is_file()]
            if missing:
                raise self.missing_error(_more(missing))
            return
        if self.local_dir is None:
            todo = [p for p in paths if not isinstance(
                try_to_load_from_cache(self.ref.repo_id, p, revision=self.commit), str)]
        else:
            todo = paths
        self.events.start(self.label, [(p, self.files.get(p)) for p in todo])

        def one(path: str) -> None:
            hf_hub_download(self.ref.repo_id, path, revision=self.commit, local_dir=self.local_dir,
                            endpoint=resolve_endpoint(), library_name="specconv", library_version=_version(),
                            tqdm_class=_progress_class(path, self.events))
            self.events.finish(path)

        try:
            with ThreadPoolExecutor(max_workers=max(1, min(DOWNLOAD_WORKERS, len(todo)))) as pool:
                for future in [pool.submit(one, p) for p in todo]:
                    future.result()
        except Exception as exc:  # noqa: BLE001 - one line for the user
            raise hub_error(exc, self.ref, f"downloading from {self.label}") from exc
        if last:
            self.events.summary(self.label, len(todo), len(paths) - len(todo), self.folder)

    def read_json(self, path: str) -> dict:
        self.get([path], last=False)
        try:
            return json.loads((self.folder / path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SpecconvError(f"{self.label}: {path} cannot be read: {exc}") from None


# --- what the commands call --------------------------------------------------------------------


def fetch_checkpoint(ref: HubRef, *, local_dir: Path | None = None, events: DownloadEvents | None = None) -> Path:
    """The checkpoint folder of `ref` with its config, tokenizer files and safetensors weights in it.

    Without `local_dir` the folder is a link named after the repository to the cached snapshot, so
    that the name convert derives from the folder (as for a `hf download --local-dir NAME`) is the
    model's, not the commit's."""
    repo = HubRepo(ref, local_dir, events or DownloadEvents())
    if "config.json" not in repo.files:
        if repo.offline_reason is not None:
            raise repo.missing_error("config.json")
        ggufs = [p for p in repo.files if p.endswith(".gguf")]
        hint = f" (it holds GGUF files: read them with -hf {ref.repo_id})" if ggufs else ""
        raise SpecconvError(f"{repo.label} has no config.json at its root: not a transformers checkpoint{hint}")
    index = repo.read_json(INDEX_NAME) if INDEX_NAME in repo.files else None
    weights = weight_files(repo.files, index)
    if not weights:
        if repo.offline_reason is not None:
            raise repo.missing_error("its safetensors weights")
        pickles = sorted(p for p in repo.files if p.endswith((".bin", ".pt", ".pth")))
        hint = f" ({pickles[0]} is a pickle, which specconv never loads)" if pickles else ""
        raise SpecconvError(f"{repo.label} has no safetensors weights{hint}")
    repo.get(checkpoint_side_files(repo.files) + weights)
    return repo.folder if local_dir is not None else _named_view(repo)


def _named_view(repo: HubRepo) -> Path:
    """`<assets>/specconv/<owner>--<name>/<commit>/<name>`: a link to the snapshot folder."""
    view = cached_assets_path(library_name="specconv", namespace=repo.ref.repo_id.replace("/", "--"),
                              subfolder=repo.commit) / repo.ref.repo_id.split("/")[1]
    target = repo.folder.resolve()
    if view.is_symlink() and Path(os.readlink(view)) != target:
        view.unlink()
    if not view.is_symlink():
        try:
            view.symlink_to(target, target_is_directory=True)
        except OSError:  # no symbolic links here: the snapshot folder itself (named by the commit)
            return repo.folder
    return view


@dataclass(frozen=True)
class FetchedGguf:
    model: Path  # the model file, or the first shard of a split one
    draft: Path | None  # the mtp- / eagle3- / dflash- sibling asked for, when there is one
    source: str  # OWNER/NAME@commit


def fetch_gguf(ref: HubRef, *, draft: str | None = None, local_dir: Path | None = None,
               events: DownloadEvents | None = None) -> FetchedGguf:
    """The model file for `ref`'s quant tag (every shard of it) and, with `draft` (mtp, eagle3, dflash),
    its sibling draft file; an `mtp-` sibling is optional (the model may carry its MTP head: a notice
    says that there is none)."""
    events = events or DownloadEvents()
    repo = HubRepo(ref, local_dir, events)
    ggufs = sorted(p for p in repo.files if p.endswith(".gguf"))
    primary = pick_model(ggufs, ref.quant)
    if primary is None:
        wanted = f"model file with quant tag {ref.quant}" if ref.quant else "GGUF model file"
        tags = sorted({gguf_name(p).tag or p for p in ggufs if is_model_file(p)})
        if repo.offline_reason is not None:
            raise repo.missing_error(f"a {wanted}" + (f" (cached: {', '.join(tags)})" if tags else ""))
        raise SpecconvError(f"{repo.label} has no {wanted}" + (f"; its quant tags: {', '.join(tags)}" if tags else ""))
    files = split_set(ggufs, primary)
    _check_shards(repo, primary, files)
    sibling = None
    if draft is not None:
        sibling = pick_sibling(ggufs, primary, DRAFT_KEYWORDS[draft], ref.quant)
        if sibling is None:
            what = f"{DRAFT_KEYWORDS[draft]} file next to {primary}"
            if draft != "mtp":
                if repo.offline_reason is not None:
                    raise repo.missing_error(f"a {what}")
                raise SpecconvError(f"{repo.label} has no {what} (for --spec {draft}): pass a draft file with --draft")
            events.notice(f"{repo.label if repo.offline_reason is None else f'the cache of {repo.label}'} holds "
                          f"no {what}")
        else:
            shards = split_set(ggufs, sibling)
            _check_shards(repo, sibling, shards)
            files += shards
    repo.get(files)
    return FetchedGguf(repo.folder / primary, repo.folder / sibling if sibling else None, repo.label)


def _check_shards(repo: HubRepo, first: str, shards: list[str]) -> None:
    count = gguf_name(first).count
    if len(shards) == count:
        return
    prefix = gguf_name(first).prefix
    absent = [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    absent = [p for p in absent if p not in shards]
    if repo.offline_reason is not None:
        raise repo.missing_error(_more(absent))
    raise SpecconvError(f"{repo.label} lists {len(shards)} of the {count} shards of {first}: {_more(absent)} missing")
