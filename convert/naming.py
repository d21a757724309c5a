"""Output file names (docs/reference/gguf-layout.md §4.2).

* `-o DIR/NAME.gguf`: the main file is NAME.gguf; a sidecar written next to it (`--mtp separate`)
  is `DIR/mtp-NAME.gguf`. With `--mtp only` the given name is the sidecar's. `{ftype}`/`{FTYPE}`
  placeholders are filled with the storage type, as llama.cpp's converter does.
* `-o DIR/` (or an existing folder): names follow llama.cpp's naming convention,
  `<Name>-<Size>[-<Finetune>][-<Version>]-<TYPE>.gguf` for the model and `mtp-` + the same name for
  its sidecar (the model's size label, so the pair shares one base and one quant tag: llama.cpp's
  `-hf` sibling rule, docs/reference/hub.md §1.2); split files add `-00001-of-0000N`. The base is
  specconv/hub/naming.py's `scheme_base`, which `specconv upload` names repository files by, so an
  upload keeps these names. The `mtp-` prefix is what llama.cpp's discovery looks for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gguf.metadata import Metadata
from gguf.utility import fill_templated_filename

from specconv.archs.errors import SpecconvError
from specconv.hub.naming import scheme_base

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
        base = scheme_base(meta.name, meta.basename, model_size_label, meta.finetune, meta.version) or "ggml-model"
        stem = f"{base}-{type_label.upper()}"
        model, sidecar = folder / f"{stem}.gguf", folder / f"{MTP_PREFIX}{stem}.gguf"
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
