"""The base of every family's hyperparameters: one dataclass per family, with Hugging Face's names.

A family declares one subclass (in its plugin module, archs/<family>.py). The plugin builds it from
config.json (`from_config`, through archs/config_reader.py), the runtime graph from GGUF metadata
(`from_kv`, through `HParamsReader` below), and the family's tensor table reads it as its
sizes, so a quantity has one name from the checkpoint to the graph. Field names are the ones of the
family's transformers config; a quantity only GGUF has takes a name that says what it is.

The fields here are what the generic runtime reads of any family: the block counts, the widths the
load-time checks hold to each other (runtime/validate.py), and the vocabulary. A family without
attention heads or experts leaves those at 0; one whose blocks differ gives lists (one entry a block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import SpecconvError

VOCAB_FROM_FILE = "V"  # the vocabulary dimension of a file's tensors: bound by the first tensor that has it


@dataclass(kw_only=True)
class FamilyHParams:
    arch: str  # the GGUF architecture (general.architecture)
    num_hidden_layers: int  # trunk blocks; the MTP blocks follow them
    hidden_size: int
    vocab_size: int = 0  # 0 where neither config nor file states it (a sidecar without a tokenizer)
    num_nextn_predict_layers: int = 0  # MTP (nextn) blocks after the trunk
    max_position_embeddings: int = 0
    # Widths the load-time checks hold to each other; lists where blocks differ, 0 where not the family's.
    num_attention_heads: int | list[int] = 0
    num_key_value_heads: int | list[int] = 0
    head_dim: int | list[int] = 0
    rotary_dim: int | None = None  # rope width within a head (GGUF rope.dimension_count); None: no rope check
    num_experts: int = 0
    num_experts_per_tok: int = 0
    from_file: bool = False  # read from GGUF metadata (from_kv), not from config.json

    @property
    def vocab_dim(self) -> int | str:
        """The vocabulary dimension of the family's tensor shapes: config.json's size when converting,
        the file's own (VOCAB_FROM_FILE) when loading, which the shape check binds to its tensors."""
        return VOCAB_FROM_FILE if self.from_file else self.vocab_size

    @property
    def input_width(self) -> int:
        """Width of the hidden rows an MTP forward takes from its target (the Gemma 4 assistant's
        differs from its own hidden size)."""
        return self.hidden_size

    def per_block(self, value: int | list[int]) -> list[int]:
        """A width as one value per block (a single value applies to every block)."""
        return list(value) if isinstance(value, (list, tuple)) else [value] * (self.num_hidden_layers
                                                                              + self.num_nextn_predict_layers)


# ---- the GGUF side: one reader of a file's `{arch}.*` keys, shared by every family's `from_kv` ------
# `key(name)` reads `{arch}.{name}`: a missing key is an error naming it unless a default is given
# (`key(name, None)` makes a key optional), and `type=` checks and converts the value (int, float,
# bool, str, list), so a wrongly typed value is a one-line error naming the key, not a TypeError
# inside a graph. runtime/validate.py's `check_kv` checks ranges before any `from_kv` reads a file.

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

    # ---- what several families read alike ------------------------------------------------------

    def block_counts(self) -> tuple[int, int]:
        """(trunk blocks, MTP blocks): block_count counts both, nextn_predict_layers (0 when absent) the MTP ones."""
        total, nextn = self.key("block_count", type=int), self.key("nextn_predict_layers", 0, int)
        if nextn > total:
            raise SpecconvError(f"{self.name('nextn_predict_layers')} ({nextn}) exceeds block_count ({total})")
        return total - nextn, nextn

    def attention_widths(self) -> tuple[int, int, int]:
        """(embedding_length, attention.head_count, the head size): attention.key_length, else the
        embedding split over the heads (llama.cpp's default)."""
        hidden_size, heads = self.key("embedding_length", type=int), self.key("attention.head_count", type=int)
        return hidden_size, heads, self.key("attention.key_length", hidden_size // heads, int)

    def check_value_length(self, key_length: int, suffix: str = "") -> None:
        """attention.value_length{suffix}, where stated, equals the key length (a family with one head size)."""
        if self.key(f"attention.value_length{suffix}", key_length, int) != key_length:
            raise SpecconvError(f"{self.arch}: attention.value_length{suffix} differs from key_length{suffix}")

    def vocab_size(self) -> int:
        """{arch}.vocab_size, else the tokenizer's token count, else 0 (a sidecar without a tokenizer)."""
        tokens = self.kv.get("tokenizer.ggml.tokens")
        return self.key("vocab_size", 0, int) or (len(tokens) if isinstance(tokens, list) else 0)


def _typed(key: str, value: Any, type: type) -> Any:
    """`value` as `type`; an int is a float too, a bool is no number."""
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: lambda v: isinstance(v, bool) or v in (0, 1),
          list: lambda v: isinstance(v, (list, tuple))}.get(type, lambda v: isinstance(v, type))
    if not ok(value):
        raise SpecconvError(f"GGUF key {key} must be {type.__name__}, found {value!r}"[:200])
    return list(value) if type is list else type(value)
