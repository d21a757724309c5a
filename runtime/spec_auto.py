"""`--draft-max auto`: the draft length of each round chosen from measured acceptance and measured costs.

Cost model of one round that drafts k tokens (k = 0 is plain decoding):
    T_k = t(k+1) + k·c_tok + c_round    (k ≥ 1),    T_0 = t(1)
with t(n) the target's forward of n tokens, c_tok the drafter's seconds per drafted token and c_round
its per-round work (catch-up of the committed tokens). The round yields E_k = 1 + Σ_{m=1..k} Π_{i≤m} a_i
tokens, a_i being the conditional acceptance of draft position i. The chosen k maximises E_k / T_k
over 0..k_max (Leviathan et al.'s speed-up with the costs measured instead of assumed); k ≥ 1 only
when it promises at least MARGIN more tokens per second than plain decoding.

* t(n): calibrated once per model (`measure_target_costs`: forwards of 1..k_max+1 tokens after a
  short prefix, snapshot ring and rollback as in a real round; smoothed, `TargetCosts`), then corrected online: t(n) times the
  median observed / calibrated ratio of the last WINDOW rounds that ran n tokens, or, for a batch
  size not run in the last STALE rounds, the median ratio of the last rounds of any size (a machine
  that slows down moves every t(n)). Medians, not averages: on a shared machine one round slowed
  down by another process must not switch drafting off, and a correction that is no longer
  re-measured (the loop decodes plainly) expires instead of ruling out drafting for the rest of the run.
* c_tok, c_round: observed online (medians of the last WINDOW drafting rounds); zero until the first.
* a_i: decayed counts per position, shrunk towards the pooled acceptance, which starts at ½ with
  the weight of one token: the first rounds draft, and acceptance that does not pay drops k. The
  draft length grows with the evidence: k ≤ 2·(most drafts accepted in one round so far) + 1, so
  the first rounds draft one token, and a drafter that accepts nothing only ever costs rounds of
  one draft (t(2) − t(1) each) until its acceptance estimate drops below paying.
* k = 0: plain decoding. Every `probe` plain rounds a round with one draft token measures the
  acceptance again; the interval doubles (up to PROBE_MAX) while probes do not pay and returns
  to PROBE_MIN when drafting resumes. Acceptance counts decay only in drafting rounds, so plain
  stretches do not forget why drafting stopped.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from specconv.archs.errors import SpecconvError

AUTO_K_MAX = 8  # longest draft `--draft-max auto` considers (and the snapshot ring it needs)
PROBE_MIN, PROBE_MAX = 8, 64
DECAY = 0.97  # per drafting round: about the last 30 rounds count
PRIOR = 0.5  # pooled acceptance before any evidence, with the weight of PRIOR_WEIGHT tokens
PRIOR_WEIGHT = 1.0
WINDOW = 9  # recent observations an online timing takes the median of
STALE = 48  # rounds after which a batch size's own timings no longer correct its cost
MARGIN = 0.03  # predicted gain over plain decoding below which a round decodes plainly (timing noise)


@dataclass
class TargetCosts:
    """Seconds of one target forward of n tokens, n = 1..len(seconds) (index n-1), as measured, and
    the smoothed costs the choice uses (`t`): t(1) as measured, t(n ≥ 2) on a robust line through the
    measured n ≥ 2 (Theil-Sen: the median of pairwise slopes), never decreasing and never below t(1).
    One token may take another product path than several (a fused one-row kernel), hence the separate
    t(1); a line for the rest keeps one noisy timing from ruling a draft length in or out."""

    seconds: list[float]
    calibration_seconds: float = 0.0
    smoothed: list[float] = field(default_factory=list)

    def __post_init__(self):
        s = list(self.seconds)
        line = s[:1]
        if len(s) > 2:
            pts = list(enumerate(s[1:], start=2))
            slope = statistics.median((tj - ti) / (j - i) for (i, ti), (j, tj) in
                                      ((a, b) for x, a in enumerate(pts) for b in pts[x + 1:]))
            slope = max(slope, 0.0)
            base = statistics.median(t - slope * (n - 2) for n, t in pts)
            line += [base + slope * (n - 2) for n in range(2, len(s) + 1)]
        else:
            line = s
        for i in range(1, len(line)):  # a forward of more tokens never costs less
            line[i] = max(line[i], line[i - 1])
        self.smoothed = line

    def t(self, n: int) -> float:
        return self.smoothed[min(n, len(self.smoothed)) - 1]

    def ratios(self) -> list[float]:
        """t(n)/t(1) for n = 1..N."""
        return [s / self.seconds[0] for s in self.seconds]


def measure_target_costs(target, n_max: int, repeats: int = 2, prefix: int = 16, stat: str = "min",
                         budget_s: float = 2.0, max_repeats: int = 15) -> TargetCosts:
    """Time target forwards of 1..n_max tokens at position `prefix` of a scratch context (a snapshot ring
    that keeps every token's state, rolled back after each, as a verification round does). `stat`: "min"
    (steady costs for the auto choice) or "median" (reported figures), over at least `repeats`
    interleaved passes, more (up to `max_repeats`) while they fit in `budget_s` seconds: small models
    get enough passes for their millisecond timings to settle."""
    from specconv.runtime.context import Context
    from specconv.runtime.types import GraphType

    if n_max < 1:
        raise SpecconvError("cost measurement needs n_max ≥ 1")
    started = time.perf_counter()
    vocab = target.vocab_size
    ids = [(3 + 7919 * i) % vocab for i in range(prefix + n_max)]
    ctx = Context(target, GraphType.MAIN, n_ctx=prefix + n_max + 1, n_rs_seq=n_max)
    ctx.decode(ids[:prefix], hidden=(), logits=None)
    ctx.decode(ids[prefix:prefix + 1], hidden=(), logits="all")  # first-call costs out of the timings
    ctx.seq_rm(0, prefix)
    runs: list[list[float]] = [[] for _ in range(n_max)]
    done, wanted = 0, max(1, repeats)
    while done < wanted:
        done += 1
        for n in range(1, n_max + 1):
            t0 = time.perf_counter()
            ctx.decode(ids[prefix:prefix + n], hidden=(), logits="all")
            runs[n - 1].append(time.perf_counter() - t0)
            if not ctx.seq_rm(0, prefix):
                raise SpecconvError("cost measurement: rollback outside the snapshot ring")
        if done == 1:
            per_pass = sum(r[0] for r in runs)
            wanted = max(wanted, min(max_repeats, int(budget_s / per_pass) if per_pass > 0 else max_repeats))
    pick = min if stat == "min" else statistics.median
    return TargetCosts([pick(r) for r in runs], time.perf_counter() - started)


def cached_target_costs(target, n_max: int) -> TargetCosts:
    """`measure_target_costs` once per model object and n_max (the auto choice's calibration)."""
    cache = target.__dict__.setdefault("_spec_costs", {})
    if n_max not in cache:
        cache[n_max] = measure_target_costs(target, n_max, repeats=3)
    return cache[n_max]


@dataclass
class RoundPlan:
    """The draft length asked of one round, and why: "draft", "plain" or "probe" with `--draft-max auto`,
    None at a fixed draft_max (the round log records both)."""

    k: int
    mode: str | None = None

    def capped(self, n: int) -> "RoundPlan":
        """At most n drafts (the tokens still wanted, the room left in the context)."""
        return RoundPlan(max(0, min(self.k, n)), self.mode)


class FixedDraft:
    """`--draft-max K`: every round asks for K drafts; nothing is observed."""

    def __init__(self, k: int):
        self.k = k

    def next_round(self) -> RoundPlan:
        return RoundPlan(self.k)

    def observe_round(self, plan: RoundPlan, n_drafted: int, accepted: int, times) -> None:
        pass

    def report(self) -> dict:
        return {}


@dataclass
class AutoDraft:
    """The per-round choice of k for one speculative run (`next_round` / `observe_round` as the loop
    calls them, like `FixedDraft`)."""

    costs: TargetCosts
    k_max: int = AUTO_K_MAX
    acc: list[float] = field(default_factory=list)  # decayed accepted count per position
    tried: list[float] = field(default_factory=list)  # decayed verified count per position
    recent: deque = field(default_factory=lambda: deque(maxlen=2 * WINDOW))  # observed / calibrated, any n
    by_n: dict = field(default_factory=dict)  # n -> deque of (round number, observed / calibrated)
    draft_costs: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (c_tok, c_round) per drafting round
    rounds: int = 0
    plain_run: int = 0  # plain rounds since the last drafting round
    probe: int = PROBE_MIN
    deepest: int = 0  # most drafts accepted in one round so far

    def __post_init__(self):
        self.acc = [0.0] * self.k_max
        self.tried = [0.0] * self.k_max

    # ---- the model -------------------------------------------------------------------------------
    def pooled(self) -> float:
        return (sum(self.acc) + PRIOR * PRIOR_WEIGHT) / (sum(self.tried) + PRIOR_WEIGHT)

    def position_rates(self) -> list[float]:
        a = self.pooled()
        return [(self.acc[i] + a * 2.0) / (self.tried[i] + 2.0) for i in range(self.k_max)]

    @property
    def scale(self) -> float:
        """Observed / calibrated target time over the last rounds of any size (median)."""
        return statistics.median(self.recent) if self.recent else 1.0

    def rel(self, n: int) -> float:
        """Observed / calibrated time of forwards of n tokens: the median of this size's recent rounds."""
        mine = [r for i, r in self.by_n.get(n, ()) if self.rounds - i <= STALE]
        return statistics.median(mine) if len(mine) >= 3 else self.scale  # a median of 2 is a mean

    @property
    def c_tok(self) -> float:
        return statistics.median(c for c, _ in self.draft_costs) if self.draft_costs else 0.0

    @property
    def c_round(self) -> float:
        return statistics.median(c for _, c in self.draft_costs) if self.draft_costs else 0.0

    def target_seconds(self, n: int) -> float:
        """Predicted t(n): calibrated, corrected online, never below the prediction for fewer tokens."""
        return max(self.costs.t(m) * self.rel(m) for m in range(1, n + 1))

    def round_seconds(self, k: int) -> float:
        t = self.target_seconds(k + 1)
        return t if k == 0 else t + k * self.c_tok + self.c_round

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.position_rates()[:k]:
            run *= a
            total += run
        return total

    def best(self) -> tuple[int, float]:
        """(k, predicted tokens per second relative to plain) of the best k in 0..k_max."""
        plain = 1.0 / self.round_seconds(0)
        scores = [self.expected_tokens(k) / self.round_seconds(k) for k in range(self.k_max + 1)]
        k = max(range(len(scores)), key=lambda i: (scores[i], -i))
        if scores[k] < plain * (1.0 + MARGIN):  # drafting must promise a clear gain over plain decoding
            k = 0
        return k, scores[k] / plain

    # ---- per round ----------------------------------------------------------------------------------
    def choose(self) -> tuple[int, str]:
        """(k, why): "draft" (the model's best k ≥ 1), "plain" (k = 0 pays best), "probe" (one draft
        token after `probe` plain rounds)."""
        k, _ = self.best()
        if k > 0:  # the draft grows as evidence comes: at most 2·(most drafts accepted in a round) + 1
            return min(k, 2 * self.deepest + 1), "draft"
        if self.plain_run >= self.probe:
            return 1, "probe"
        return 0, "plain"

    def observe(self, k: int, accepted: int, mode: str, target_seconds: float, draft_seconds: float = 0.0,
                accept_seconds: float = 0.0) -> None:
        """What a round of k drafts did: accepted count, and the seconds of its parts."""
        self.rounds += 1
        calibrated = self.costs.t(k + 1)
        if calibrated > 0 and target_seconds > 0:
            ratio = target_seconds / calibrated
            self.recent.append(ratio)
            self.by_n.setdefault(k + 1, deque(maxlen=WINDOW)).append((self.rounds, ratio))
        if k == 0:
            self.plain_run += 1
            return
        for i in range(self.k_max):
            self.acc[i] *= DECAY
            self.tried[i] *= DECAY
        self.deepest = max(self.deepest, accepted)
        for i in range(min(k, accepted + 1)):  # positions verified: the accepted ones and the first rejected
            self.tried[i] += 1.0
            if i < accepted:
                self.acc[i] += 1.0
        self.draft_costs.append((draft_seconds / k, accept_seconds))
        if mode == "probe":
            self.plain_run = 0
            if self.best()[0] == 0:
                self.probe = min(self.probe * 2, PROBE_MAX)
                return
        self.probe = PROBE_MIN
        self.plain_run = 0

    def next_round(self) -> RoundPlan:
        return RoundPlan(*self.choose())

    def observe_round(self, plan: RoundPlan, n_drafted: int, accepted: int, times) -> None:
        """What the round of `plan` did: drafts verified, accepted, and its `RoundTimes` (runtime/spec_link.py)."""
        self.observe(n_drafted, accepted, plan.mode, times.target, draft_seconds=times.draft,
                     accept_seconds=times.accept)

    def report(self) -> dict:
        return {"auto": self.summary()}

    def summary(self) -> dict:
        k, gain = self.best()
        return {"k_max": self.k_max, "target_seconds": list(self.costs.seconds),
                "target_ratios": self.costs.ratios(), "target_seconds_smoothed": list(self.costs.smoothed), "calibration_seconds": self.costs.calibration_seconds,
                "time_scale": self.scale, "draft_seconds_per_token": self.c_tok, "draft_seconds_per_round": self.c_round,
                "pooled_acceptance": self.pooled(), "final_choice": k, "predicted_gain": gain}
