"""Speculative round trips: greedy output identical to plain greedy decoding for every drafter in each
trial (draft_max, rollback, prompt) that verify runs (specconv/verify/run.py picks them), the
acceptance statistics of the drafter at the largest draft_max, and at T > 0 a distribution check of
the acceptance rule on real rows.

Distribution check (T > 0): for each prompt the target verifies one real draft once; the rule is
then applied `DIST_TRIALS` times to those same rows with fresh random numbers (a drafter with
probabilities redraws d_1 from its q each time). The first emitted token must follow the target's
p_0: Pearson's chi-square over categories with expected count ≥ 5 (the rest pooled), failing at
p < 1e-3 / number of prompts; the acceptance rate of d_1 must match its exact value (Σ min(p, q)
for Leviathan, p(d_1) for a deterministic drafter) within 5 binomial standard errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from specconv.runtime import Context, GraphType
from specconv.runtime.drafters import Drafter
from specconv.runtime.generate import generate
from specconv.runtime.model import Model
from specconv.runtime.sampling import make_generator, probabilities
from specconv.runtime.spec_link import start_prompt
from specconv.runtime.spec_rules import verify_rows
from specconv.runtime.speculative import SpecConfig, speculative_generate

DIST_TRIALS = 4000
DIST_ALPHA = 1e-3


@dataclass
class Divergence:
    prompt: int
    draft_max: int
    rollback: str
    position: int
    top2_gap: float | None

    def __str__(self):
        gap = f", top-2 logit gap there {self.top2_gap:.2e}" if self.top2_gap is not None else ""
        return (f"prompt {self.prompt}, draft_max {self.draft_max}, {self.rollback}: first different token "
                f"at generated position {self.position}{gap}")


@dataclass
class RunError:
    prompt: int
    draft_max: int
    rollback: str
    error: str

    def __str__(self):
        return f"prompt {self.prompt}, draft_max {self.draft_max}, {self.rollback}: the run failed: {self.error}"


def plain_runs(target: Model, prompts: list[list[int]], n: int):
    return [generate(target, p, n) for p in prompts]


def _gap(target: Model, prompt: list[int], tokens: list[int], at: int) -> float | None:
    seq = prompt + tokens[:at]
    logits = Context(target, GraphType.MAIN, n_ctx=len(seq)).decode(seq, hidden=(), logits="last").logits[-1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def divergence(target: Model, prompt: list[int], index: int, k: int, rollback: str, tokens, reference):
    """None when a speculative run gave the plain run's tokens, else where they first differ."""
    if list(tokens) == list(reference):
        return None
    at = next((j for j, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return Divergence(index, k, rollback, at, _gap(target, prompt, list(reference), at))


def greedy_round_trips(target: Model, make: Callable[[int], Drafter], prompts, plain, trials, n: int,
                       on_run: Callable[[int, str, int], None] = lambda k, rollback, i: None):
    """Each trial (draft_max k, rollback, prompt index): speculative greedy decoding with a fresh drafter must
    give the plain run's tokens (`plain`: the plain token lists). The first divergence or run error, else None."""
    for k, rollback, i in trials:
        try:
            res = speculative_generate(target, make(k), prompts[i], n, SpecConfig(draft_max=k, rollback=rollback))
        except Exception as exc:  # a crash is a failed round trip, reported like a divergence
            return RunError(i, k, rollback, f"{type(exc).__name__}: {exc}")
        on_run(k, rollback, i)
        found = divergence(target, prompts[i], i, k, rollback, res.tokens, plain[i])
        if found is not None:
            return found
    return None


def _pooled_chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    order = torch.argsort(p, descending=True)
    n = float(counts.sum())
    big = p[order] * n >= 5
    c = torch.cat([counts[order][big], counts[order][~big].sum().reshape(1)]).double()
    q = torch.cat([p[order][big], p[order][~big].sum().reshape(1)]).double()
    if float(q[-1]) * n < 5:  # merge a too-small tail into the last kept bin
        c, q = torch.cat([c[:-2], (c[-2] + c[-1]).reshape(1)]), torch.cat([q[:-2], (q[-2] + q[-1]).reshape(1)])
    if c.numel() < 2:
        return 1.0
    stat = float(((c - q * n) ** 2 / (q * n)).sum())
    df = torch.tensor((c.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def distribution_check(target: Model, drafter: Drafter, prompts, temperature: float, seed: int = 0,
                       on_prompt: Callable[[int], None] = lambda i: None):
    """[(chi-square p, measured acceptance, exact acceptance, rule)] per prompt with a draft."""
    results = []
    gen = make_generator(seed)
    for index, prompt in enumerate(prompts):
        ctx = Context(target, GraphType.MAIN, n_ctx=len(prompt) + 2, n_rs_seq=1)
        id_last = start_prompt(ctx, drafter, prompt)
        draft = drafter.draft(id_last, 1, 0.0, temperature, gen)
        d = list(draft.tokens) or [0]  # no draft (n-gram without a match): check the rule on token 0
        logits = ctx.decode([id_last] + d, hidden=(), logits="all").logits.detach().cpu()
        p0 = probabilities(logits[0], temperature)
        q0 = None if draft.probs is None else draft.probs[0].float().cpu()
        counts, accepted = torch.zeros(p0.shape[0]), 0
        for _ in range(DIST_TRIALS):
            d1 = d[0] if q0 is None else int(torch.multinomial(q0, 1, generator=gen))
            j, t, rule = verify_rows(logits[:2], [d1], None if q0 is None else q0[None], temperature, gen)
            counts[d1 if j else t] += 1
            accepted += j
        exact = float(p0[d[0]]) if q0 is None else float(torch.minimum(p0, q0).sum())
        results.append((_pooled_chi_square(counts, p0), accepted / DIST_TRIALS, exact, rule))
        on_prompt(index)
    return results


def acceptance_close(measured: float, exact: float, n: int = DIST_TRIALS) -> bool:
    return abs(measured - exact) <= 5 * math.sqrt(max(exact * (1 - exact), 1.0 / n) / n)
