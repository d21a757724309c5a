"""A family's tensors as data: one `TensorTable` per architecture, from which the converter's plan,
the runtime's needed and optional tensor names, the expected shapes and the storage rule derive.

A `TensorSpec` is one GGUF tensor: its name template (`{bid}` for per-block tensors), the Hugging
Face tensor that feeds it (`{p}` stands for the block's HF prefix, e.g. `model.layers.3.`), its
shape in torch order as a function of the family's sizes, which blocks have it (tags: a block has a
spec when it has every tag the spec names), whether the runtime can run without it, and whether it
is kept float (F32 in the file, float32 in the runtime) or quantizable.

The sizes are one object per family whose fields the shape functions read. The plugin builds it
from config.json, the graph from GGUF metadata; in the graph's sizes a dimension the file chooses is
a string (the vocabulary "V"), which the load-time shape check binds to the first tensor that has it
(runtime/validate.py).

What a table cannot say stays in the plugin as a hook, named by `TensorSpec.hook` and called once
per block (the routed experts, fused or per expert; the output head, absent when tied). A spec with
neither `hf` nor `hook` is one this converter never writes but the runtime reads when a file has it
(files of other converters), so it is always `optional`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, Iterable, Mapping, Sequence

from .base import Block, Role
from .errors import SpecconvError
from .transforms import identity

Shape = tuple  # ints, or strings for sizes the file chooses (runtime only)



class AttentionWidths:
    """The q and k/v projection widths of a family's sizes (a dataclass with n_head, n_head_kv and
    head_dim), which its table rows use."""

    @property
    def q(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.num_key_value_heads * self.head_dim

@dataclass(frozen=True)
class TensorSpec:
    gguf: str  # name template, "blk.{bid}.attn_q.weight" or a global name such as "token_embd.weight"
    hf: str | None  # source template ("{p}self_attn.q_proj.weight"); None: see `hook` and the module docstring
    shape: Callable[[Any], Shape]  # sizes -> output shape, torch order (the reverse of what GGUF shows)
    on: frozenset[str] | str = frozenset()  # tags a block must have to hold it ("attention moe"); global: none
    optional: bool = False  # the runtime runs without it (and loads it when the file has it)
    f32: bool = False  # storage rule: kept float (F32 in the file, float32 in the runtime); else quantizable
    transform: Callable[[Any], Callable] | None = None  # sizes -> the plan's transform; None: identity
    hf_shape: Callable[[Any], Shape | list[Shape]] | None = None  # accepted source shape(s) if not `shape`
    accepts: Callable[[Any], list[Shape]] | None = None  # further shapes the runtime reads (other converters)
    hook: str | None = None  # planned by the plugin hook of this name (what the table cannot say)
    role: Role = Role.SHARED  # of a global tensor; a block's tensors take their block's role
    graph: str | None = None  # the runtime graph that reads it ("encoder", "mtp") where the role does not say

    def __post_init__(self):
        if isinstance(self.on, str):
            object.__setattr__(self, "on", frozenset(self.on.split()))
        if self.hf is None and self.hook is None and not self.optional:
            raise ValueError(f"{self.gguf}: a tensor the converter never writes must be optional")

    @property
    def per_block(self) -> bool:
        return "{bid}" in self.gguf

    def name(self, bid: int | None = None) -> str:
        return self.gguf.format(bid=bid) if self.per_block else self.gguf


def swiglu_specs(hf: str, on: str = "", width: Callable[[Any], int] = lambda s: s.intermediate_size,
                 suffix: str = "", **kw) -> tuple[TensorSpec, ...]:
    """A SwiGLU MLP's rows: `blk.{bid}.ffn_{gate,up,down}{suffix}.weight` from `{hf}{gate,up,down}_proj.weight`,
    [F, H], [F, H] and [H, F] with F = width(sizes): a dense MLP, or (suffix "_shexp") a shared expert."""
    into, out = (lambda s: (width(s), s.hidden_size)), (lambda s: (s.hidden_size, width(s)))
    return tuple(TensorSpec(f"blk.{{bid}}.ffn_{part}{suffix}.weight", f"{hf}{part}_proj.weight", shape, on, **kw)
                 for part, shape in (("gate", into), ("up", into), ("down", out)))


def expert_specs(hf: str | None = None, on: str = "moe", **kw) -> tuple[TensorSpec, ...]:
    """Routed experts stacked as `blk.{bid}.ffn_{gate,up,down}_exps.weight` [E, Fe, H], [E, Fe, H], [E, H, Fe]:
    read from `{hf}{gate,up,down}_proj.weight` when the checkpoint keeps them 3-D, else planned by the
    plugin's `experts` hook (per-expert or fused tensors)."""
    into = lambda s: (s.num_experts, s.moe_intermediate_size, s.hidden_size)  # noqa: E731
    out = lambda s: (s.num_experts, s.hidden_size, s.moe_intermediate_size)  # noqa: E731
    return tuple(TensorSpec(f"blk.{{bid}}.ffn_{part}_exps.weight", hf and f"{hf}{part}_proj.weight", shape, on,
                            hook=None if hf else "experts", **kw)
                 for part, shape in (("gate", into), ("up", into), ("down", out)))


