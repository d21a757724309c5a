"""The EAGLE-3 drafter: encoder over three target layers, one-layer decoder with its own KV cache,
drafts over a reduced vocabulary mapped to target ids (docs/reference/model-math.md §9, docs/reference/speculative.md §5.6).

Rows. The decoder row at position P takes (x_{P+1}, g_P), g_P = fc([H^(l1)_P ; H^(l2)_P ; H^(l3)_P])
from the target's layer inputs at P. The row of the last committed position waits for the next
token (`pending_g`), as in llama.cpp's draft-eagle3:
* `start(prefix, features)`: rows 0..m-2 of the prefix; pending = g_{m-1}.
* `draft(id_last)`: the seed row (id_last, pending_g) at position n_past-1 gives d_1; then
  (d_i, out_{i-1}) at n_past-1+i, where out is the decoder's pre-norm output, gives d_{i+1}.
* `accept(j, batch, features)`: the seed and draft rows go, then rows for the committed part of
  the batch are written (the pending row completed by batch[0], then (batch[i+1], g_{pos0+i})),
  and pending = g of the last accepted position. The cache then holds exactly rows 0..n_past-2.
The decoder's logits span the target vocabulary with -inf outside `d2t`, so greedy drafts are
always target ids and at T > 0 the draft distribution q is zero outside the draft vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.runtime.context import Context
from specconv.runtime.drafters import chain_drafts
from specconv.runtime.drafters.base import Draft, Drafter
from specconv.runtime.drafters.draft_model import check_reads_target
from specconv.runtime.graphs.ops import dense
from specconv.runtime.model import Model
from specconv.runtime.types import GraphType


def check_head_fits_target(target: Model, head: Model) -> None:
    """A one-line SpecconvError when the EAGLE-3 head was not made for this target."""
    check_reads_target(target, head, "EAGLE-3 head", names.EAGLE3, head.hparams.target_hidden_size)
    if head.weights[names.TOKEN_EMBD].shape[-1] != head.hidden_size:
        raise SpecconvError(f"the target's token embedding (width {head.weights[names.TOKEN_EMBD].shape[-1]}) does "
                            f"not fit the head (width {head.hidden_size}) and the head has none of its own")
    d2t = head.weights.get(names.EAGLE3_D2T)
    d2t = dense(d2t) if d2t is not None else None
    if d2t is not None and (int(d2t.min()) < 0 or int(d2t.max()) >= target.vocab_size):
        raise SpecconvError(f"d2t holds target ids outside [0, {target.vocab_size})")


class Eagle3Drafter(Drafter):
    name = "eagle3"
    needs_hidden = True

    def __init__(self, head: Model, target: Model, n_ctx: int):
        check_head_fits_target(target, head)
        self.head = head
        # what the speculative loop asks the target for, concatenated low ‖ mid ‖ high per row
        self.target_hidden = tuple(f"layer:{j}" for j in head.hparams.target_layers)
        self.encoder = Context(head, GraphType.ENCODER)
        self.ctx = Context(head, GraphType.MTP, n_ctx=n_ctx)
        self.n_committed = 0
        self.pending_g: torch.Tensor | None = None  # g of position n_committed-1, its row not written yet

    def start(self, prefix: Sequence[int], features: torch.Tensor | None) -> None:
        self.ctx.clear()
        self.n_committed, self.pending_g = 0, None
        if len(prefix):
            self._commit([int(t) for t in prefix], features)

    def _commit(self, tokens: list[int], features: torch.Tensor | None) -> None:
        """Committed tokens at positions n_committed.. with their target feature rows."""
        if features is None or features.shape[0] < len(tokens):
            raise SpecconvError("EAGLE-3 drafter: the target's layer hidden states are missing")
        g = self.encoder.encode(features[:len(tokens)]).hidden["g"]
        row_tokens, row_g = list(tokens[1:]), [g[:-1]]
        first = self.n_committed
        if self.pending_g is not None:  # the waiting row of position n_committed-1 gets its token now
            row_tokens.insert(0, tokens[0])
            row_g.insert(0, self.pending_g.reshape(1, -1))
            first -= 1
        if row_tokens:
            self.ctx.decode(row_tokens, positions=list(range(first, first + len(row_tokens))),
                            hidden_in=torch.cat(row_g), logits=None)
        self.pending_g = g[-1].clone()
        self.n_committed += len(tokens)

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        if n_max <= 0 or self.pending_g is None:  # no committed position yet: nothing to condition on
            return Draft([])
        pos, token, g = self.n_committed - 1, int(id_last), self.pending_g
        return chain_drafts(self.ctx, token, g, range(pos, pos + n_max), p_min, temperature, generator)

    def accept(self, n_accepted: int, batch: Sequence[int], features: torch.Tensor | None) -> None:
        # drop the seed row (position n_committed-1) and the draft rows; they are rewritten as committed rows
        self.ctx.seq_rm(0, self.n_committed - 1 if self.pending_g is not None else self.n_committed)
        self._commit([int(t) for t in batch[:n_accepted + 1]], features)

    def committed_rows(self) -> int:
        """Rows in the decoder cache (n_past - 1 after every round: the last one is pending)."""
        return self.ctx.n_past()
