"""Per-position scores of a quant against the source (docs/compare.md §2-§3).

For a scored position with next token t, base log-probabilities a = log_softmax(source logits) and
quant log-probabilities b = log_softmax(quant logits), both in float64 from the models' float32 logits:

* nll_Q = −b_t, nll_base = −a_t (perplexities);
* KLD = Σ_v e^{a_v}·(a_v − b_v) over the whole vocabulary (llama.cpp computes the same sum from its
  uint16 store; here from the exact rows, or from specconv/compare/store.py with its stated bound);
* Δp = e^{b_t} − e^{a_t}, the probability of the correct token, quant minus base;
* same top: argmax of the quant's logits == argmax of the source's (first index on ties, as llama.cpp).

The base is given as rows with `target_logprob`, `argmax` and `kld(i0, i1, b)`: ExactRows from the
source's logits, or a store's StoredRows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

BLOCK_ROWS = 8  # rows scored at once: bounds the float64 temporaries to a few × 8 × vocabulary


class ExactRows:
    """The source's own logits [n, V] for n scored positions with next tokens `targets`."""

    def __init__(self, logits: torch.Tensor, targets):
        self.logits = logits
        targets = torch.as_tensor(targets, dtype=torch.long, device=logits.device)
        lp = [torch.log_softmax(logits[i:i + BLOCK_ROWS].to(torch.float64), dim=-1)
              .gather(-1, targets[i:i + BLOCK_ROWS, None])[:, 0] for i in range(0, logits.shape[0], BLOCK_ROWS)]
        self.target_logprob = torch.cat(lp).cpu().numpy() if lp else np.zeros(0)
        self.argmax = logits.argmax(dim=-1).cpu().numpy()

    def kld(self, i0: int, i1: int, quant_logprobs: torch.Tensor):
        a = torch.log_softmax(self.logits[i0:i1].to(torch.float64), dim=-1).to(quant_logprobs.device)
        k = (a.exp() * (a - quant_logprobs)).sum(-1)
        return k.cpu().numpy(), np.zeros(i1 - i0)


@dataclass
class RowScores:
    """One array entry per scored position."""

    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    kld_bound: np.ndarray  # bound on |kld − exact| (0 for exact rows)
    p_diff: np.ndarray
    same_top: np.ndarray

    @classmethod
    def concat(cls, parts: list["RowScores"]) -> "RowScores":
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)})


def score_rows(base, logits: torch.Tensor, targets) -> RowScores:
    """Scores of the quant's `logits` [n, V] (rows of the scored positions) against `base`."""
    n = logits.shape[0]
    targets = torch.as_tensor(targets, dtype=torch.long, device=logits.device)
    nll, kld, bound = np.zeros(n), np.zeros(n), np.zeros(n)
    for i0 in range(0, n, BLOCK_ROWS):
        i1 = min(n, i0 + BLOCK_ROWS)
        b = torch.log_softmax(logits[i0:i1].to(torch.float64), dim=-1)
        nll[i0:i1] = (-b.gather(-1, targets[i0:i1, None])[:, 0]).cpu().numpy()
        kld[i0:i1], bound[i0:i1] = base.kld(i0, i1, b)
    nll_base = -np.asarray(base.target_logprob, dtype=np.float64)
    same = logits.argmax(dim=-1).cpu().numpy() == np.asarray(base.argmax)
    return RowScores(nll=nll, nll_base=nll_base, kld=kld, kld_bound=bound, p_diff=np.exp(-nll) - np.exp(-nll_base),
                     same_top=same)
