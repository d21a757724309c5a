"""The Gemma 4 assistant drafter (docs/reference/model-math.md §8; llama.cpp's draft-mtp with shared memory).

The assistant keeps no memory: its context reads the target context's K/V (`kv_from`), which after
every round holds exactly the committed positions 0..P-1. A round drafts from
(id_last at P, h = target post-norm hidden state of position P-1): each step's argmax is the next
draft, and its `post_projection` output replaces h; every step stays at position P (nothing is
written anywhere, so the query position never moves). `start` and `accept` only remember h of the
last committed position (`pending_h`). Greedy (top-1) drafts; `p_min` is judged on the softmax of
the top 10, as llama.cpp's draft sampler does.

It declares `reads_target_kv`: the speculative loop hands it the target context with `attach(ctx)`
before the prompt (runtime/drafters/base.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.runtime.context import Context
from specconv.runtime.drafters import chain_drafts
from specconv.runtime.drafters.base import Draft, Drafter
from specconv.runtime.drafters.draft_model import check_same_vocabulary
from specconv.runtime.graphs import gemma4_assistant as graph
from specconv.runtime.model import Model
from specconv.runtime.types import GraphType


def check_assistant_fits_target(target: Model, assistant: Model) -> None:
    if assistant.arch != names.GEMMA4_ASSISTANT:
        raise SpecconvError(f"{assistant.paths[0].name} is not a Gemma 4 assistant (arch {assistant.arch})")
    if target.arch != names.GEMMA4:
        raise SpecconvError(f"a Gemma 4 assistant drafts for a gemma4 target, not {target.arch}")
    graph.check_fits_target(assistant.hparams, target.hparams)
    check_same_vocabulary(target, assistant)
    if graph.TARGET_EMBD not in assistant.weights:
        raise SpecconvError("load the assistant with load_model(assistant, share_from=target): it embeds tokens "
                            "with the target's table")


class Gemma4AssistantDrafter(Drafter):
    name = "gemma4-assistant"
    needs_hidden = True
    reads_target_kv = True

    def __init__(self, assistant: Model, target: Model):
        check_assistant_fits_target(target, assistant)
        self.assistant, self.target = assistant, target
        self.ctx: Context | None = None
        self.target_ctx: Context | None = None
        self.pending_h: torch.Tensor | None = None

    def attach(self, target_ctx: Context) -> None:
        """The target context whose K/V the assistant reads (called by the speculative loop)."""
        if target_ctx.model is not self.target:
            raise SpecconvError("the assistant drafter was built for another target model")
        self.target_ctx = target_ctx
        self.ctx = Context(self.assistant, GraphType.MTP, kv_from=target_ctx)

    def start(self, prefix: Sequence[int], hidden: torch.Tensor | None) -> None:
        self.pending_h = None
        if len(prefix):
            if hidden is None or hidden.shape[0] < len(prefix):
                raise SpecconvError("assistant drafter: the target's post-norm hidden rows are missing")
            self.pending_h = hidden[len(prefix) - 1].clone()

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        if self.ctx is None:
            raise SpecconvError("assistant drafter: attach(target_ctx) first")
        if n_max <= 0 or self.pending_h is None:  # nothing committed yet: no hidden state to start from
            return Draft([])
        pos = self.target_ctx.n_past()
        token, h = int(id_last), self.pending_h
        # every step of a round stays at position P; nothing is written to any cache
        return chain_drafts(self.ctx, token, h, [pos] * n_max, p_min, temperature, generator)

    def accept(self, n_accepted: int, batch: Sequence[int], hidden: torch.Tensor | None) -> None:
        if hidden is None or hidden.shape[0] <= n_accepted:
            raise SpecconvError("assistant drafter: the target's post-norm hidden rows are missing")
        self.pending_h = hidden[n_accepted].clone()
