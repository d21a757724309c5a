"""What the draft-head graphs declare alike (eagle3, dflash, gemma4_assistant): no MAIN graph, so no
main tensors and a main forward / layout that refuse with the head's own message; the vocabulary of
its hparams (the target's, which its logits span); none of its same-named tensors replaced by the
target's (SHAREABLE=()); served as an MTP graph unless it says otherwise.
"""

from __future__ import annotations

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.runtime.graphs.contract import Graph, no_tensors
from specconv.runtime.types import GraphType

# the target's embedding, and its head (or its tied embedding), for a head without its own
EMBEDDING_AND_HEAD = {names.TOKEN_EMBD: (names.TOKEN_EMBD,), names.OUTPUT: (names.OUTPUT, names.TOKEN_EMBD)}


def _vocab_size(hp) -> int:
    return hp.vocab_size


def _serves_mtp(hp, file) -> set[GraphType]:
    return {GraphType.MTP}


def graph(name: str, KIND: str, no_main: str, **head) -> Graph:
    """The Graph of a draft head of kind KIND; `no_main` says why it has no main graph (and how to run
    it); `head` holds the rest of its declaration (HParams, tensors, mtp_layout, forward_mtp, ...)."""
    def refuse(*args, **kwargs):
        raise SpecconvError(no_main)

    return Graph(**{
        "name": name, "KIND": KIND, "main_tensors": no_tensors, "main_layout": refuse, "forward_main": refuse,
        "vocab_size": _vocab_size, "serves": _serves_mtp, "SHAREABLE": (), **head})
