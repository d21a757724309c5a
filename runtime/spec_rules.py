"""Acceptance rules of speculative decoding (docs/reference/speculative.md §2-§3).

Each rule takes the target's verification rows for the batch [id_last, d_1..d_n] (row i is the
target's distribution for the token after batch[i]) and returns (j, t): the number of accepted
drafts and the one token the target adds (the correction at the first rejection, or the bonus
after row n). All random draws come from the given torch.Generator (CPU), so a seed reproduces a
run.

* greedy (T = 0): accept while argmax(row_{i-1}) == d_i; ties go to the lowest id (torch.argmax).
* Leviathan / Chen (T > 0, the drafter gives q): accept d_i when r < p(d_i)/q(d_i) with r ~ U[0,1);
  at the first rejection t ~ normalize(max(0, p - q)); bonus t ~ p_n. Exact for any q.
* sample and compare (T > 0, deterministic drafter, llama.cpp's rule): t_i ~ p_{i-1}; accept while
  t_i == d_i; the first t_i that differs is emitted. Exact; acceptance p(d_i).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.runtime.sampling import probabilities


def accept_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> tuple[int, int]:
    best = logits.argmax(-1).tolist()
    for i, d in enumerate(drafts):
        if best[i] != int(d):
            return i, best[i]
    return len(drafts), best[len(drafts)]


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def accept_compare(p: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None) -> tuple[int, int]:
    """p: [n+1, V] target probabilities (after temperature)."""
    for i, d in enumerate(drafts):
        t = _draw(p[i], generator)
        if t != int(d):
            return i, t
    return len(drafts), _draw(p[len(drafts)], generator)


def accept_leviathan(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int],
                     generator: torch.Generator | None) -> tuple[int, int]:
    """p: [n+1, V] target, q: [n, V] the distributions the drafts were sampled from."""
    for i, d in enumerate(drafts):
        d = int(d)
        r = float(torch.rand((), generator=generator))
        if r * float(q[i, d]) < float(p[i, d]):  # r < min(1, p/q) without dividing by q
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = float(residual.sum())
        # Σ max(0, p - q) = 0 only when p = q, where rejection has probability 0; guard rounding
        return i, _draw(residual / total if total > 0 else p[i], generator)
    return len(drafts), _draw(p[len(drafts)], generator)


def verify_rows(logits: torch.Tensor, drafts: Sequence[int], q: torch.Tensor | None, temperature: float,
                generator: torch.Generator | None) -> tuple[int, int, str]:
    """(j, t, rule name) for one verification batch."""
    if temperature <= 0:
        return (*accept_greedy(logits, drafts), "greedy")
    p = probabilities(logits.detach().cpu(), temperature)
    if q is None:
        return (*accept_compare(p, drafts, generator), "compare")
    return (*accept_leviathan(p, q.detach().cpu().float(), drafts, generator), "leviathan")
