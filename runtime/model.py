"""`load_model`: a GGUF file (or split shards) -> weights on a device + hparams + tokenizer.

Which graphs a file serves is decided from its tensors, as llama.cpp does:
* `nextn_predict_layers > 0` and no `blk.0.attn_norm.weight` -> an MTP-only sidecar: serves MTP;
* a trunk plus `blk.{n_layer}.nextn.eh_proj.weight` -> embedded: serves MAIN and MTP;
* a trunk without MTP tensors (key absent, or declared but the block missing) -> serves MAIN.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.backend import for_device
from specconv.runtime.device import resolve_devices, resolve_dtype
from specconv.runtime.gguf_file import GGUFModelFile
from specconv.runtime.graphs import graph_for
from specconv.runtime.placement import Placement
from specconv.runtime.stored import ReadCounter
from specconv.runtime.tokenizer import GGUFTokenizer
from specconv.runtime.types import GraphType
from specconv.runtime.validate import read_hparams, validate_model
from specconv.runtime.weights import MODES, Weights, load_tensor


class Model:
    """Weights of one GGUF model on one device, and what it can run."""

    def __init__(self, file: GGUFModelFile, devices: list[torch.device], dtype: torch.dtype,
                 share_from: "Model | None", weights: str = "stored", offload: bool = False):
        if weights not in MODES:
            raise SpecconvError(f"weights must be one of {MODES}, not {weights!r}")
        self.file = file
        self.paths = file.paths
        self.arch = file.arch
        self.graph = graph_for(self.arch)  # its declared contract (runtime/graphs/contract.py)
        self.hparams = read_hparams(file, self.graph)
        self.device, self.dtype = devices[0], dtype
        self.weights_mode, self.offload = weights, offload
        if len(devices) > 1 and not self.graph.MULTI_DEVICE:
            raise SpecconvError(f"{file.paths[0].name}: the {self.arch} graph runs on one device; "
                                f"give one --device (with --offload for a model bigger than it)")
        # A graph may decide itself what its files serve (EAGLE-3 heads: ENCODER + decoder as MTP).
        custom = self.graph.serves
        self.serves = custom(self.hparams, file) if custom is not None else self._detect_graphs()
        self.kind = self.graph.KIND or (
            "sidecar" if self.serves == {GraphType.MTP} else "embedded" if GraphType.MTP in self.serves else "trunk")
        self.backend = for_device(self.device)  # the arithmetic of its device (runtime/backend.py)
        self.weights = self._load_weights(share_from, devices)
        self.hidden_size = self.hparams.hidden_size
        self.vocab_size = (int(self.weights["token_embd.weight"].shape[0]) if "token_embd.weight" in self.weights
                        else self.graph.vocab_size(self.hparams))
        self._tokenizer = None

    def _detect_graphs(self) -> set[GraphType]:
        hp, f = self.hparams, self.file
        has_trunk = f.has("blk.0.attn_norm.weight")
        has_mtp = hp.num_nextn_predict_layers > 0 and f.has(f"blk.{hp.num_hidden_layers}.nextn.eh_proj.weight")
        if hp.num_nextn_predict_layers > 0 and not has_trunk:
            if not has_mtp:
                raise SpecconvError(f"{self.paths[0].name}: declares {hp.num_nextn_predict_layers} MTP layer(s) but holds neither "
                                    f"the trunk nor blk.{hp.num_hidden_layers}.nextn.eh_proj.weight")
            return {GraphType.MTP}
        if not has_trunk:
            raise SpecconvError(f"{self.paths[0].name}: no trunk (blk.0.attn_norm.weight) and no MTP layers")
        return {GraphType.MAIN, GraphType.MTP} if has_mtp else {GraphType.MAIN}

    def _needed(self) -> list[str]:
        g, hp = self.graph, self.hparams
        needed: list[str] = []
        if GraphType.MAIN in self.serves:
            needed += g.main_tensors(hp)
            # per-block tensors a graph can do without (e.g. attention biases), when the file has them
            needed += [n for n in g.optional_main_tensors(hp) if self.file.has(n)]
        if GraphType.ENCODER in self.serves:
            needed += g.encoder_tensors(hp)
        if GraphType.MTP in self.serves:
            needed += g.mtp_tensors(hp)
            needed += [n for n in g.optional_mtp_tensors(hp) if self.file.has(n)]
        needed += [n for n in g.OPTIONAL if self.file.has(n)]
        needed = list(dict.fromkeys(needed))
        missing = [n for n in needed if not self.file.has(n)]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise SpecconvError(f"{self.paths[0].name}: missing tensor(s) {', '.join(missing[:5])}{more}")
        return needed

    def _placement(self, needed: list[str], devices: list[torch.device]) -> Placement:
        """Blocks cut over the devices by their stored bytes (one device: everything on it)."""
        n_blocks = self.hparams.num_hidden_layers
        layer_bytes = [0] * n_blocks
        for name in needed:
            parts = name.split(".")
            if parts[0] == "blk" and int(parts[1]) < n_blocks:
                layer_bytes[int(parts[1])] += self.file.tensors[name].stored.n_bytes
        return Placement.plan(devices, layer_bytes, self.offload)

    def _load_weights(self, share_from: "Model | None", devices: list[torch.device]) -> Weights:
        g = self.graph
        needed = self._needed()
        validate_model(self.file, g, self.hparams, needed)  # before any tensor is read (runtime/validate.py)
        placement = self._placement(needed, devices)
        weights = Weights(placement, ReadCounter())
        for name in needed:
            # a draft head's own tensors are never the target's (its SHAREABLE is empty)
            shared = share_from.weights.get(name) if share_from is not None and name in g.SHAREABLE else None
            if shared is not None and tuple(shared.shape) == self._torch_shape(name):
                weights[name] = shared  # one copy of the embedding / head for target and sidecar
                continue
            wide = self.dtype if self.dtype == torch.float64 else torch.float32
            dtype = wide if g.keep_float32(name) else self.dtype
            device = placement.tensor_device(name)
            weights[name] = load_tensor(self.file, name, device, dtype, self.weights_mode, self.offload,
                                        weights.counter)
        # Tensors a draft head takes from its target when it has none of its own (EAGLE-3 embedding / head).
        for name, candidates in g.FROM_TARGET.items():
            if name not in weights and share_from is not None:
                found = next((share_from.weights[c] for c in candidates if c in share_from.weights), None)
                if found is not None:
                    weights[name] = found
        return weights

    def _torch_shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed([int(d) for d in self.file.tensors[name].shape]))

    @property
    def tokenizer(self) -> GGUFTokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = GGUFTokenizer(self.file.kv)
            except SpecconvError as exc:
                name = self.paths[0].name
                raise SpecconvError(str(exc) if str(exc).startswith(name) else f"{name}: {exc}") from None
        return self._tokenizer

    def require(self, graph_type: GraphType):
        if graph_type in self.serves:
            return
        name = self.paths[0].name
        if graph_type == GraphType.MAIN and self.kind == "sidecar":
            raise SpecconvError(f"{name} is an MTP-only sidecar (no trunk): it cannot run as the main model; "
                                f"load the trunk file as MAIN and this one with --mtp")
        if graph_type == GraphType.MTP:
            raise SpecconvError(f"{name} has no MTP head (no blk.{self.hparams.num_hidden_layers}.nextn.eh_proj.weight); "
                                f"give an mtp- sidecar file")
        raise SpecconvError(f"{name} cannot run graph type {graph_type.value}")

    def __repr__(self):
        return (f"Model({self.paths[0].name}, arch={self.arch}, kind={self.kind}, "
                f"serves={sorted(g.value for g in self.serves)}, device={self.device}, dtype={self.dtype}, "
                f"backend={self.backend.name})")


def load_model(paths: str | os.PathLike | Iterable[str | os.PathLike], device: str | torch.device | None = "auto",
               dtype: str | torch.dtype | None = None, share_from: Model | None = None, weights: str | None = None,
               offload: bool | None = None) -> Model:
    """Load a GGUF model (one file, any shard of a split model, or the list of shards).

    `device`: auto, cpu, cuda:N, or several (`cuda:0,cuda:1`: blocks split by their bytes).
    `weights`: "stored" keeps tensors in their GGUF types, dequantized per use; "dense"
    dequantizes everything at load (runtime/weights.py). `offload`: stored bytes stay in the
    memory map and come to the device at each use (a model bigger than the device).
    `share_from`: a model already loaded (the target) whose token embedding / output head / output
    norm are reused when identical in shape, so a sidecar adds only its own block; `weights` and
    `offload` default to its choices (else "stored", no offload).
    """
    if weights is None:
        weights = share_from.weights_mode if share_from is not None else "stored"
    if offload is None:
        offload = share_from.offload if share_from is not None else False
    devices = resolve_devices(device)
    dt = resolve_dtype(dtype, devices[0])
    if isinstance(paths, (str, os.PathLike)):
        paths = [Path(paths)]
    return Model(GGUFModelFile(list(paths)), devices, dt, share_from, weights=weights, offload=offload)
