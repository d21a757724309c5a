"""The graph contract: everything the runtime reads of one architecture's graph, declared once.

Each graph module ends with `GRAPH = Graph(name=..., archs=..., ...)`: the GGUF arches it runs, its
hyperparameter reader, tensor lists, memory layouts and forwards (required), and the capabilities
that differ between graphs (optional, each with the default most graphs share). The runtime
(runtime/model.py, context.py, drafters/, speculative.py) and `specconv verify` read these fields
and nothing else of a graph, so a new graph states here what it can do instead of being probed for
it. The capability constants keep the upper-case names the graph modules used for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from specconv.archs.errors import SpecconvError

# Tensors a model may take from the target it drafts for when identical in shape (runtime/model.py).
SHARED_WITH_TARGET = ("token_embd.weight", "output.weight", "output_norm.weight")
HIDDEN_STATES = ("post_norm", "pre_norm")  # rows a target hands its drafter (runtime/context.py)
CHAIN_STATES = ("nextn", "pre_norm")  # the MTP output a chained block passes to the next
MTP_ROW_LAYOUTS = ("llama.cpp", "shifted")  # runtime/drafters/mtp_chain.py LAYOUTS
KINDS = (None, "eagle3", "dflash", "assistant")  # None: trunk / sidecar / embedded, from the file's tensors

Names = Callable[[Any], list[str]]
FROM_TABLE = ("main_tensors", "optional_main_tensors", "mtp_tensors", "optional_mtp_tensors", "OPTIONAL",
              "keep_float32", "expected_shapes")  # what `Graph.tensors` gives


def no_tensors(hp) -> list[str]:
    """The default of an optional tensor list: none."""
    return []


class _Required:
    def __repr__(self):
        return "<required>"


REQUIRED: Any = _Required()  # the default of a field every graph must give


@dataclass(frozen=True, kw_only=True, eq=False)  # one object per graph: compared and hashed by identity
class Graph:
    """One architecture's graph. Fields defaulting to REQUIRED must be given; `Graph(...)` names any
    that is missing, so an incomplete graph fails where it is declared."""

    name: str = REQUIRED  # the graph module's name, for messages
    # the GGUF `general.architecture` strings this graph runs: graph_for (runtime/graphs/__init__.py)
    # finds a file's graph by them, so a new graph module is found without a list to edit
    archs: tuple[str, ...] = REQUIRED
    # The family's tensor table as the graph reads it (archs/tensor_table.py GraphTensors): the tensor
    # lists, OPTIONAL, keep_float32 and expected_shapes below derive from it where not given.
    tensors: Any = None
    HParams: type = REQUIRED  # `HParams.from_kv(kv)`: hyperparameters from GGUF metadata (runtime/validate.py)
    main_tensors: Names = REQUIRED  # tensors the MAIN graph needs (hp -> GGUF names)
    mtp_tensors: Names = REQUIRED  # tensors the MTP graph needs
    optional_mtp_tensors: Names = REQUIRED  # MTP tensors used when the file has them
    keep_float32: Callable[[str], bool] = REQUIRED  # tensors loaded in float32 whatever the compute dtype
    main_layout: Callable[..., Any] = REQUIRED  # (hp, state_dtype) -> MemoryLayout of a MAIN context
    mtp_layout: Callable[[Any], Any] = REQUIRED  # hp -> MemoryLayout of an MTP context
    # (w, hp, tokens, batch, want_layers, gdn_mode, want_logits) -> (logits, post_norm, pre_norm, {J: rows})
    forward_main: Callable[..., tuple] = REQUIRED
    # (w, hp, tokens, hidden_in, batch[, kv_from]) -> (logits, nextn, pre_norm)
    forward_mtp: Callable[..., tuple] = REQUIRED
    # hp -> {GGUF name: ggml shape(s)} the load-time check holds each tensor to (runtime/validate.py), from
    # the family's tensor table (archs/tensor_table.py); a string dimension is one the file chooses
    expected_shapes: Callable[[Any], Mapping[str, Any]] = REQUIRED

    OPTIONAL: tuple[str, ...] = ()  # whole-model tensors used when present (an untied output head)
    optional_main_tensors: Names = no_tensors  # per-block MAIN tensors used when present (biases)
    # ENCODER graph (EAGLE-3's feature fusion); all three or none
    encoder_tensors: Names | None = None
    encoder_layout: Callable[[Any], Any] | None = None
    forward_encoder: Callable[..., Any] | None = None
    # (hp, file) -> the graph types a file serves; None: decided from its tensors (runtime/model.py)
    serves: Callable[..., set] | None = None
    vocab_size: Callable[[Any], int] | None = None  # rows of the vocabulary when the file has no token_embd
    KIND: str | None = None  # Model.kind of every file of this graph (a draft head); None: from its tensors
    MULTI_DEVICE: bool = False  # the forwards follow a placement of blocks over several devices
    SHAREABLE: tuple[str, ...] = SHARED_WITH_TARGET  # tensors reused from the target when identical
    FROM_TARGET: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # own name -> target candidates
    NEEDS_KV_FROM: bool = False  # attends to its target context's K/V (Context(kv_from=...))
    # decode steps and verifications replayable as CUDA graphs: the MAIN forward takes every address of a
    # batch from its BatchIndex and reads nothing on the host (runtime/step_graphs.py; tests/test_cuda_graphs*.py)
    CAPTURABLE: bool = False
    CHAINED_MTP: bool = False  # k MTP blocks, block i drafting position i (runtime/drafters/mtp.py)
    CHAIN_HIDDEN: str = "nextn"  # what a chained block passes on (CHAIN_STATES)
    MTP_ROWS: str = "llama.cpp"  # where each MTP block's rows begin (MTP_ROW_LAYOUTS)
    TARGET_HIDDEN: str = "post_norm"  # the target rows the MTP head reads (HIDDEN_STATES)
    check_values: Callable[..., None] | None = None  # (file, hp, needed) -> raises on bad tensor values
    check_hparams: Callable[..., None] | None = None  # (hp, kv) -> raises on inconsistent hyperparameters
    INTEGER_TENSORS: tuple[str, ...] = ()  # tensors read as integers (EAGLE-3's d2t); every other is float
    # KV keys (after `{arch}.`) read as per-layer lists, llama.cpp's get_key_or_arr (runtime/validate.py
    # check_kv); every other key must hold one value
    PER_LAYER_KEYS: tuple[str, ...] = ()

    def __post_init__(self):
        if self.tensors is not None:
            defaults = {f.name: f.default for f in fields(self)}
            for name in FROM_TABLE:
                if getattr(self, name) is defaults[name]:  # every field: the dataclass's own
                    object.__setattr__(self, name, getattr(self.tensors, name))
        missing = required_fields(self)
        if missing:
            raise SpecconvError(f"graph {self.name if self.name is not REQUIRED else '?'} does not declare "
                                f"{', '.join(missing)} (the Graph contract: runtime/graphs/contract.py)")
        if not (isinstance(self.archs, tuple) and self.archs and all(isinstance(a, str) and a for a in self.archs)):
            raise SpecconvError(f"graph {self.name}: archs must be a non-empty tuple of GGUF arch strings, "
                                f"not {self.archs!r}")
        for f in fields(self):
            value = getattr(self, f.name)  # every field: the dataclass's own
            if f.type.startswith(("Names", "Callable")) and value is not None and not callable(value):
                raise SpecconvError(f"graph {self.name}: {f.name} must be callable, not {value!r}")
        encoder = (self.encoder_tensors, self.encoder_layout, self.forward_encoder)
        if any(e is None for e in encoder) and any(e is not None for e in encoder):
            raise SpecconvError(f"graph {self.name}: an ENCODER graph declares encoder_tensors, encoder_layout "
                                "and forward_encoder together")
        for what, value, allowed in (("KIND", self.KIND, KINDS), ("CHAIN_HIDDEN", self.CHAIN_HIDDEN, CHAIN_STATES),
                                     ("MTP_ROWS", self.MTP_ROWS, MTP_ROW_LAYOUTS),
                                     ("TARGET_HIDDEN", self.TARGET_HIDDEN, HIDDEN_STATES)):
            if value not in allowed:
                raise SpecconvError(f"graph {self.name}: {what} is {value!r}; one of {allowed}")
        if not any("from_kv" in vars(base) for base in self.HParams.__mro__):
            raise SpecconvError(f"graph {self.name}: HParams {self.HParams!r} has no from_kv(kv) classmethod")


def required_fields(graph: Graph | None = None) -> list[str]:
    """The fields every graph must give; with `graph`, those it left out."""
    return [f.name for f in fields(Graph) if f.default is REQUIRED
            and (graph is None or getattr(graph, f.name) is REQUIRED)]
