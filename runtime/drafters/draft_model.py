"""A separate draft model (any GGUF the runtime can run as MAIN) with the target's vocabulary.

Its context holds the committed tokens it has evaluated. `draft` first evaluates what it has not
seen yet (tokens committed in the last round and `id_last`), then one token per step. After
verification `accept` cuts its memory back to the committed prefix through its own snapshot ring
(the draft model may itself be recurrent), so the next round starts from exactly the committed
tokens. At T > 0 tokens are sampled from softmax(logits / T) and those q rows go back to the loop
for Leviathan rejection sampling; at T = 0 drafting is greedy.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.runtime.context import Context
from specconv.runtime.drafters import best_candidate_probability, choose
from specconv.runtime.drafters.base import Draft, Drafter
from specconv.runtime.model import Model
from specconv.runtime.types import GraphType


def check_same_vocabulary(target: Model, draft: Model) -> None:
    """The draft must speak the target's token ids: same size and, when both carry one, same token list."""
    if target.vocab_size != draft.vocab_size:
        raise SpecconvError(f"draft model vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
    a, b = target.file.get("tokenizer.ggml.tokens"), draft.file.get("tokenizer.ggml.tokens")
    if a is not None and b is not None and list(a) != list(b):
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) if len(a) == len(b) else min(len(a), len(b))
        raise SpecconvError(f"draft model tokenizer differs from the target's (first at token id {first})")


def check_reads_target(target: Model, head: Model, kind: str, arch: str, width: int) -> None:
    """What a head that reads its target's hidden states (an EAGLE-3 head, a DFlash drafter) must
    share with that target: a one-line SpecconvError naming the first thing that differs."""
    article = "an" if kind[0] in "AEIOU" else "a"
    if head.arch != arch:
        raise SpecconvError(f"{head.paths[0].name} is not {article} {kind} (arch {head.arch})")
    layers = target.hparams.num_hidden_layers
    if width != target.hidden_size:
        raise SpecconvError(f"the {kind} reads target hidden states of width {width}, the target's are "
                            f"{target.hidden_size}: converted against another target")
    bad = [j for j in head.hparams.target_layers if not 0 <= j <= layers]
    if bad:
        raise SpecconvError(f"the {kind} reads target layer input {bad[0]}, but the target has {layers} layers "
                            f"(inputs 0..{layers}): converted against another target")
    check_same_vocabulary(target, head)
    for name in (names.TOKEN_EMBD, names.OUTPUT):
        if name not in head.weights:
            raise SpecconvError(f"the {kind} has no {name}: load it with load_model(..., share_from=target)")


class DraftModelDrafter(Drafter):
    name = "draft"
    needs_hidden = False

    def __init__(self, draft_model: Model, n_ctx: int, draft_max: int, target: Model | None = None):
        if target is not None:
            check_same_vocabulary(target, draft_model)
        self.model = draft_model
        # ring ≥ draft_max: a round evaluates at most draft_max tokens past the committed prefix
        self.ctx = Context(draft_model, GraphType.MAIN, n_ctx=n_ctx, n_rs_seq=max(draft_max, 1))
        self.history: list[int] = []  # committed tokens (target positions 0..)

    def start(self, prefix: Sequence[int], hidden=None) -> None:
        self.ctx.clear()
        self.history = [int(t) for t in prefix]

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        if n_max <= 0:
            return Draft([])
        seen = self.ctx.n_past()
        todo = self.history[seen:] + [int(id_last)]
        logits = self.ctx.decode(todo, hidden=(), logits="last").logits[-1]
        tokens, rows = [], []
        while True:
            if p_min > 0 and best_candidate_probability(logits) < p_min:
                break
            token, q = choose(logits, temperature, generator)
            tokens.append(token)
            rows.append(q)
            if len(tokens) >= n_max:
                break
            logits = self.ctx.decode([token], hidden=(), logits="last").logits[-1]
        probs = torch.stack(rows) if tokens and rows[0] is not None else None
        return Draft(tokens, probs)

    def accept(self, n_accepted: int, batch: Sequence[int], hidden=None) -> None:
        self.history.extend(int(t) for t in batch[:n_accepted + 1])
        if self.ctx.n_past() > len(self.history) and not self.ctx.seq_rm(0, len(self.history)):
            raise SpecconvError("draft model: rollback went past its snapshot ring")
