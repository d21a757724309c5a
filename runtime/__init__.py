"""The PyTorch reference runtime: loads GGUF files by graph type and decodes with rollback-able memory.

The names below load on first use, so that `specconv.runtime.gguf_reader` (the project's GGUF
reader, which the numpy-only converter and the hub pipeline use too) can be imported without torch.
"""

from importlib import import_module

_EXPORTS = {
    "Context": "specconv.runtime.context", "Model": "specconv.runtime.model",
    "load_model": "specconv.runtime.model", "DecodeOutput": "specconv.runtime.types",
    "GraphType": "specconv.runtime.types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specconv.runtime' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
