"""Per-architecture runtime graphs; each knows GGUF names only.

A graph module declares itself with `GRAPH = Graph(...)` (runtime/graphs/contract.py: its
hyperparameters, tensor lists, layouts, forwards and capabilities, each optional one with its
default); `graph_for(arch)` returns that declaration, and the runtime reads nothing else of a graph.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs.contract import Graph

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
    """The module of a GGUF arch's graph (its helpers; the runtime uses `graph_for`)."""
    module = GRAPHS.get(arch)
    if module is None:
        raise SpecconvError(f"the runtime has no graph for GGUF arch {arch!r} (supported: {', '.join(sorted(GRAPHS))})")
    return importlib.import_module(f"specconv.runtime.graphs.{module}")


def graph_for(arch: str) -> Graph:
    """The declared graph of a GGUF arch; a module without a `GRAPH = Graph(...)` is an error."""
    module = graph_module(arch)
    graph = vars(module).get("GRAPH")
    if not isinstance(graph, Graph):
        raise SpecconvError(f"graph module {module.__name__} declares no GRAPH = Graph(...) "
                            "(runtime/graphs/contract.py)")
    return graph
