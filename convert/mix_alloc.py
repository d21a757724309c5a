"""Choosing one option per tensor group under a byte budget: the multiple-choice knapsack of the
auto mix (convert/auto_mix.py).

Each group has options (bytes, cost), cost being the measured KL divergence that option adds; a mix
takes one option per group, its bytes and costs summed. `allocate` returns the mix of least total
cost whose bytes fit the budget, exactly: it walks the groups keeping, for each total size reached,
only mixes no other mix beats on both bytes and cost (the Pareto front), so the front never holds
more entries than there are distinct sizes and the result is the optimum a brute force over every
combination would find (tests/convert/test_auto_mix.py checks both on random tables). Ties in cost
go to the smaller mix, then to the earlier options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specconv.archs.errors import SpecconvError


@dataclass(frozen=True)
class Option:
    bytes: int
    cost: float


def allocate(groups: Sequence[Sequence[Option]], budget: int) -> tuple[int, ...] | None:
    """The index of the chosen option of each group: least total cost with total bytes <= budget
    (None when even the smallest options do not fit)."""
    if any(not options for options in groups):
        raise SpecconvError("internal: a tensor group without options")
    # front: (bytes, cost, choices), sorted by bytes, cost strictly falling
    front: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for options in groups:
        merged = sorted(((b + o.bytes, c + o.cost, picks + (i,))
                         for b, c, picks in front for i, o in enumerate(options) if b + o.bytes <= budget),
                        key=lambda e: (e[0], e[1], e[2]))
        front = []
        for entry in merged:
            if not front or entry[1] < front[-1][1]:
                front.append(entry)
        if not front:
            return None
    best = min(front, key=lambda e: (e[1], e[0], e[2]))
    return best[2]


def brute_force(groups: Sequence[Sequence[Option]], budget: int) -> tuple[int, ...] | None:
    """Every combination (for tests: exponential in the number of groups)."""
    from itertools import product

    best = None
    for picks in product(*(range(len(g)) for g in groups)):
        size = sum(g[i].bytes for g, i in zip(groups, picks))
        if size > budget:
            continue
        key = (sum(g[i].cost for g, i in zip(groups, picks)), size, picks)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]
