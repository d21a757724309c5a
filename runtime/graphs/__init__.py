"""Per-architecture runtime graphs; each knows GGUF names only.

A graph module exposes: `HParams.from_kv(kv)`, `main_tensors(hp)`, `mtp_tensors(hp)`,
`optional_mtp_tensors(hp)`, `OPTIONAL`, `keep_float32(name)`, `main_layout(hp)`, `mtp_layout(hp)`,
`forward_main(...)` and `forward_mtp(...)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from specconv.archs.errors import SpecconvError

# GGUF arch -> module under specconv.runtime.graphs
GRAPHS: dict[str, str] = {
    "qwen35": "qwen35",
    "qwen35moe": "qwen35",
    "qwen3next": "qwen3next",
    "llama": "llama",
    "eagle3": "eagle3",
    "glm4moe": "glm4moe",
    "deepseek2": "deepseek2",
    "gemma4": "gemma4",
    "gemma4-assistant": "gemma4_assistant",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3",
    "dflash": "dflash",
    "hy_v3": "hy_v3",
    "step35": "step35",
    "mimo2": "mimo2",
    "glm-dsa": "dsa",
    "deepseek32": "dsa",
}


def graph_module(arch: str) -> ModuleType:
    module = GRAPHS.get(arch)
    if module is None:
        raise SpecconvError(f"the runtime has no graph for GGUF arch {arch!r} (supported: {', '.join(sorted(GRAPHS))})")
    return importlib.import_module(f"specconv.runtime.graphs.{module}")
