"""GGUF files of tiny Qwen3.5 checkpoints for the speculative and verify tests, converted once per process.

`specconv convert` when it is registered, else llama.cpp's own converter (SPECCONV_LLAMA_CPP_SRC),
else the test skips. Files: "embedded" (trunk + MTP head), "trunk" (no MTP), "sidecar" (MTP only).
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()
_root: Path | None = None
_files: dict[tuple, Path] = {}
UPSTREAM_ARGS = {"embedded": [], "trunk": ["--no-mtp"], "sidecar": ["--mtp"]}
OUR_MODES = {"embedded": "embed", "trunk": "none", "sidecar": "only"}


def checkpoint(seed: int = 0, **kwargs) -> Path:
    global _root
    from tests.fixtures.tiny_qwen35 import build_qwen35

    key = ("src", seed, tuple(sorted(kwargs.items())))
    with _lock:
        if key not in _files:
            if _root is None:
                _root = Path(tempfile.mkdtemp(prefix="specconv-spec-"))
            _files[key] = build_qwen35(_root / f"src-{len(_files)}", seed=seed, **kwargs)
        return _files[key]


def gguf(kind: str = "embedded", seed: int = 0, outtype: str = "f32", **kwargs) -> Path:
    """Path of a converted GGUF (F32 by default) of the tiny checkpoint (seed, kwargs), kind in UPSTREAM_ARGS."""
    from specconv import cli
    from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream

    src = checkpoint(seed, **kwargs)
    key = (kind, seed, outtype, tuple(sorted(kwargs.items())))
    with _lock:
        if key not in _files:
            name = f"{'mtp-' if kind == 'sidecar' else ''}{kind}-{outtype}-{len(_files)}.gguf"
            out = src.parent / name
            if "convert" in cli.COMMANDS:
                _files[key] = convert_gguf(src, out, outtype=outtype, mtp=OUR_MODES[kind])
            else:
                _files[key] = convert_gguf_upstream(src, out, outtype=outtype, extra_args=UPSTREAM_ARGS[kind])
        return _files[key]
