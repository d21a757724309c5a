"""Architecture plugins and their registry (keyed by Hugging Face `architectures` strings).

A plugin module registers its classes with `@register`; every module of this package is imported
on the first lookup, so a new family's plugin module is found without a list to edit (a module that
registers nothing, such as a shared helper, is imported all the same).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Mapping

from .base import ArchPlugin, Checkpoint, MetaKV, MtpMode, Role, SourceTensor, TensorPlan
from .config_reader import ConfigReader
from .errors import SpecconvError

_REGISTRY: dict[str, type[ArchPlugin]] = {}


def register(cls: type[ArchPlugin]) -> type[ArchPlugin]:
    """Class decorator: make a plugin available for each HF architecture string it accepts.

    A class that is not a complete ArchPlugin (archs/base.py) is refused here, where it is declared."""
    check_plugin(cls)
    for arch in cls.hf_architectures:
        if arch in _REGISTRY and _REGISTRY[arch] is not cls:
            raise ValueError(f"architecture {arch} registered twice")
        _REGISTRY[arch] = cls
    return cls


def check_plugin(cls: type) -> None:
    """Raise a SpecconvError naming what `cls` lacks of the ArchPlugin contract."""
    if not (isinstance(cls, type) and issubclass(cls, ArchPlugin)):
        raise SpecconvError(f"plugin {cls!r} does not subclass ArchPlugin (archs/base.py)")
    lacking = sorted(cls.__abstractmethods__)
    if not cls.hf_architectures:
        lacking.insert(0, "hf_architectures")
    if not cls.gguf_arch:
        lacking.insert(0, "gguf_arch")
    if not cls.family:
        lacking.insert(0, "family")
    if lacking:
        raise SpecconvError(f"plugin {cls.__name__} does not declare {', '.join(lacking)} "
                            "(the ArchPlugin contract: archs/base.py)")


@functools.cache
def _load_builtin_plugins() -> None:
    """Import every module of the package once: importing a plugin module registers its classes."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def supported_architectures() -> list[str]:
    _load_builtin_plugins()
    return sorted(_REGISTRY)


def plugin_class_for_family(family: str) -> type[ArchPlugin]:
    """The registered plugin class of a family (e.g. "eagle3"), for plugins that hand a config on."""
    _load_builtin_plugins()
    for cls in _REGISTRY.values():
        if cls.family == family:
            return cls
    raise SpecconvError(f"no architecture plugin of family {family!r}")


def plugin_classes_writing(gguf_arch: str) -> list[type[ArchPlugin]]:
    """The registered plugin classes that write GGUF arch `gguf_arch` (deepseek2: DeepSeek-V3's and
    GLM-4.7-Flash's), for tools that read a file's header and ask what its family declares."""
    _load_builtin_plugins()
    return sorted({cls for cls in _REGISTRY.values() if cls.gguf_arch == gguf_arch}, key=lambda cls: cls.__name__)


def plugin_class_for(config: Mapping) -> type[ArchPlugin]:
    """The plugin class for a config.json, or a SpecconvError listing what is supported."""
    _load_builtin_plugins()
    archs = ConfigReader(config).strings("architectures", default=None) or []
    for arch in archs:
        if arch in _REGISTRY:
            # a plugin may hand a config to a more specific one (an EAGLE-3 head saved as LlamaForCausalLM)
            return _REGISTRY[arch].refine(config)
    named = ", ".join(archs) if archs else "(config.json has no 'architectures')"
    raise SpecconvError(
        f"unsupported architecture {named}; supported: {', '.join(supported_architectures())}"
    )


__all__ = [
    "ArchPlugin",
    "Checkpoint",
    "MetaKV",
    "MtpMode",
    "Role",
    "SourceTensor",
    "SpecconvError",
    "TensorPlan",
    "check_plugin",
    "plugin_class_for",
    "plugin_class_for_family",
    "plugin_classes_writing",
    "register",
    "supported_architectures",
]