def read_by(graph: str, specs: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    """`specs` as the runtime's `graph` reads them (`TensorSpec.graph`): a drafter file's rows."""
    return tuple(replace(s, graph=graph) for s in specs)


Hook = Callable[..., None]  # hook(plan, sizes, bid, prefix, role); bid None and prefix "" for a global


@dataclass(frozen=True)
class TensorTable:
    specs: tuple[TensorSpec, ...]
    # sizes, block index -> the block's tags ("attention" / "recurrent", "dense" / "moe", "nextn", ...)
    block_tags: Callable[[Any, int], frozenset[str]]
    # sizes -> the tags the model has for its global tensors (Gemma 4's per-layer inputs); None: every global
    global_tags: Callable[[Any], frozenset[str]] | None = None
    # sizes, block index -> the sizes of that block (per-block head sizes and widths); None: the same for all
    block_sizes: Callable[[Any, int], Any] | None = None

    def globals(self, sizes=None) -> list[TensorSpec]:
        """The global specs; with `sizes`, those whose tags the model has (without: every one)."""
        tags = self.global_tags(sizes) if self.global_tags is not None and sizes is not None else None
        return [s for s in self.specs if not s.per_block and (tags is None or s.on <= tags)]

    def block(self, sizes, bid: int) -> list[TensorSpec]:
        tags = self.block_tags(sizes, bid)
        return [s for s in self.specs if s.per_block and s.on <= tags]

    def sizes_of(self, sizes, bid: int):
        """The sizes block `bid`'s shapes are written in."""
        return self.block_sizes(sizes, bid) if self.block_sizes is not None else sizes

    def replacing(self, tag: str, specs: Sequence[TensorSpec]) -> "TensorTable":
        """This table with the block specs that need `tag` replaced by `specs` (in their place)."""
        out: list[TensorSpec] = []
        for s in self.specs:
            if tag in s.on:
                if specs and specs[0] not in out:
                    out += specs
                continue
            out.append(s)
        return TensorTable(tuple(out), self.block_tags, self.global_tags, self.block_sizes)

    # ---- (a) the converter's plan ------------------------------------------------------------

    def plan(self, plan, sizes, blocks: Iterable[Block], hooks: Mapping[str, Hook] | None = None) -> None:
        """Add every tensor of the globals and of `blocks` to `plan` (a plan_tools.RolePlan): sources
        checked against the sizes, transforms bound, F32 pinned where the table keeps a tensor float."""
        hooks = hooks or {}
        self._plan_specs(plan, sizes, self.globals(sizes), None, "", None, hooks)
        for b in blocks:
            self._plan_specs(plan, self.sizes_of(sizes, b.bid), self.block(sizes, b.bid), b.bid, b.prefix, b.role,
                             hooks)

    @staticmethod
    def _plan_specs(plan, sizes, specs, bid, prefix, role, hooks) -> None:
        called: set[str] = set()
        for s in specs:
            if s.hook is not None:
                if s.hook not in hooks:
                    raise SpecconvError(f"{s.gguf}: the plugin has no hook {s.hook!r}")
                if s.hook not in called:
                    called.add(s.hook)
                    hooks[s.hook](plan, sizes, bid, prefix, role or s.role)
                continue
            if s.hf is None:
                continue  # read by the runtime when present, never written here
            shape = s.shape(sizes)
            source = plan.source(s.hf.format(p=prefix), s.hf_shape(sizes) if s.hf_shape else shape)
            plan.add(s.name(bid), [source], shape, role or s.role,
                     s.transform(sizes) if s.transform else identity, s.f32)

    # ---- (b) the runtime's needed and optional tensors ---------------------------------------

    def names(self, sizes, blocks: Iterable[int], roles: Iterable[Role] = (Role.TRUNK, Role.SHARED),
              optional: bool = False) -> list[str]:
        """The required (or, with optional=True, the optional) tensors of the globals whose role is in
        `roles` and of the given blocks, in table order."""
        roles = set(roles)
        out = [s.name() for s in self.globals(sizes) if s.optional == optional and s.role in roles]
        for bid in blocks:
            out += [s.name(bid) for s in self.block(sizes, bid) if s.optional == optional]
        return out

    def graph_names(self, sizes, blocks: Iterable[int], graph: str, optional: bool = False) -> list[str]:
        """The required (or optional) tensors that `graph` reads, of the globals and the given blocks, for
        a file whose graphs are not its roles (an EAGLE-3 head: a trunk file run as ENCODER + MTP)."""
        out = [s.name() for s in self.globals(sizes) if s.optional == optional and s.graph == graph]
        for bid in blocks:
            out += [s.name(bid) for s in self.block(sizes, bid) if s.optional == optional and s.graph == graph]
        return out

    # ---- (c) the expected shapes ---------------------------------------------------------------

    def ggml_shapes(self, sizes, blocks: Iterable[int]) -> dict[str, tuple | list[tuple]]:
        """name -> the shape in ggml order (ne0 first) the runtime checks, or a list of the shapes it
        accepts (what this converter writes first)."""
        out: dict[str, tuple | list[tuple]] = {}

        def put(s: TensorSpec, name: str, sizes) -> None:
            shapes = [s.shape(sizes)] + (list(s.accepts(sizes)) if s.accepts else [])
            ggml = [tuple(reversed(sh)) for sh in shapes]
            out[name] = ggml[0] if len(ggml) == 1 else ggml

        for s in self.globals(sizes):
            put(s, s.name(), sizes)
        for bid in blocks:
            for s in self.block(sizes, bid):
                put(s, s.name(bid), self.sizes_of(sizes, bid))
        return out

    # ---- (d) the storage rule ------------------------------------------------------------------

    @cached_property
    def _float_names(self) -> re.Pattern:
        kept = [re.escape(s.gguf).replace(re.escape("{bid}"), r"\d+") for s in self.specs if s.f32]
        return re.compile("|".join(f"(?:{k})" for k in kept) or r"(?!)")

    def keeps_float32(self, name: str) -> bool:
        """Whether the table keeps this tensor float (the runtime loads it as float32)."""
        return self._float_names.fullmatch(name) is not None



class GraphTensors:
    """A runtime graph's tensor lists from its family's table: the trunk graph runs blocks
    0..n_layer-1, the MTP graph the first nextn block (n_layer), or with `chained` every one of the
    n_nextn blocks after the trunk (hy_v3, step35, mimo2); `sizes(hp)` turns the graph's
    hparams into the table's sizes. A graph module exposes these as its `main_tensors`,
    `optional_main_tensors`, `mtp_tensors`, `optional_mtp_tensors`, `OPTIONAL`, `keep_float32` and
    `expected_shapes`."""

    def __init__(self, table: TensorTable, sizes: Callable[[Any], Any], chained: bool = False):
        self.table, self.sizes, self.chained = table, sizes, chained
        self.OPTIONAL = tuple(table.names(None, (), optional=True))  # e.g. output.weight, absent when tied
        self.keep_float32 = table.keeps_float32  # what the file keeps F32 stays float32 in any compute dtype

    def main_tensors(self, hp) -> list[str]:
        return self.table.names(self.sizes(hp), range(hp.num_hidden_layers))

    def optional_main_tensors(self, hp) -> list[str]:
        """Trunk-block tensors the graph runs without (e.g. GLM's attention biases), loaded when present."""
        return self.table.names(self.sizes(hp), range(hp.num_hidden_layers), roles=(), optional=True)

    def _mtp_blocks(self, hp) -> range:
        """The first nextn block; with `chained`, all k of them (block i drafts position i)."""
        return range(hp.num_hidden_layers, hp.num_hidden_layers + (hp.num_nextn_predict_layers if self.chained else 1))

    def mtp_tensors(self, hp) -> list[str]:
        if not hp.num_nextn_predict_layers:
            return []
        return self.table.names(self.sizes(hp), self._mtp_blocks(hp), roles=(Role.MTP, Role.SHARED))

    def optional_mtp_tensors(self, hp) -> list[str]:
        return self.table.names(self.sizes(hp), self._mtp_blocks(hp), roles=(), optional=True) if hp.num_nextn_predict_layers else []

    def expected_shapes(self, hp) -> dict[str, tuple | list[tuple]]:
        """Every tensor of the file's blocks, trunk and MTP, in ggml order (runtime/validate.py)."""
        return self.table.ggml_shapes(self.sizes(hp), range(hp.num_hidden_layers + hp.num_nextn_predict_layers))
