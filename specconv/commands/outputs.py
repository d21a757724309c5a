"""Where a command writes: the folder of an output must exist, so that a mistyped path fails instead of
growing folders (llama.cpp's converter and quantize tool, and `hf download` without `--local-dir`, do
not create folders either). `--mkdir` creates the missing folders; a folder target written with a
trailing slash (`-o out/`) names the folder to write into and is created when its parent exists. The
writer creates them only when the run starts writing, and removes them again when it fails
(convert/writer.py), so a failed run leaves no empty folder either."""

from __future__ import annotations

from pathlib import Path

from specconv.errors import SpecconvError

MKDIR_HELP = "Create the output folder, and any missing folder above it, when it does not exist."


def check_output_folder(folder, *, mkdir: bool, option: str, named_folder: bool = False) -> None:
    """Refuse an output folder that does not exist (unless `mkdir`), or that is not a folder.
    `named_folder`: the user named this folder itself (`-o DIR/`): it may be new if its parent exists."""
    folder = Path(folder)
    if folder.is_dir():
        return
    if folder.exists():
        raise SpecconvError(f"{option} {folder}: {folder} is a file, not a folder")
    if mkdir or (named_folder and folder.parent.is_dir()):
        return
    missing = folder
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    raise SpecconvError(f"{option}: the folder {missing} does not exist (create it, or pass --mkdir)")
