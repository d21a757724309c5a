"""Typed reads of config.json values, each checked for its JSON type where it is read.

A checkpoint's config.json comes from anywhere: a value of the wrong JSON type (a list where a
number belongs, a number where a list belongs, a string for a flag) must stop the conversion with
one line naming the key, never reach `int()`, `float()` or a loop as something else. Every plugin
reads its fields through a `ConfigReader`:

    cfg = ConfigReader(checkpoint.config)        # the whole file
    tc = cfg.text_model()                        # `text_config` of VL releases, else the top level
    hidden = tc.integer("hidden_size", min=1)    # required: missing -> "config.json lacks text_config.hidden_size"
    n_kv = tc.integer("num_key_value_heads", default=n_head)
    experts = tc.integer("n_routed_experts", "num_local_experts")     # the first key set is read
    theta = tc.with_rope().number("rope_theta", default=10000.0)     # also in rope_parameters / rope_scaling

`None` (JSON null) is read as absent, as transformers reads it. Errors name the key path as it
sits in the file (`text_config.rope_parameters.rope_theta`, `layer_types[3]`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from .errors import SpecconvError

REQUIRED: Any = object()  # a getter's default when the key must be present
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: no GGUF it loads has more blocks
_ROPE_SECTIONS = ("rope_parameters", "rope_scaling")  # where transformers v5 moved rope fields


def shown(value: Any, limit: int = 48) -> str:
    """A value for a one-line message: its repr, shortened."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ConfigReader:
    """Typed getters over one object of config.json (`path`: where it sits in the file). A reader
    may look in several objects in turn (`with_rope`, `with_defaults`): the first that sets a key
    answers for it."""

    def __init__(self, data: Mapping[str, Any], path: str = "", file: str = "config.json",
                 _layers: tuple[tuple[Mapping[str, Any], str], ...] | None = None,
                 _defaults: tuple[Mapping[str, Any], str] = ({}, "")):
        if not isinstance(data, Mapping):
            raise SpecconvError(f"{file}: {path or 'the file'} must be a JSON object, got {shown(data)}")
        self.data, self.path, self.file = data, path, file
        self._layers = _layers if _layers is not None else ((data, path),)
        self._defaults = _defaults

    # ------------------------------------------------------------------ naming and errors

    def key_path(self, key: str, prefix: str | None = None) -> str:
        prefix = self.path if prefix is None else prefix
        return f"{prefix}.{key}" if prefix else key

    def error(self, key: str, message: str) -> SpecconvError:
        """A one-line error about `key` of this object, for a plugin's own rules on a value."""
        return SpecconvError(f"{self.file}: {self.key_path(key)} {message}")

    def _wrong(self, where: str, what: str, value: Any) -> SpecconvError:
        return SpecconvError(f"{self.file}: {where} must be {what}, got {shown(value)}")

    # ------------------------------------------------------------------ lookup

    def _find(self, keys: tuple[str, ...]) -> tuple[str, Any]:
        """(path of the key that answers, its value), or (path of the first key, None) when none is set.
        A default answers only for a key the file leaves out: an explicit null stays null."""
        for key in keys:
            for data, prefix in self._layers:
                value = data.get(key)
                if value is not None:
                    return self.key_path(key, prefix), value
        defaults, what = self._defaults
        for key in keys:
            if key in defaults and not any(key in data for data, _ in self._layers):
                return self.key_path(key, what), defaults[key]
        return self.key_path(keys[0]), None

    def has(self, *keys: str) -> bool:
        return self._find(keys)[1] is not None

    def raw(self, *keys: str, default: Any = None) -> Any:
        """The value as it is (no type check): for fields a plugin dispatches on by type itself."""
        value = self._find(keys)[1]
        return default if value is None else value

    def _value(self, keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
        if not keys:
            raise TypeError("name at least one key")
        where, value = self._find(keys)
        if value is None and default is REQUIRED:
            also = f" (or {', '.join(keys[1:])})" if len(keys) > 1 else ""
            raise SpecconvError(f"{self.file} lacks {where}{also}")
        return where, value

    # ------------------------------------------------------------------ scalars

    def integer(self, *keys: str, default: Any = REQUIRED, min: int | None = 0, max: int | None = None) -> Any:
        """An integer (a float with an integral value is accepted, a bool is not) within [min, max]."""
        where, value = self._value(keys, default)
        if value is None:
            return default
        return _integer(self, where, value, min, max)

    def number(self, *keys: str, default: Any = REQUIRED, positive: bool = False) -> Any:
        """A finite number (int or float, not bool), as a float."""
        where, value = self._value(keys, default)
        if value is None:
            return default
        return _number(self, where, value, positive)

    def flag(self, *keys: str, default: Any = REQUIRED) -> Any:
        """true or false."""
        where, value = self._value(keys, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._wrong(where, "true or false", value)
        return value

    def string(self, *keys: str, default: Any = REQUIRED, choices: Iterable[str] | None = None) -> Any:
        """A string (one of `choices`, when given)."""
        where, value = self._value(keys, default)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._wrong(where, "a string", value)
        if choices is not None and value not in tuple(choices):
            raise SpecconvError(f"{self.file}: {where} = {shown(value)} is not one of {', '.join(choices)}")
        return value

    # ------------------------------------------------------------------ lists

    def _list(self, keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
        where, value = self._value(keys, default)
        if value is not None and not isinstance(value, list):
            raise self._wrong(where, "a list", value)
        return where, value

    def integers(self, *keys: str, default: Any = REQUIRED, min: int | None = 0) -> Any:
        where, value = self._list(keys, default)
        if value is None:
            return default
        return [_integer(self, f"{where}[{i}]", v, min, None) for i, v in enumerate(value)]

    def numbers(self, *keys: str, default: Any = REQUIRED) -> Any:
        where, value = self._list(keys, default)
        if value is None:
            return default
        return [_number(self, f"{where}[{i}]", v, False) for i, v in enumerate(value)]

    def strings(self, *keys: str, default: Any = REQUIRED) -> Any:
        where, value = self._list(keys, default)
        if value is None:
            return default
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise self._wrong(f"{where}[{i}]", "a string", v)
        return list(value)

    def per_layer(self, key: str, kind: str, default: Any = None) -> Any:
        """A value given once for every layer or as a list with one entry per layer (`kind`: "integer"
        or "number"): a scalar stays a scalar, a list a list; null entries of a list stay None."""
        where, value = self._find((key,))
        if value is None:
            return default
        read = {"integer": lambda w, v: _integer(self, w, v, 0, None),
                "number": lambda w, v: _number(self, w, v, False)}[kind]
        if not isinstance(value, list):
            return read(where, value)
        return [None if v is None else read(f"{where}[{i}]", v) for i, v in enumerate(value)]

    # ------------------------------------------------------------------ what several families read alike

    def attention_heads(self) -> tuple[int, int, int]:
        """(num_attention_heads, num_key_value_heads, head_dim) with transformers' defaults (every head a
        KV head; head_dim = hidden_size / heads), checked: the KV heads divide the heads."""
        heads = self.integer("num_attention_heads", min=1)
        kv_heads = self.integer("num_key_value_heads", default=heads, min=1)
        head_dim = self.integer("head_dim", default=None, min=1) or self.integer("hidden_size", min=1) // heads
        if heads % kv_heads:
            raise self.error("num_attention_heads", f"({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
        return heads, kv_heads, head_dim

    # ------------------------------------------------------------------ objects

    def section(self, key: str) -> ConfigReader:
        """The object under `key` (an empty one when absent), as a reader that names its keys' paths."""
        where, value = self._find((key,))
        if value is None:
            return ConfigReader({}, where, self.file)
        if not isinstance(value, Mapping):
            raise self._wrong(where, "a JSON object", value)
        return ConfigReader(value, where, self.file)

    def text_model(self) -> ConfigReader:
        """The text model's fields: `text_config` of VL releases when the file has one, else this object."""
        if self.data.get("text_config") is None:
            return self
        return self.section("text_config")

    def with_rope(self) -> ConfigReader:
        """This reader, then this object's `rope_parameters` and `rope_scaling` (where transformers v5
        keeps rope fields): a key is read from the first that sets it."""
        sections = tuple((sub.data, sub.path) for sub in (self.section(name) for name in _ROPE_SECTIONS))
        return ConfigReader(self.data, self.path, self.file, self._layers + sections, self._defaults)

    def merged(self, key: str) -> ConfigReader:
        """The object under `key` answering first, then this object (speculators' EAGLE-3 heads keep the
        decoder layer's fields in `transformer_layer_config`)."""
        sub = self.section(key)
        return ConfigReader(self.data, self.path, self.file, ((sub.data, sub.path),) + self._layers, self._defaults)

    def with_defaults(self, defaults: Mapping[str, Any], what: str = "default") -> ConfigReader:
        """This reader with `defaults` answering for the keys the file leaves out (a family's
        transformers class defaults, as transformers applies them: an explicit null stays null)."""
        return ConfigReader(self.data, self.path, self.file, self._layers, (defaults, f"({what})"))

    def with_values(self, values: Mapping[str, Any], what: str = "derived") -> ConfigReader:
        """This reader with `values` answering first (fields a plugin derives from others)."""
        return ConfigReader(self.data, self.path, self.file, ((values, f"({what})"),) + self._layers, self._defaults)


def _integer(reader: ConfigReader, where: str, value: Any, low: int | None, high: int | None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise reader._wrong(where, "an integer", value)
    if (low is not None and value < low) or (high is not None and value > high):
        bound = ("a positive integer" if low == 1 and high is None else "a non-negative integer" if low == 0 and high is None
                 else f"an integer in [{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]")
        raise reader._wrong(where, bound, value)
    return value


def _number(reader: ConfigReader, where: str, value: Any, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise reader._wrong(where, "a finite number", value)
    if positive and value <= 0:
        raise reader._wrong(where, "a positive number", value)
    return float(value)
