"""The synthetic drafter (`--spec synthetic --acceptance A`): a drafter of set acceptance, for measurement.

It knows the target's own greedy continuation of the prompt (a plain run computed before the
speculative one, outside its timing) and proposes it, replacing each drafted token independently
by another token, drawn uniformly from the rest of the vocabulary, with probability 1 − A. At
temperature 0 every drafted token is therefore accepted with probability A, independently of the
others, while the history follows the reference: the per-position acceptance is A, A², A³, ...
and α = A in docs/reference/speculative.md §7. Drafting costs a random draw per token, so a run
isolates the target's cost of verification and rollback (the bound of speculative decoding at
drafter cost c = 0).

Its q rows are exactly the distribution a token is drawn from: A on the reference token and
(1 − A)/(V − 1) on every other one, so at temperature > 0 the loop verifies it with the Leviathan
rule, which keeps the target's distribution for any q. The reference is the greedy continuation,
so at T > 0, once the sampled history leaves it, the proposals (the reference's tokens at those
positions) are accepted at whatever rate the target gives them: A is the acceptance of greedy
decoding only.

Its statistics are labelled "synthetic" (the drafter name) everywhere; `specconv verify` never
builds it, so no head is ever credited with its acceptance.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.drafters.base import Draft, Drafter


class SyntheticDrafter(Drafter):
    name = "synthetic"
    needs_hidden = False
    synthetic = True  # reports and verify tell measurement drafters apart by this flag

    def __init__(self, reference: Sequence[int], vocab_size: int, acceptance: float, seed: int | None = 0):
        """`reference`: prompt + the target's greedy continuation (token ids)."""
        if not 0.0 <= float(acceptance) <= 1.0:
            raise SpecconvError(f"--acceptance must be in [0, 1], not {acceptance}")
        if vocab_size < 2:
            raise SpecconvError("the synthetic drafter needs a vocabulary of at least 2 tokens")
        self.reference = [int(t) for t in reference]
        self.vocab_size, self.acceptance = int(vocab_size), float(acceptance)
        self.gen = torch.Generator().manual_seed(0 if seed is None else int(seed))
        self.history: list[int] = []

    def start(self, prefix: Sequence[int], hidden=None) -> None:
        self.history = [int(t) for t in prefix]

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft:
        pos = len(self.history) + 1  # the position after id_last
        truth = self.reference[pos:pos + max(n_max, 0)]
        if not truth:
            return Draft([])
        n = len(truth)
        replace = torch.rand(n, generator=self.gen) >= self.acceptance
        # another token, uniform over the V - 1 others: an offset in 1..V-1 added modulo V
        offset = torch.randint(1, self.vocab_size, (n,), generator=self.gen)
        tokens = [(t + int(o)) % self.vocab_size if r else t for t, r, o in zip(truth, replace.tolist(), offset.tolist())]
        probs = None
        if temperature > 0:  # the exact q each token was drawn from, for the Leviathan rule
            probs = torch.full((n, self.vocab_size), (1.0 - self.acceptance) / (self.vocab_size - 1))
            probs[torch.arange(n), torch.tensor(truth)] = self.acceptance
        return Draft(tokens, probs)

    def accept(self, n_accepted: int, batch: Sequence[int], hidden=None) -> None:
        self.history.extend(int(t) for t in batch[:n_accepted + 1])

    def report(self, stats) -> dict:
        """The run's statistics say it was a measurement at a set acceptance, not a head's result."""
        return {"synthetic": True, "set_acceptance": self.acceptance}


def greedy_reference(target, prompt: Sequence[int], n_predict: int) -> list[int]:
    """prompt + the target's greedy continuation of n_predict tokens (the synthetic drafter's reference)."""
    from specconv.runtime.generate import generate

    return [int(t) for t in prompt] + list(generate(target, prompt, n_predict).tokens)
