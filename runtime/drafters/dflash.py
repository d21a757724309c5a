"""The DFlash drafter: a whole block of drafts from one forward of a block-diffusion model
(docs/dflash.md), as llama.cpp's draft-dflash does it.

Memory. The drafter's KV cache holds one row per committed target position p: the K/V of the
target's features at p (its `dflash.target_layers` inputs, concatenated), written by a context
injection (graph type MTP). The last committed token `id_last` has no features yet (the target has
not evaluated it), so it opens the block instead.
* `start(prefix, features)`: inject rows 0..m-1 of the prefix.
* `draft(id_last)`: one forward of the block [id_last, mask × (n_block - 1)] at positions
  n_past.. over the cached rows; block row i's logits give d_i (i ≥ 1). The block is not cached.
  n_block = 1 + min(draft_max, block_size - 1), fixed for the run like llama.cpp's n_max, because
  the block rows attend to each other: its length changes every row's logits.
* `accept(j, batch, features)`: the target kept batch[:j+1] = [id_last, d_1..d_j]; their feature
  rows are injected at their positions, so the cache again holds exactly the committed positions.
At T > 0 every block row is sampled from softmax(logits / T) and that row is the q the loop's
rejection sampling uses; p_min stops the draft at the first row whose best top-10 probability is
below it (llama.cpp's rule).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs import names
from specconv.archs.errors import SpecconvError
from specconv.runtime.context import Context
from specconv.runtime.drafters import best_candidate_probability, choose
from specconv.runtime.drafters.base import Draft, Drafter
from specconv.runtime.drafters.draft_model import check_reads_target
from specconv.runtime.graphs import dflash as graph
from specconv.runtime.model import Model
from specconv.runtime.types import GraphType


def check_drafter_fits_target(target: Model, head: Model) -> None:
    """A one-line SpecconvError when the DFlash file was not made for this target."""
    check_reads_target(target, head, "DFlash drafter", names.DFLASH, head.hparams.hidden_size)
    hp = head.hparams
    for name in graph.SELECTOR[:2] if hp.v2 else ():  # indexed by token ids of the (maybe shared) output
        rows = int(head.weights[name].shape[0]) if name in head.weights else head.vocab_size
        if rows != head.vocab_size:
            raise SpecconvError(f"{head.paths[0].name}: the DFlash2 drafter's {name} has {rows} token rows, but the "
                                f"vocabulary it drafts from has {head.vocab_size}: converted against another target")
    if not 0 <= hp.mask_token_id < head.vocab_size:
        raise SpecconvError(f"mask token {hp.mask_token_id} is outside the vocabulary [0, {head.vocab_size})")


class DFlashDrafter(Drafter):
    name = "dflash"
    needs_hidden = True

    def __init__(self, head: Model, target: Model, n_ctx: int, draft_max: int):
        check_drafter_fits_target(target, head)
        self.head, self.hp = head, head.hparams
        self.target_hidden = tuple(f"layer:{j}" for j in self.hp.target_layers)  # asked of the target
        self.ctx = Context(head, GraphType.MTP, n_ctx=n_ctx, n_rs_seq=0)
        self.n_block = 1 + max(1, min(draft_max, self.hp.block_size - 1))
        self.n_committed = 0

    def start(self, prefix: Sequence[int], features: torch.Tensor | None) -> None:
        self.ctx.clear()
        self.n_committed = 0
        self._inject(len(prefix), features)

    def _inject(self, n: int, features: torch.Tensor | None) -> None:
        """Feature rows of the next n committed positions into the cache."""
        if n == 0:
            return
        if features is None or features.shape[0] < n:
            raise SpecconvError("DFlash drafter: the target's layer hidden states are missing")
        pos = list(range(self.n_committed, self.n_committed + n))
        self.ctx.decode([self.hp.mask_token_id] * n, positions=pos, hidden_in=features[:n], logits=None)
        self.n_committed += n

    def block_forward(self, id_last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n_block, V], final-normed hidden) of the block [id_last, mask, ...] at n_committed.. ."""
        dev = self.head.device
        tokens = torch.tensor([int(id_last)] + [self.hp.mask_token_id] * (self.n_block - 1), device=dev)
        positions = torch.arange(self.n_committed, self.n_committed + self.n_block, device=dev)
        with torch.inference_mode():
            return graph.forward_block(self.head.weights, self.hp, tokens, positions, self.ctx.memory)

    def block_logits(self, id_last: int) -> torch.Tensor:
        return self.block_forward(id_last)[0]

    def selector_walk(self, id_last: int, n_max: int, p_min: float = 0.0) -> list[int]:
        """DFlash2: row by row, the candidate with the best score after the previous row's choice (row 1:
        after the anchor), as llama.cpp's draft-dflash walks the selector lattice; stops below p_min
        (the chosen score's softmax over the k candidates)."""
        logits, y = self.block_forward(id_last)
        with torch.inference_mode():
            cands, scores = graph.lattice(self.head.weights, self.hp, logits, y, int(id_last))
        tokens, prev = [], 0
        for i in range(1, min(n_max + 1, self.n_block)):
            row = scores[i][0 if i == 1 else prev]
            prev = int(row.argmax())
            if p_min > 0 and float(torch.softmax(row, -1)[prev]) < p_min:
                break
            tokens.append(int(cands[i, prev]))
        return tokens

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        if n_max <= 0:
            return Draft([])
        if self.hp.v2:  # deterministic at any temperature (llama.cpp's DFlash2 path): checked by sample-and-compare
            return Draft(self.selector_walk(id_last, n_max, p_min))
        logits = self.block_logits(id_last)
        tokens, rows = [], []
        for i in range(1, min(n_max + 1, self.n_block)):
            if p_min > 0 and best_candidate_probability(logits[i]) < p_min:
                break
            token, q = choose(logits[i], temperature, generator)
            tokens.append(token)
            rows.append(q)
        probs = torch.stack(rows) if tokens and rows[0] is not None else None
        return Draft(tokens, probs)

    def accept(self, n_accepted: int, batch: Sequence[int], features: torch.Tensor | None) -> None:
        self._inject(n_accepted + 1, features)
