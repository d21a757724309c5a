"""Where each layer of a model lives and runs: one device, several devices, or offloaded.

Several devices (`--device cuda:0,cuda:1`) follow the usual device-map pattern: the blocks are cut
into contiguous ranges of about equal stored bytes, one range per device; the token embedding sits
on the first device, the output norm and head (and MTP blocks) on the last; the trunk loop moves the
activations, rope tables and batch positions to a block's device before running it, and each
attention / recurrent layer keeps its memory on its own device. Results come back to the first
device. The same code runs over several CPU "slots" (`cpu,cpu`), which is how it is tested on
machines without GPUs.

Offloading keeps every stored weight in the file's memory map and brings the bytes a use needs to
the compute device at that use (one layer's worth at a time), so a model bigger than the device
runs, at the speed of the transfers.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

_BLOCK = re.compile(r"^blk\.(\d+)\.")
# The device of the block being evaluated; memory and batch positions follow it.
_active: ContextVar[torch.device | None] = ContextVar("specconv_active_device", default=None)


def active_device() -> torch.device | None:
    return _active.get()


@contextmanager
def running_on(device: torch.device):
    token = _active.set(device)
    try:
        yield
    finally:
        _active.reset(token)


@dataclass
class Placement:
    devices: list[torch.device]
    offload: bool = False
    starts: list[int] = field(default_factory=lambda: [0])  # first block of each device's range

    @property
    def main(self) -> torch.device:
        return self.devices[0]

    @property
    def multi(self) -> bool:
        return len(self.devices) > 1

    def layer_device(self, layer: int) -> torch.device:
        index = 0
        for k, start in enumerate(self.starts):
            if layer >= start:
                index = k
        return self.devices[index]

    def tensor_device(self, name: str) -> torch.device:
        m = _BLOCK.match(name)
        if m:
            return self.layer_device(int(m.group(1)))
        return self.devices[-1] if name.startswith("output") else self.devices[0]

    @classmethod
    def plan(cls, devices: list[torch.device], layer_bytes: list[int], offload: bool = False) -> "Placement":
        """Contiguous block ranges of about equal stored bytes, one per device (each gets ≥ 1 block
        while there are blocks enough)."""
        if len(devices) == 1 or not layer_bytes:
            return cls(devices=list(devices), offload=offload, starts=[0])
        total = sum(layer_bytes)
        n = len(devices)
        starts, acc = [0], 0
        for layer, size in enumerate(layer_bytes):
            acc += size
            remaining_layers = len(layer_bytes) - layer - 1
            if len(starts) < n and acc >= total * len(starts) / n and remaining_layers >= n - len(starts):
                starts.append(layer + 1)
        while len(starts) < n:  # fewer blocks than devices: the last devices hold nothing but the head
            starts.append(len(layer_bytes))
        return cls(devices=list(devices), offload=offload, starts=starts)

    def describe(self) -> list[dict]:
        ends = self.starts[1:] + [None]
        return [{"device": str(d), "first_block": s, "end_block": e} for d, s, e in zip(self.devices, self.starts, ends)]


def on_layer_device(w, layer: int, fn, *tensors):
    """fn(*tensors) on the device of block `layer`, its inputs moved there and its results brought back
    to the first device; plainly fn(*tensors) for a model on one device."""
    placement = w.placement  # runtime/weights.py Weights
    if not placement.multi:
        return fn(*tensors)
    dev = placement.layer_device(layer)
    with running_on(dev):
        out = fn(*(move(t, dev) for t in tensors))
    return move(out, placement.main)


def move(obj, device: torch.device):
    """Tensors inside tuples / lists moved to `device` (rope tables and the like)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, tuple):
        return tuple(move(x, device) for x in obj)
    if isinstance(obj, list):
        return [move(x, device) for x in obj]
    return obj
