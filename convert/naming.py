"""Output file names (docs/reference/gguf-layout.md §4.2).

* `-o DIR/NAME.gguf`: the main file is NAME.gguf; a sidecar written next to it (`--mtp separate`)
  is `DIR/mtp-NAME.gguf`. With `--mtp only` the given name is the sidecar's. `{ftype}`/`{FTYPE}`
  placeholders are filled with the storage type, as llama.cpp's converter does.
* `-o DIR/` (or an existing folder): names follow the GGUF naming convention like llama.cpp's
  converter: `Name[-Size]-Finetune-Version-TYPE.gguf` for the model, and `mtp-` + the same without
  the size label for the sidecar. The `mtp-` prefix is what llama.cpp's discovery looks for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gguf.metadata import Metadata
from gguf.utility import fill_templated_filename, naming_convention

from specconv.archs.errors import SpecconvError

MTP_PREFIX = "mtp-"


def is_directory_target(out: str | os.PathLike) -> bool:
    text = os.fspath(out)
    return text.endswith(("/", os.sep)) or Path(text).is_dir()


@dataclass(frozen=True)
class OutputNames:
    model: Path | None  # embedded or trunk-only file
    sidecar: Path | None  # the mtp- file


def output_names(out: str | os.PathLike, *, want_model: bool, want_sidecar: bool, meta: Metadata,
                 type_label: str, model_size_label: str | None) -> OutputNames:
    """Paths of the files a run writes (before splitting into shards)."""
    if is_directory_target(out):
        folder = Path(out)
        common = (meta.name, meta.basename, meta.finetune, meta.version)
        model = folder / f"{naming_convention(*common, model_size_label, type_label)}.gguf"
        sidecar = folder / f"{MTP_PREFIX}{naming_convention(*common, None, type_label)}.gguf"
    else:
        given = Path(out)
        try:
            given = given.with_name(fill_templated_filename(given.name, type_label))
        except (KeyError, IndexError, ValueError):
            raise SpecconvError(f"-o {out}: bad {{...}} placeholder in the file name (use {{ftype}} or {{FTYPE}})") from None
        if given.suffix != ".gguf":
            raise SpecconvError(f"-o {out}: give a file name ending in .gguf, or a folder ending in /")
        model = given
        sidecar = given if not want_model else given.with_name(MTP_PREFIX + given.name)
    return OutputNames(model if want_model else None, sidecar if want_sidecar else None)
