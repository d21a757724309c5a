"""The builder of the graphs that run through decoder.py's forward_trunk / forward_nextn.

A family gives what is its own: its rope `(w, hp, batch) -> (dtype -> cos/sin tables)`, its block
`(w, hp, batch, gdn_mode) -> block(i, h, rope) -> h`, and the nextn (MTP) block a context runs, if
it has one. `Trunk` turns them into the forward_main / forward_mtp of the Graph contract,
`Layouts` gives the KV-cache layouts of a graph whose every block attends, and `graph(...)` the
Graph with what all of these declare: captured decode steps, blocks placed over devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs.contract import Graph
from specconv.runtime.graphs.decoder import Block, Residual, forward_nextn, forward_trunk, normed
from specconv.runtime.graphs.ops import add_rms_norm
from specconv.runtime.memory import Batch, MemoryLayout

RopeOf = Callable[[Any, Any, Batch], Callable[[torch.dtype], object]]  # (w, hp, batch) -> (dtype -> rope)
BlockOf = Callable[[Any, Any, Batch, str], Block]  # (w, hp, batch, gdn_mode) -> block(i, h, rope) -> h
# attention(w, hp, i, a, batch, rope) / ffn(w, hp, i, x): a family's own halves of a pre-norm block
Attention = Callable[..., torch.Tensor]
Ffn = Callable[..., torch.Tensor]


def nextn_block(hp) -> int:
    """The one nextn block of a file sits after the trunk, at index n_layer."""
    return hp.num_hidden_layers


def pending_block(w, hp, i: int, h: torch.Tensor | Residual, batch: Batch, rope, attention: Attention, ffn: Ffn,
                  ffn_norm: str = "ffn_norm") -> Residual:
    """Pre-norm residual block: h + attention(attn_norm(h)), then + ffn(<ffn_norm>(h)). Each residual
    add is done with the norm after it, one ops.add_rms_norm (one launch on CUDA, the same two torch
    operations elsewhere): the input's pending add with attn_norm, the attention's with the FFN's
    norm; the FFN's add is left pending (a Residual) for the norm that reads the block's output.
    attention and ffn may return their last product unmade (ops.Deferred): on CUDA it is then made
    in the same launch as the add and the norm that follow it."""
    h, a = normed(h, w[f"blk.{i}.attn_norm.weight"], hp.rms_norm_eps)
    mixed = attention(w, hp, i, a, batch, rope)
    h, x = add_rms_norm(h, mixed, w[f"blk.{i}.{ffn_norm}.weight"], hp.rms_norm_eps)
    return Residual(h, ffn(w, hp, i, x))


def prenorm(attention: Attention, ffn: Ffn, ffn_norm: str = "ffn_norm") -> BlockOf:
    """The BlockOf of a family whose blocks are all `pending_block`s of its attention and FFN (the
    stream passed from block to block as a Residual: decoder.forward_trunk / forward_nextn)."""
    return lambda w, hp, batch, gdn_mode: (
        lambda i, h, rope: pending_block(w, hp, i, h, batch, rope, attention, ffn, ffn_norm))


@dataclass(frozen=True)
class Trunk:
    """The trunk and MTP forwards of a family. `mtp_block(hp)`: the index of the nextn block an MTP
    context runs (None: the family has no MTP head, and its forward_mtp says so)."""
    rope: RopeOf
    block: BlockOf
    mtp_block: Callable[[Any], int] | None = None

    def forward_main(self, w, hp, tokens: torch.Tensor, batch: Batch, want_layers: set[int], gdn_mode: str,
                     want_logits: torch.Tensor | None):
        """Returns (logits rows, post_norm, pre_norm, {layer J: input of block J; J = num_hidden_layers: post_norm})."""
        return forward_trunk(w, hp.num_hidden_layers, hp.rms_norm_eps, tokens, want_layers, want_logits,
                             self.rope(w, hp, batch), self.block(w, hp, batch, gdn_mode))

    def forward_mtp(self, w, hp, tokens: torch.Tensor, hidden_in: torch.Tensor, batch: Batch):
        """One MTP row per token through the nextn block (decoder.forward_nextn): returns (logits,
        z = normed output fed back when chaining, y = pre-norm output)."""
        if self.mtp_block is None:
            raise SpecconvError(f"{hp.arch} files have no MTP head")
        return forward_nextn(w, self.mtp_block(hp), hp.rms_norm_eps, tokens, hidden_in, self.rope(w, hp, batch),
                             self.block(w, hp, batch, ""))  # the nextn block attends: no recurrence mode


def _layout(layers: list[int], heads: int | list[int], width: int) -> MemoryLayout:
    if isinstance(heads, list):  # KV heads per block: each layer's cells get their own shape
        return MemoryLayout(attn_layers=layers, num_key_value_heads=heads[layers[0] if layers else 0], head_dim=width,
                            rec_layers=[], layer_shapes={i: (heads[i], width) for i in layers})
    return MemoryLayout(attn_layers=layers, num_key_value_heads=heads, head_dim=width, rec_layers=[])


def _kv_heads(hp):
    return hp.num_key_value_heads


@dataclass(frozen=True)
class Layouts:
    """The KV-cache layouts of a graph whose every block attends with `heads(hp)` KV heads (one count,
    or one per block) of cells `width(hp)` wide: the trunk's blocks, and the MTP block `mtp_block(hp)`
    (no block without an MTP head)."""
    width: Callable[[Any], int]
    mtp_block: Callable[[Any], int] | None = None
    heads: Callable[[Any], int | list[int]] = _kv_heads

    def main_layout(self, hp, state_dtype: torch.dtype = torch.float32) -> MemoryLayout:
        return _layout(list(range(hp.num_hidden_layers)), self.heads(hp), self.width(hp))

    def mtp_layout(self, hp) -> MemoryLayout:
        return _layout([] if self.mtp_block is None else [self.mtp_block(hp)], self.heads(hp), self.width(hp))


def graph(name: str, HParams: type, tensors, main_layout: Callable, mtp_layout: Callable, trunk: Trunk,
          **family) -> Graph:
    """The Graph of a family run through decoder.py: its tensors (archs/tensor_table.py GraphTensors),
    layouts and forwards, CUDA-graph capturable and placed over devices (forward_trunk / forward_nextn
    follow a placement); `family` holds the rest of its declaration (check_hparams, ...)."""
    return Graph(**{
        "name": name, "HParams": HParams, "tensors": tensors, "main_layout": main_layout,
        "mtp_layout": mtp_layout, "forward_main": trunk.forward_main, "forward_mtp": trunk.forward_mtp,
        "CAPTURABLE": True, "MULTI_DEVICE": True, **family})
