"""Acceptance statistics of a speculative run, with the definitions of docs/reference/speculative.md §6-§7.

* `rounds`: verification rounds (target evaluations of [id_last, d_1..d_n]), zero-draft rounds
  included; `drafts`: rounds with at least one draft token; `drafted`: draft tokens proposed and
  verified (drafts cut by `draft_min` are counted apart, in `discarded`); `accepted`: accepted
  draft tokens, never the correction / bonus token and never tokens re-evaluated by the
  checkpoint rollback.
* `acceptance_rate` = accepted / drafted; `acceptance_length` = 1 + accepted / drafts.
* `per_position[i]` = (rounds whose (i+1)-th draft was accepted) / drafts, for i < draft_max:
  cumulative, so non-increasing with Σ = acceptance_length - 1. `per_position_drafted[i]` counts
  the rounds that drafted at least i+1 tokens (so the conditional acceptance can be read off when
  rounds drafted fewer than draft_max).
* `target_forwards`: target evaluations after the prompt: every round, plus the re-decodes of the
  checkpoint rollback; `tokens_per_target_forward` = generated / target_forwards.
* `round_log` (emitted apart, as the `rounds` list of `speculative_generate`'s stats): one
  `{"drafted": [token ids verified], "accepted": j, "k": draft length asked}` per round, zero-draft
  rounds included, in order; with `--draft-max auto` also `"mode"`: "draft", "plain" or "probe"
  (runtime/spec_auto.py).
* `alpha` and `bound` (Leviathan et al.): alpha is the i.i.d. per-token acceptance probability for
  which the expected number of accepted drafts, given the draft length n_r each round actually
  proposed, equals the measured count: Σ_r Σ_{i=1..n_r} alpha^i = accepted. When every round
  drafted k tokens this is acceptance_rate = (alpha + … + alpha^k)/k (docs/reference/speculative.md §7).
  bound = E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) with k = draft_max: the expected tokens per
  target forward of full-length drafting at that alpha. With full-length drafts in every round it
  equals acceptance_length by construction; `uniform_drafts` says whether that was the case.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: int) -> float:
    """Leviathan's E = (1 - α^(k+1)) / (1 - α): tokens per target forward for i.i.d. acceptance α."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def solve_alpha(draft_lengths: Counter, accepted: int) -> float | None:
    """α in [0, 1] with Σ_r Σ_{i=1..n_r} α^i = accepted (bisection; the left side increases in α)."""
    total = sum(n * c for n, c in draft_lengths.items())
    if total == 0:
        return None

    def expected(a: float) -> float:
        return sum(c * sum(a ** i for i in range(1, n + 1)) for n, c in draft_lengths.items())

    if accepted >= total:
        return 1.0
    if accepted <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < accepted else (lo, mid)
    return (lo + hi) / 2


