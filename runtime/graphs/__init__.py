"""Per-architecture runtime graphs; each knows GGUF names only.

A graph module declares itself with `GRAPH = Graph(archs=(...), ...)` (runtime/graphs/contract.py:
the GGUF arches it runs, its hyperparameters, tensor lists, layouts, forwards and capabilities, each
optional one with its default). `graph_for(arch)` finds the module of this package whose GRAPH
declares `arch` (every module is imported once, on the first lookup), and the runtime reads nothing
else of a graph. A graph module outside the package joins with `register_module(module)`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType

from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs.contract import Graph

_REGISTERED: dict[str, ModuleType] = {}  # graph modules from outside the package (register_module)


def declared_graph(module: ModuleType) -> Graph | None:
    """The module's `GRAPH = Graph(...)`, or None for a helper module (ops, decoder, chained, ...)."""
    graph = vars(module).get("GRAPH")
    return graph if isinstance(graph, Graph) else None


def _index(modules, into: dict[str, ModuleType]) -> dict[str, ModuleType]:
    for module in modules:
        graph = declared_graph(module)
        for arch in graph.archs if graph is not None else ():
            if arch in into and into[arch] is not module:
                raise SpecconvError(f"GGUF arch {arch!r} is declared by two graphs: "
                                    f"{into[arch].__name__} and {module.__name__}")
            into[arch] = module
    return into


@functools.cache
def _package_graphs() -> dict[str, ModuleType]:
    """GGUF arch -> graph module, for every module of this package that declares a GRAPH."""
    modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)]
    return _index(modules, {})


def _graphs() -> dict[str, ModuleType]:
    return _index(_REGISTERED.values(), dict(_package_graphs()))


def register_module(module: ModuleType) -> Graph:
    """Make a graph module from outside the package (a family kept in its own files) known to
    `graph_for`; a module without a GRAPH, or one that declares an arch another graph runs, is refused."""
    graph = declared_graph(module)
    if graph is None:
        raise SpecconvError(f"graph module {module.__name__} declares no GRAPH = Graph(...) "
                            "(runtime/graphs/contract.py)")
    _index([module], _graphs())  # raises on an arch declared twice
    for arch in graph.archs:
        _REGISTERED[arch] = module
    return graph


def unregister_module(module: ModuleType) -> None:
    """Forget a module given to `register_module` (a test's temporary family)."""
    for arch in [a for a, m in _REGISTERED.items() if m is module]:
        del _REGISTERED[arch]


def supported_archs() -> list[str]:
    """Every GGUF arch some graph runs, sorted."""
    return sorted(_graphs())


def graph_module(arch: str) -> ModuleType:
    """The module of a GGUF arch's graph (its helpers; the runtime uses `graph_for`)."""
    module = _graphs().get(arch)
    if module is None:
        raise SpecconvError(f"the runtime has no graph for GGUF arch {arch!r} "
                            f"(supported: {', '.join(supported_archs())})")
    return module


def graph_for(arch: str) -> Graph:
    """The declared graph of a GGUF arch."""
    return declared_graph(graph_module(arch))


def kind_of(arch: str) -> str | None:
    """The drafter kind of a GGUF arch's files (Graph.KIND: "eagle3", "dflash", "assistant"); None for a
    model's own arch and for an arch without a graph."""
    module = _graphs().get(arch)
    return declared_graph(module).KIND if module is not None else None
