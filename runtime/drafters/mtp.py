"""The MTP (nextn) drafter, following llama.cpp's row convention (model-math.md §7.2-§7.4).

Rows. The MTP row at position p is (x_p, h_{p-1}): the token at p and the target's post-norm hidden
state of the position before; row 0 gets the zero vector. Row p's logits predict x_{p+1}.

Memory. The head has its own attention cache. After every target batch it holds teacher-forced
rows for exactly the committed positions:
* `start` (prompt minus its last token): rows (x_0, 0), (x_1, h_0), ... ; `pending_h` = h of the
  last prompt row (zeros when that prefix is empty).
* `draft`: row (id_last, pos0, pending_h) → d_1, then (d_i, pos0+i, z_{i-1}) → d_{i+1}, where z is
  the head's own normed output (`hidden["nextn"]`, what llama.cpp feeds back). Greedy (top-1), so
  the draft is deterministic and has no q rows; `p_min` is tested on the softmax of the top 10.
* `accept(j, batch, h)`: the draft rows (positions ≥ pos0) are removed first, then the catch-up
  rows (batch[i], pos0+i, h_{i-1}) with h_{-1} = pending_h are written for the committed part of
  the batch (i = 0..j), and `pending_h` = h_j, the target's hidden state at the last accepted row.
  llama.cpp writes catch-up rows for the whole batch and then removes positions > pos0+j; the
  attention is causal, so writing only rows 0..j leaves the same cache.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.context import Context
from specconv.runtime.drafters import Draft, chain_drafts
from specconv.runtime.model import Model
from specconv.runtime.types import GraphType


class MtpDrafter:
    name = "mtp"
    needs_hidden = True

    def __init__(self, head: Model, n_ctx: int, target: Model | None = None):
        if target is not None and (target.n_vocab != head.n_vocab or target.n_embd != head.n_embd):
            raise SpecconvError(f"MTP head (vocab {head.n_vocab}, width {head.n_embd}) does not fit the target "
                                f"(vocab {target.n_vocab}, width {target.n_embd})")
        self.head = head
        self.ctx = Context(head, GraphType.MTP, n_ctx=n_ctx)
        self.n_committed = 0
        self.pending_h = torch.zeros(head.n_embd, dtype=head.dtype, device=head.device)

    def start(self, prefix: Sequence[int], hidden: torch.Tensor | None) -> None:
        self.ctx.clear()
        self.n_committed = 0
        self.pending_h = torch.zeros(self.head.n_embd, dtype=self.head.dtype, device=self.head.device)
        if len(prefix):
            self._catch_up(list(prefix), hidden)

    def _catch_up(self, tokens: list[int], hidden: torch.Tensor) -> None:
        """Teacher-forced rows for committed tokens at positions n_committed.., hidden = their target h."""
        if hidden is None or hidden.shape[0] < len(tokens):
            raise SpecconvError("MTP drafter: the target's post-norm hidden rows are missing")
        h = hidden[:len(tokens)].to(self.pending_h)
        rows = torch.cat([self.pending_h.reshape(1, -1), h[:-1]], dim=0)
        start = self.n_committed
        self.ctx.decode(tokens, positions=list(range(start, start + len(tokens))), hidden_in=rows, logits=None)
        self.pending_h = h[-1].clone()
        self.n_committed += len(tokens)

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        # llama.cpp's MTP drafter is greedy whatever the target's temperature (a one-hot q)
        positions = range(self.n_committed, self.n_committed + max(n_max, 0))
        return chain_drafts(self.ctx, int(id_last), self.pending_h, positions, p_min, 0.0, None)

    def accept(self, n_accepted: int, batch: Sequence[int], hidden: torch.Tensor | None) -> None:
        self.ctx.seq_rm(0, self.n_committed)  # draft rows go before the catch-up (§7.4 step 1)
        self._catch_up([int(t) for t in batch[:n_accepted + 1]], hidden)

    def committed_rows(self) -> int:
        """Positions held in the head's cache (equals the target's committed count after accept)."""
        return self.ctx.n_past()
