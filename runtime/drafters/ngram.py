"""Prompt-lookup (n-gram) drafter: copy what followed the last occurrence of the current suffix.

For n from `ngram_max` down to `ngram_min`, the last n tokens of the history (committed tokens
plus `id_last`) are searched for earlier in the history; the tokens that followed the most recent
earlier match with a full continuation become the draft (up to n_max). No match gives an empty draft, a
zero-draft round (docs/reference/speculative.md §5.5). The drafter has no model and no probabilities: it is
deterministic, so the loop verifies it with the sample-and-compare rule at T > 0, and `p_min`
does not apply.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.drafters.base import Draft, Drafter


class NgramDrafter(Drafter):
    name = "ngram"
    needs_hidden = False

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise SpecconvError(f"n-gram sizes need 1 ≤ min ≤ max, got min={ngram_min} max={ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.history: list[int] = []

    def start(self, prefix: Sequence[int], hidden=None) -> None:
        self.history = [int(t) for t in prefix]

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        if n_max <= 0:
            return Draft([])
        seq = self.history + [int(id_last)]
        return Draft(lookup(seq, n_max, self.ngram_max, self.ngram_min))

    def accept(self, n_accepted: int, batch: Sequence[int], hidden=None) -> None:
        self.history.extend(int(t) for t in batch[:n_accepted + 1])


def lookup(seq: list[int], n_max: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Tokens following an earlier occurrence of the longest matching suffix of seq.

    Among the occurrences of that suffix the most recent one with n_max following tokens wins; when
    none has that many (a match right before the suffix, as in a repeated token, has only one), the
    one with the most followers, the most recent among equals.
    """
    size = len(seq)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = seq[size - n:]
        best: list[int] = []
        # start positions s of earlier occurrences: seq[s:s+n] == suffix, s + n < size
        for s in range(size - n - 1, -1, -1):
            if seq[s:s + n] == suffix:
                follow = seq[s + n:s + n + n_max]
                if len(follow) > len(best):
                    best = follow
                if len(best) == n_max:
                    break
        if best:
            return best
    return []