@dataclass
class SpecStats:
    draft_max: int
    rounds: int = 0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    discarded: int = 0
    generated: int = 0
    redecode_forwards: int = 0
    reevaluated_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    histogram: Counter = field(default_factory=Counter)  # accepted count -> rounds (drafting rounds)
    draft_lengths: Counter = field(default_factory=Counter)  # draft length -> rounds (drafting rounds)
    round_log: list[dict] = field(default_factory=list)  # per round: {"drafted": [ids], "accepted": j}

    def __post_init__(self):
        self.accepted_at = [0] * self.draft_max
        self.drafted_at = [0] * self.draft_max

    def record_round(self, n_drafted: int, n_accepted: int, drafted=None, k: int | None = None,
                     mode: str | None = None) -> None:
        """One verification round: n_drafted draft tokens (the ids `drafted`, when given), n_accepted of them kept.
        `k`: the draft length asked of the drafter that round (it may propose fewer); `mode`: why, for
        `--draft-max auto` ("draft", "plain", "probe"). Both go to the round log when given."""
        if not 0 <= n_accepted <= n_drafted <= self.draft_max:
            raise ValueError(f"impossible round: {n_accepted} accepted of {n_drafted} (draft_max {self.draft_max})")
        if drafted is not None and len(drafted) != n_drafted:
            raise ValueError(f"round of {n_drafted} drafts given {len(drafted)} token ids")
        self.rounds += 1
        entry = {"drafted": [int(t) for t in drafted] if drafted is not None else None, "accepted": int(n_accepted)}
        if k is not None:
            entry["k"] = int(k)
        if mode is not None:
            entry["mode"] = mode
        self.round_log.append(entry)
        if n_drafted == 0:
            return
        self.drafts += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.histogram[n_accepted] += 1
        self.draft_lengths[n_drafted] += 1
        for i in range(n_drafted):
            self.drafted_at[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    @classmethod
    def merge(cls, parts: "list[SpecStats]") -> "SpecStats":
        """The statistics of several runs with the same draft_max taken together (counts add up)."""
        if not parts:
            raise ValueError("nothing to merge")
        out = cls(parts[0].draft_max)
        for s in parts:
            if s.draft_max != out.draft_max:
                raise ValueError("merging statistics of different draft_max")
            for name in ("rounds", "drafts", "drafted", "accepted", "discarded", "generated", "redecode_forwards",
                         "reevaluated_tokens"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
            out.accepted_at = [a + b for a, b in zip(out.accepted_at, s.accepted_at)]
            out.drafted_at = [a + b for a, b in zip(out.drafted_at, s.drafted_at)]
            out.histogram.update(s.histogram)
            out.draft_lengths.update(s.draft_lengths)
            out.round_log += s.round_log
        return out

    def record_redecode(self, n_tokens: int) -> None:
        self.redecode_forwards += 1
        self.reevaluated_tokens += n_tokens

    @property
    def target_forwards(self) -> int:
        return self.rounds + self.redecode_forwards

    def to_json(self) -> dict:
        k = self.draft_max
        alpha = solve_alpha(self.draft_lengths, self.accepted)
        return {
            "rounds": self.rounds,
            "drafts": self.drafts,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "discarded": self.discarded,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "acceptance_length": 1 + self.accepted / self.drafts if self.drafts else None,
            "per_position": [a / self.drafts if self.drafts else 0.0 for a in self.accepted_at],
            "per_position_drafted": list(self.drafted_at),
            "acceptance_histogram": {str(a): c for a, c in sorted(self.histogram.items())},
            "target_forwards": self.target_forwards,
            "generated": self.generated,
            "tokens_per_target_forward": self.generated / self.target_forwards if self.target_forwards else None,
            "redecode_forwards": self.redecode_forwards,
            "reevaluated_tokens": self.reevaluated_tokens,
            "uniform_drafts": set(self.draft_lengths) == {k} if self.drafts else False,
            "alpha": alpha,
            "bound": expected_tokens(alpha, k) if alpha is not None else None,
        }


def per_block(stats: SpecStats, block_of_position) -> list[dict]:
    """Acceptance by MTP block: draft position i was drafted by block `block_of_position(i)` (chained
    heads: block i, none beyond their k blocks; one-block heads: block 0 everywhere). Per block: the positions it drafted, its
    draft tokens verified (`drafted`), those accepted (`accepted`), and `acceptance_rate` = accepted /
    drafted, the conditional rate of that block (a later position is verified only after the earlier
    ones were accepted)."""
    blocks: dict[int, dict] = {}
    for i in range(stats.draft_max):
        b = block_of_position(i)
        if b is None:  # a position no block drafts (chained heads cap drafts at their block count)
            continue
        row = blocks.setdefault(b, {"block": b, "positions": [], "drafted": 0, "accepted": 0})
        row["positions"].append(i)
        row["drafted"] += stats.drafted_at[i]
        row["accepted"] += stats.accepted_at[i]
    for row in blocks.values():
        row["acceptance_rate"] = row["accepted"] / row["drafted"] if row["drafted"] else None
    return [blocks[b] for b in sorted(blocks)]
