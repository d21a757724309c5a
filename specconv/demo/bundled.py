"""The tiny trained Qwen3.5 + MTP checkpoint shipped in specconv/data, and prompts from its held-out text.

The model was trained by tools/train_tiny.py on the top-level *.py files of Python's standard library,
with about one file in eight held out (listed in the checkpoint's heldout.json). Acceptance measured
on those files is acceptance on text the model never saw. The files are read from the running
interpreter's stdlib; a missing file is skipped (another Python version may lack a module).
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from specconv.errors import SpecconvError

BUNDLED_NAME = "tiny-qwen35-mtp"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

# Used when no held-out file can be read (a Python installed without its .py sources).
FALLBACK_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n",
    "class Counter:\n    def __init__(self, start=0):\n        self.value = start\n\n    def increment(self):\n",
    "def read_lines(path):\n    with open(path, encoding='utf-8') as f:\n        for line in f:\n",
)


@dataclass(frozen=True)
class Prompt:
    source: str  # "file.py@line" or "builtin #i"
    text: str
    ids: tuple[int, ...]


def bundled_model_dir() -> Path:
    """The checkpoint folder inside the installed package (SpecconvError when it is incomplete)."""
    import specconv

    path = Path(specconv.__file__).resolve().parent / "data" / BUNDLED_NAME
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise SpecconvError(f"the bundled model {path} is incomplete (missing {', '.join(missing)}); "
                            "reinstall specconv or train it with tools/train_tiny.py --out " + str(path))
    return path


def heldout_files(model_dir: Path) -> list[Path]:
    """The held-out stdlib files named in model_dir/heldout.json that exist on this interpreter."""
    listing = model_dir / "heldout.json"
    if not listing.is_file():
        return []
    try:
        names = json.loads(listing.read_text(encoding="utf-8"))["heldout_files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SpecconvError(f"{listing}: not a held-out listing ({exc})") from None
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [lib / name for name in sorted(names) if (lib / name).is_file()]


def _line_start_at(text: str, fraction: float) -> int:
    """The index of the first line start at or after `fraction` of the text (0 if there is none)."""
    at = int(len(text) * fraction)
    if at == 0:
        return 0
    nl = text.find("\n", at - 1)
    return nl + 1 if 0 <= nl < len(text) - 1 else 0


def heldout_prompts(tokenizer, model_dir: Path, count: int, n_tokens: int,
                    fractions: tuple[float, ...] = (0.3, 0.6)) -> list[Prompt]:
    """`count` prompts of `n_tokens` tokens, each starting at a line start `fraction` of the way into a
    held-out file: files in name order, then the next fraction (deterministic). Built-in code prompts
    fill in when the held-out files are unavailable."""
    if count < 1 or n_tokens < 1:
        raise SpecconvError("need at least one prompt of at least one token")
    files = heldout_files(model_dir)
    prompts: list[Prompt] = []
    for fraction in fractions:
        for path in files:
            if len(prompts) == count:
                return prompts
            text = path.read_text(encoding="utf-8", errors="replace")
            start = _line_start_at(text, fraction)
            window = text[start:start + 16 * n_tokens]  # ample: a token covers at most a few characters here
            ids = tokenizer.encode(window)[:n_tokens]
            if len(ids) < n_tokens:
                continue
            line = text.count("\n", 0, start) + 1
            prompts.append(Prompt(f"{path.name}@{line}", tokenizer.decode(ids), tuple(ids)))
    for i, text in enumerate(FALLBACK_PROMPTS * count):
        if len(prompts) == count:
            break
        prompts.append(Prompt(f"builtin #{i % len(FALLBACK_PROMPTS)}", text, tuple(tokenizer.encode(text))))
    return prompts
