"""What the draft-head graphs declare alike (eagle3, dflash, gemma4_assistant): no MAIN graph, so no
main tensors and a main forward / layout that refuse with the head's own message; the tensor lists
of the blocks it runs, from its table (`HeadTensors`); the vocabulary of its hparams (the target's,
which its logits span); none of its same-named tensors replaced by the target's (SHAREABLE=());
served as an MTP graph unless it says otherwise.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs.contract import Graph
from specconv.runtime.types import GraphType

# the target's embedding, and its head (or its tied embedding), for a head without its own
EMBEDDING_AND_HEAD = {names.TOKEN_EMBD: (names.TOKEN_EMBD,), names.OUTPUT: (names.OUTPUT, names.TOKEN_EMBD)}


class HeadTensors:
    """A draft head's tensor lists (Graph(tensors=...)): what its MTP graph reads of its table
    (archs/tensor_table.py `graph_names`, the table's `graph` column) over the blocks `blocks(hp)`,
    their shapes, the F32 rule; no main tensors, no whole-model optional ones."""

    OPTIONAL: tuple[str, ...] = ()

    def __init__(self, table, blocks: Callable[[Any], Iterable[int]]):
        self.table, self.blocks = table, blocks
        self.keep_float32 = table.keeps_float32

    def main_tensors(self, hp) -> list[str]:
        return []

    def optional_main_tensors(self, hp) -> list[str]:
        return []

    def mtp_tensors(self, hp) -> list[str]:
        return self.table.graph_names(hp, self.blocks(hp), "mtp")

    def optional_mtp_tensors(self, hp) -> list[str]:
        return self.table.graph_names(hp, self.blocks(hp), "mtp", optional=True)

    def expected_shapes(self, hp) -> dict[str, tuple | list[tuple]]:
        return self.table.ggml_shapes(hp, self.blocks(hp))


def _vocab_size(hp) -> int:
    return hp.vocab_size


def _serves_mtp(hp, file) -> set[GraphType]:
    return {GraphType.MTP}


def graph(name: str, KIND: str, no_main: str, **head) -> Graph:
    """The Graph of a draft head of kind KIND; `no_main` says why it has no main graph (and how to run
    it); `head` holds the rest of its declaration (HParams, tensors (a HeadTensors), mtp_layout,
    forward_mtp, ...)."""
    def refuse(*args, **kwargs):
        raise SpecconvError(no_main)

    return Graph(**{
        "name": name, "KIND": KIND, "main_layout": refuse, "forward_main": refuse,
        "vocab_size": _vocab_size, "serves": _serves_mtp, "SHAREABLE": (), **head})
