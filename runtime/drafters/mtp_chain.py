"""Chained MTP blocks drafting one position each, in the training recursion of the releases
(docs/reference/model-math.md §12; docs/mtp.md "Chained MTP heads").

Block j's row at position p is (x_p, s_j(p−1)): the token at p and a state one position back, where
s_0 = the target's hidden state (post- or pre-norm, as the graph's TARGET_HIDDEN says) and
s_j = block j−1's output (post- or pre-norm, CHAIN_HIDDEN). Every block predicts x_{p+1}; block j
sees target states up to p−1−j, so block j drafts draft position j. This is transformers' `MtpModel`
(each layer runs on the previous layer's outputs, input ids rolled by one) and DeepSeek-V3's MTP
recursion; vLLM and SGLang feed block 0 the same rows.

Layouts (`LAYOUTS`), i.e. where each block's rows begin (the graph's MTP_ROWS picks one):
* "shifted" (the releases', every chained-MTP graph's): block j has rows at positions ≥ j + 1, the
  first of them (x_{j+1}, s_j(j)); no row gets a made-up state.
* "llama.cpp": every block has rows from position 0, row 0 with a zero state (llama.cpp's one-block
  row convention, docs/reference/model-math.md §7.2, applied to each block of the recursion).

Memory. Each block has its own context (KV cache). After `start` / `accept` every block holds the
teacher-forced rows of the committed positions < T (T = the position of `id_last`), and
`pending[j]` = s_j(T−1), the state its row at T will read. `draft(id_last)` runs block j on the
rows at T..T+j: tokens [id_last, d_1..d_j], states [pending[j], block j−1's outputs at T..T+j−1]
(the rows block j−1 evaluated one step before); its last row gives d_{j+1}. Without `p_min` the
drafts stay on the device (block j's ids are id_last and blocks 0..j−1's argmaxes,
`Context.decode(ids_on_device=True)`) and are read once at the end; with it, once per block. `accept` removes every
row at positions ≥ T and writes the committed rows again, block by block, each block's outputs
feeding the next block's rows.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.context import Context
from specconv.runtime.drafters import Draft, best_candidate_probability
from specconv.runtime.device import upload
from specconv.runtime.types import GraphType

LAYOUTS = ("shifted", "llama.cpp")


def first_row_position(layout: str, block: int) -> int:
    """The position of block `block`'s first row in `layout`."""
    if layout not in LAYOUTS:
        raise SpecconvError(f"MTP row layout must be one of {LAYOUTS}, not {layout!r}")
    return block + 1 if layout == "shifted" else 0


class MtpChain:
    """The k blocks of a chained head, `views[j]` running block j (runtime/drafters/mtp.py)."""

    def __init__(self, views, n_ctx: int, chain_hidden: str, layout: str):
        self.first = [first_row_position(layout, j) for j in range(len(views))]
        self.ctxs = [Context(v, GraphType.MTP, n_ctx=n_ctx) for v in views]
        self.k = len(self.ctxs)
        self.chain_hidden = chain_hidden
        head = views[0]
        self.zero = torch.zeros(head.hidden_size, dtype=head.dtype, device=head.device)
        self.n_committed = 0
        self.pending = [self.zero] * self.k
        self.last_draft_logits: list[torch.Tensor] = []

    def start(self, prefix: Sequence[int], hidden: torch.Tensor | None) -> None:
        for ctx in self.ctxs:
            ctx.clear()
        self.n_committed = 0
        self.pending = [self.zero] * self.k
        if len(prefix):
            self._catch_up([int(t) for t in prefix], hidden)

    def _run(self, j: int, tokens: list[int] | torch.Tensor, states: torch.Tensor, logits: str | None):
        """Block j on rows at positions n_committed.. (those before its first row left out), token ids
        on the host or on the device (drafted ones): (logits of its last row or None, its outputs with
        one row per token: zeros where left out)."""
        pos0, first = self.n_committed, self.first[j]
        skip = max(0, min(first - pos0, len(tokens)))
        outs = self.zero.expand(len(tokens), -1).clone()
        if skip == len(tokens):
            return None, outs
        positions = list(range(pos0 + skip, pos0 + len(tokens)))
        out = self.ctxs[j].decode(tokens[skip:], positions=positions, hidden_in=states[skip:], logits=logits,
                                  ids_on_device=isinstance(tokens, torch.Tensor))
        outs[skip:] = out.hidden[self.chain_hidden].to(outs)
        return (out.logits[-1] if logits else None), outs

    def _catch_up(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Teacher-forced rows of committed tokens at positions n_committed.., `hidden` = their target rows."""
        if hidden is None or hidden.shape[0] < len(tokens):
            raise SpecconvError("MTP drafter: the target's hidden rows are missing")
        h = hidden[:len(tokens)].to(self.zero)
        states, last = torch.cat([self.pending[0][None], h[:-1]]), h[-1]
        for j in range(self.k):
            self.pending[j] = last.clone()
            if j + 1 < self.k:  # the last block's outputs feed nothing
                _, outs = self._run(j, tokens, states, None)
                states, last = torch.cat([self.pending[j + 1][None], outs[:-1]]), outs[-1]
            else:
                self._run(j, tokens, states, None)
        self.n_committed += len(tokens)

    def draft(self, id_last: int, n: int, p_min: float) -> Draft:
        pos0 = self.n_committed
        # block 0 takes id_last from the host; later blocks [id_last, d_1..d_j] on the device unless
        # p_min reads every draft anyway
        tokens, states = [int(id_last)], self.pending[0][None]
        on_device = None if p_min > 0 else upload(torch.tensor(tokens), self.zero.device)
        self.last_draft_logits = []
        for j in range(min(n, self.k)):
            self.ctxs[j].seq_rm(0, pos0)  # block j's rows of the previous draft
            logits, outs = self._run(j, tokens if on_device is None or j == 0 else on_device, states, "last")
            if logits is None or (p_min > 0 and best_candidate_probability(logits) < p_min):
                break
            self.last_draft_logits.append(logits)
            if on_device is None:
                tokens.append(int(logits.argmax()))
            else:
                on_device = torch.cat([on_device, logits.argmax(-1, keepdim=True)])
            if j + 1 < self.k:
                states = torch.cat([self.pending[j + 1][None], outs])
        return Draft(tokens[1:] if on_device is None else on_device[1:].tolist())  # one read without p_min

    def accept(self, n_accepted: int, batch: Sequence[int], hidden: torch.Tensor | None) -> None:
        for ctx in self.ctxs:
            ctx.seq_rm(0, self.n_committed)  # the draft's rows go before the committed ones are written
        self._catch_up([int(t) for t in batch[:n_accepted + 1]], hidden)

    def committed_rows(self) -> int:
        """The position after block 0's last row: n_committed once a row exists (shifted: from T = 2)."""
        return self.ctxs[0].n_past()
