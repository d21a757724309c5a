"""One reader of a GGUF file's `{arch}.*` hyperparameter keys, shared by every graph's `HParams.from_kv`.

`key(name)` reads `{arch}.{name}`: a missing key is an error naming it unless a default is given
(`key(name, None)` makes a key optional), and `type=` checks and converts the value (int, float,
bool, str, list), so a wrongly typed value is a one-line error naming the key, not a TypeError
inside a graph. runtime/validate.py's `check_kv` checks ranges before a graph reads anything.
"""

from __future__ import annotations

from typing import Any, Mapping

from specconv.archs.errors import SpecconvError

_REQUIRED = object()


class HParamsReader:
    """The `{arch}.` keys of one GGUF metadata mapping (`arch` is general.architecture)."""

    def __init__(self, kv: Mapping[str, Any]):
        self.kv = kv
        self.arch = kv["general.architecture"]

    def name(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        return self.name(name) in self.kv

    def key(self, name: str, default: Any = _REQUIRED, type: type | None = None) -> Any:
        """`{arch}.{name}`, or `default` when the file lacks it (required without a default)."""
        value = self.kv.get(self.name(name))
        if value is None:
            if default is _REQUIRED:
                raise SpecconvError(f"GGUF metadata lacks {self.name(name)}")
            return default
        return value if type is None else _typed(self.name(name), value, type)

    def per_layer(self, name: str, n: int, default: Any = _REQUIRED, type: type = int) -> list:
        """A per-block key as `n` values: a scalar applies to every block (llama.cpp's get_key_or_arr);
        a list gives at least `n` entries, of which the first `n` are the blocks'."""
        value = self.key(name, default)
        values = list(value) if isinstance(value, (list, tuple)) else [value] * n
        if len(values) < n:
            raise SpecconvError(f"{self.name(name)} has {len(values)} entries for {n} blocks")
        return [_typed(self.name(name), v, type) for v in values[:n]]


def _typed(key: str, value: Any, type: type) -> Any:
    """`value` as `type`; an int is a float too, a bool is no number."""
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: lambda v: isinstance(v, bool) or v in (0, 1),
          list: lambda v: isinstance(v, (list, tuple))}.get(type, lambda v: isinstance(v, type))
    if not ok(value):
        raise SpecconvError(f"GGUF key {key} must be {type.__name__}, found {value!r}"[:200])
    return list(value) if type is list else type(value)
