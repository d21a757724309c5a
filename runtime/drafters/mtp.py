"""The MTP (nextn) drafter (docs/reference/model-math.md §7.2-§7.4, §12).

Rows. The MTP row at position p is (x_p, h_{p-1}): the token at p and the target's post-norm hidden
state of the position before (pre-norm for graphs with TARGET_HIDDEN = "pre_norm": step35). Row p's
logits predict x_{p+1}. Where the rows begin is the graph's MTP_ROWS: llama.cpp's convention (the
default) has a row 0 with the zero vector; "shifted" (the chained-MTP releases: hy_v3, step35, mimo2,
as vLLM, SGLang and transformers' `MtpModel` lay them) begins at row 1 = (x_1, h_0).

One block (qwen35, glm4moe, deepseek2, ...: the block is reused for every draft position).
Memory. The head has its own attention cache. After every target batch it holds teacher-forced
rows for exactly the committed positions:
* `start` (prompt minus its last token): rows (x_0, 0), (x_1, h_0), ... (shifted: from (x_1, h_0));
  `pending_h` = h of the last prompt row (zeros when that prefix is empty).
* `draft`: row (id_last, pos0, pending_h) → d_1, then (d_i, pos0+i, z_{i-1}) → d_{i+1}, where z is
  the head's own normed output (`hidden["nextn"]`, what llama.cpp feeds back). Greedy (top-1), so
  the draft is deterministic and has no q rows; `p_min` is tested on the softmax of the top 10.
  Without `p_min` no draft is read on the host until the last: each step's token is the previous
  step's argmax left on the device (`Context.decode(ids_on_device=True)`; `greedy_on_device`) and the k ids are
  read at once: one host sync per round instead of one per draft position (docs/runtime.md "CUDA
  graphs"). With `p_min` each step's probabilities decide whether to go on: reads at every step.
* `accept(j, batch, h)`: the draft rows (positions ≥ pos0) are removed first, then the catch-up
  rows (batch[i], pos0+i, h_{i-1}) with h_{-1} = pending_h are written for the committed part of
  the batch (i = 0..j), and `pending_h` = h_j, the target's hidden state at the last accepted row.
  llama.cpp writes catch-up rows for the whole batch and then removes positions > pos0+j; the
  attention is causal, so writing only rows 0..j leaves the same cache.

Chained blocks (graphs with CHAINED_MTP and k = nextn_predict_layers > 1: hy_v3, step35, mimo2)
run in the releases' training recursion, block j's rows reading block j−1's outputs, one context per
block (runtime/drafters/mtp_chain.py). Drafts are capped at k tokens per round: positions beyond the
block count are never drafted (no block is reused, as in llama.cpp, whose n_max = min(n_max, k)).
`last_draft_logits` keeps each draft position's logits (block i's for position i) for tests and
`block_of_position(i)` says which block drafted position i (per-block statistics).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.context import Context
from specconv.runtime.drafters import chain_drafts
from specconv.runtime.drafters.base import Draft, Drafter
from specconv.runtime.drafters.mtp_chain import MtpChain, first_row_position
from specconv.runtime.model import Model
from specconv.runtime.spec_stats import SpecStats, per_block
from specconv.runtime.types import GraphType


def greedy_on_device(ctx: Context, id_last: int, hidden: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
    """The greedy drafts at `positions` as a device tensor of ids, read nothing on the host: the first
    step's token is `id_last`, each later step's the previous step's argmax (decode with ids_on_device),
    each step's hidden row the previous step's normed output."""
    drafted = []
    for i, pos in enumerate(positions):
        row = hidden.reshape(1, -1)
        ids, on_device = ([id_last], False) if i == 0 else (drafted[-1], True)
        out = ctx.decode(ids, positions=[pos], hidden_in=row, logits="last", ids_on_device=on_device)
        drafted.append(out.logits.argmax(-1))
        hidden = out.hidden["nextn"][-1]
    return torch.cat(drafted) if drafted else torch.zeros(0, dtype=torch.long, device=hidden.device)


def block_view(head: Model, block: int) -> Model:
    """The head model running MTP block `block`: the same weights, hparams.mtp_block = block."""
    view = copy.copy(head)
    view.hparams = dataclasses.replace(head.hparams, mtp_block=block)
    return view


def n_chained_blocks(head: Model) -> int:
    """Blocks the drafter chains: nextn_predict_layers for graphs that support it, else 1."""
    if not head.graph.CHAINED_MTP:
        return 1
    return max(1, int(head.hparams.num_nextn_predict_layers))  # every chained graph's hparams count their blocks


def rows_layout(head: Model) -> str:
    """Where the head's rows begin (runtime/drafters/mtp_chain.py LAYOUTS): the graph's MTP_ROWS
    ("shifted" for the chained-MTP releases), else llama.cpp's row convention."""
    return head.graph.MTP_ROWS


