"""Models by Hub id on the command line: the `-hf USER/REPO[:QUANT]` option of the commands that read
GGUF files, the folder-or-id source of `convert`, and progress bars for the downloads
(specconv/hub/fetch.py does the choosing and fetching; docs/hub.md)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from specconv.errors import SpecconvError

HF_REPO_METAVAR = "USER/REPO[:QUANT]"
HF_REPO_HELP = ("Take the GGUF from a Hub repository instead of a file, as llama.cpp's -hf does: the model file "
                "whose name carries QUANT (any case; without it Q4_K_M, then Q8_0, then the first), with every "
                "shard of a split one. USER/REPO@REVISION pins a branch, tag or commit. Files are kept in the "
                "huggingface_hub cache (HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE are honoured; docs/hub.md).")
SIBLING_SPECS = ("mtp", "eagle3", "dflash")  # drafters a GGUF repository holds next to the model: fetch.DRAFT_KEYWORDS
SPEC_HELP = (" With --spec mtp, eagle3 or dflash the mtp-, eagle3- or dflash- file next to the model file is "
             "fetched too and used as the drafter (the model's own MTP head when there is no mtp- file).")


def hf_repo_option(extra_help: str = ""):
    return click.option("-hf", "--hf-repo", "hf_repo", metavar=HF_REPO_METAVAR, default=None,
                        help=HF_REPO_HELP + extra_help)


class RichDownload:
    """Download events (specconv/hub/fetch.py: DownloadEvents) drawn as one bar per file being
    downloaded (on stderr, gone when done), then one summary line."""

    def __init__(self):
        self.console = Console(stderr=True)
        self.progress: Progress | None = None
        self.tasks: dict[str, int] = {}

    def start(self, source: str, todo: list[tuple[str, int | None]]) -> None:
        self.stop()  # a checkpoint's index is fetched before its other files
        if not todo:
            return
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=False),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=self.console, transient=True)
        self.progress.start()
        for path, size in todo:
            self.tasks[path] = self.progress.add_task(escape(path), total=size)

    def advance(self, path: str, n: int) -> None:
        self.progress.advance(self.tasks[path], n)

    def finish(self, path: str) -> None:
        task = next(t for t in self.progress.tasks if t.id == self.tasks[path])
        self.progress.update(task.id, completed=task.total if task.total is not None else task.completed)

    def summary(self, source: str, fetched: int, cached: int, folder: Path) -> None:
        self.stop()
        if fetched:
            self.console.print(f"[dim]{escape(source)}: {fetched} file(s) downloaded, {cached} already there → "
                               f"{escape(str(folder))}[/dim]", highlight=False, soft_wrap=True)

    def notice(self, text: str) -> None:
        self.console.print(f"[yellow]note:[/] {escape(text)}", highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def gguf_input(path, hf_repo: str | None, *, what: str = "MODEL.gguf", spec: str | None = None, mtp=None,
               draft=None):
    """(model file, MTP file, draft file) from MODEL.gguf or from `-hf`. With `-hf` and a `spec` drafter
    (mtp, eagle3, dflash) that no --mtp / --draft file gives, the model file's sibling drafter is fetched
    and returned as the MTP file (mtp) or the draft file."""
    if (path is None) == (hf_repo is None):
        raise click.UsageError(f"give {what} or -hf {HF_REPO_METAVAR}" + (", not both" if path is not None else ""))
    if hf_repo is None:
        return Path(path), mtp, draft
    from specconv.hub.fetch import DRAFT_KEYWORDS, parse_ref  # huggingface_hub: only for a Hub id

    sibling = spec if spec in DRAFT_KEYWORDS and mtp is None and draft is None else None
    got = _fetch_gguf(parse_ref(hf_repo, quant=True), sibling)
    if got.draft is None:
        return got.model, mtp, draft
    return (got.model, got.draft, None) if sibling == "mtp" else (got.model, None, got.draft)


def upload_inputs(inputs: tuple, hf_repo: str | None, local_dir: Path | None) -> tuple:
    """The files `upload` publishes: INPUTS, or with -hf the model file of USER/REPO[:QUANT] (all its shards)
    and its mtp- file when there is one, fetched into a folder of their own so that they keep their names
    (`local_dir`, by default one under huggingface_hub's assets cache)."""
    from huggingface_hub import cached_assets_path

    from specconv.hub.fetch import parse_ref

    if (not inputs) == (hf_repo is None):
        raise click.UsageError(f"give DIR | FILE.gguf... or -hf {HF_REPO_METAVAR}" + (", not both" if inputs else ""))
    if hf_repo is None:
        if local_dir is not None:
            raise click.UsageError("--local-dir is for -hf")
        return inputs
    ref = parse_ref(hf_repo, quant=True)
    folder = local_dir or cached_assets_path(library_name="specconv", namespace=ref.repo_id.replace("/", "--"),
                                             subfolder="files")
    got = _fetch_gguf(ref, "mtp", Path(folder))
    return tuple(p for p in (got.model, got.draft) if p is not None)


def _fetch_gguf(ref, draft: str | None, local_dir: Path | None = None):
    from specconv.hub.fetch import fetch_gguf

    events = RichDownload()
    try:
        return fetch_gguf(ref, draft=draft, local_dir=local_dir, events=events)
    finally:
        events.stop()


def checkpoint_input(src, local_dir: Path | None = None) -> Path:
    """A checkpoint folder: SRC itself when it exists (a local folder keeps priority), else SRC read as
    the Hub id OWNER/NAME[@REVISION] and fetched (into `local_dir` when given)."""
    text = str(src)
    local = Path(text).exists()
    if not local:  # huggingface_hub only for what may be a Hub id
        from specconv.hub.fetch import fetch_checkpoint, looks_like_hub_id, parse_ref
    if local or not looks_like_hub_id(text):
        if local_dir is not None:
            raise click.UsageError("--local-dir is for a Hub id (OWNER/NAME[@REVISION]) as the source")
        if not local:
            raise SpecconvError(f"{text}: no such checkpoint folder, and not a Hub id (OWNER/NAME[@REVISION])")
        if not Path(text).is_dir():
            raise SpecconvError(f"{text} is a file, not a checkpoint folder")
        return Path(text)
    events = RichDownload()
    try:
        return fetch_checkpoint(parse_ref(text, quant=False), local_dir=local_dir, events=events)
    finally:
        events.stop()