def _block_of(i: int, k: int) -> int | None:
    """Chained heads: block i drafts position i and positions ≥ k are never drafted (None); a
    one-block head drafts every position with block 0."""
    return 0 if k == 1 else (int(i) if int(i) < k else None)


def block_of_position(head: Model):
    """i -> the block that drafts draft position i (0-based) with this head, or None."""
    k = n_chained_blocks(head)
    return lambda i: _block_of(i, k)


class MtpDrafter(Drafter):
    name = "mtp"
    needs_hidden = True

    def __init__(self, head: Model, n_ctx: int, target: Model | None = None, layout: str | None = None):
        if target is not None and (target.vocab_size != head.vocab_size or target.hidden_size != head.hidden_size):
            raise SpecconvError(f"MTP head (vocab {head.vocab_size}, width {head.hidden_size}) does not fit the target "
                                f"(vocab {target.vocab_size}, width {target.hidden_size})")
        self.head = head
        self.n_blocks = n_chained_blocks(head)
        # the target rows the head reads: post-norm, or pre-norm where the graph says so (step35)
        self.target_hidden = (head.graph.TARGET_HIDDEN,)
        self.layout = layout or rows_layout(head)
        self.chain = None
        if self.n_blocks > 1:
            self.chain = MtpChain([block_view(head, b) for b in range(self.n_blocks)], n_ctx,
                                  head.graph.CHAIN_HIDDEN, self.layout)
        else:
            self.first_row = first_row_position(self.layout, 0)
            self.ctx = Context(head, GraphType.MTP, n_ctx=n_ctx)
        self.n_committed = 0
        self.pending_h = torch.zeros(head.hidden_size, dtype=head.dtype, device=head.device)
        self._last_draft_logits: list[torch.Tensor] = []

    @property
    def last_draft_logits(self) -> list[torch.Tensor]:
        return self.chain.last_draft_logits if self.chain else self._last_draft_logits

    def block_of_position(self, i: int) -> int | None:
        """The block that drafts draft position i (0-based), None beyond k; statistics by block use it."""
        return _block_of(i, self.n_blocks)

    def report(self, stats: SpecStats) -> dict:
        """Acceptance by block (chained heads draft position i with block i; docs/mtp.md)."""
        return {"per_block": per_block(stats, self.block_of_position)}

    def start(self, prefix: Sequence[int], hidden: torch.Tensor | None) -> None:
        if self.chain:
            return self.chain.start(prefix, hidden)
        self.ctx.clear()
        self.n_committed = 0
        self.pending_h = torch.zeros(self.head.hidden_size, dtype=self.head.dtype, device=self.head.device)
        if len(prefix):
            self._catch_up(list(prefix), hidden)

    def _catch_up(self, tokens: list[int], hidden: torch.Tensor) -> None:
        """Teacher-forced rows for committed tokens at positions n_committed.., hidden = their target h."""
        if hidden is None or hidden.shape[0] < len(tokens):
            raise SpecconvError("MTP drafter: the target's post-norm hidden rows are missing")
        h = hidden[:len(tokens)].to(self.pending_h)
        rows = torch.cat([self.pending_h.reshape(1, -1), h[:-1]], dim=0)
        start = self.n_committed
        skip = max(0, min(self.first_row - start, len(tokens)))  # positions before the layout's first row
        if skip < len(tokens):
            self.ctx.decode(tokens[skip:], positions=list(range(start + skip, start + len(tokens))),
                            hidden_in=rows[skip:], logits=None)
        self.pending_h = h[-1].clone()
        self.n_committed += len(tokens)

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        # llama.cpp's MTP drafter is greedy whatever the target's temperature (a one-hot q)
        if self.chain:
            return self.chain.draft(int(id_last), max(n_max, 0), p_min)
        if self.n_committed < self.first_row:  # no target state for the first draft row yet
            return Draft([])
        positions = range(self.n_committed, self.n_committed + max(n_max, 0))
        if p_min > 0:  # each step's probabilities decide whether to go on: read per draft
            return chain_drafts(self.ctx, int(id_last), self.pending_h, positions, p_min, 0.0, None)
        return Draft(greedy_on_device(self.ctx, int(id_last), self.pending_h, positions).tolist())  # one read

    def accept(self, n_accepted: int, batch: Sequence[int], hidden: torch.Tensor | None) -> None:
        if self.chain:
            return self.chain.accept(n_accepted, batch, hidden)
        self.ctx.seq_rm(0, self.n_committed)  # draft rows go before the catch-up (§7.4 step 1)
        self._catch_up([int(t) for t in batch[:n_accepted + 1]], hidden)

    def committed_rows(self) -> int:
        """Positions held in the head's cache (equals the target's committed count after accept)."""
        return self.chain.committed_rows() if self.chain else self.ctx.n_past()
