"""Acceptance statistics and wall-clock speed-up of speculative decoding, measured against plain decoding.

Greedy (T = 0) only, so every speculative run must reproduce the plain tokens exactly; `exact` says
whether it did. Timing is honest by construction:
* plain and speculative runs happen in the same process, on the same prompts and lengths;
* each repeat runs every configuration over every prompt, the configurations' order rotated from
  one repeat to the next (interleaved, so drifts in machine load hit all of them alike);
* a warm-up run of each kind comes first (one-time allocator and kernel costs);
* the reported time of a configuration is the median over repeats of its total over the prompts,
  and speed-up = median plain time / median speculative time.
The statistics (docs/reference/speculative.md §6) are merged over prompts; they do not depend on the repeat.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specconv.runtime.generate import GenerationResult, generate
from specconv.runtime.model import Model
from specconv.runtime.spec_stats import SpecStats
from specconv.runtime.speculative import SpecConfig, speculative_generate

PLAIN = (0, "plain")


def speedup_verdict(plain: Sequence[float], spec: Sequence[float], drafted: int | None = None) -> dict:
    """The speed-up of speculative over plain decoding from repeats of both, and whether it is above the
    measurement noise (its own repeats' spread).

    speedup = median(plain) / median(spec). Any pairing of one plain and one speculative repeat gives a
    ratio within `range` = [min(plain) / max(spec), max(plain) / min(spec)]. Verdict "gain" only when
    the whole range is above 1 (every speculative repeat faster than every plain one) with at least two
    repeats of each; "slower" when it is all below 1; else "none" (no measurable gain), with the
    `reason` when the repeats could not tell: one repeat, or nothing drafted (the run did plain
    decoding's work, so whatever the clock says there is no gain to measure)."""
    plain, spec = [float(x) for x in plain], [float(x) for x in spec]
    out = {"speedup": None, "range": None, "verdict": "none", "reason": None, "plain_seconds": plain,
           "spec_seconds": spec}
    if not plain or not spec or min(spec) <= 0:
        out["reason"] = "not measured"
        return out
    low, high = min(plain) / max(spec), max(plain) / min(spec)
    out.update(speedup=statistics.median(plain) / statistics.median(spec), range=[low, high])
    if drafted == 0:
        out["reason"] = "nothing was drafted"
    elif min(len(plain), len(spec)) < 2:
        out["reason"] = "one repeat cannot tell a gain from noise"
    else:
        out["verdict"] = "gain" if low > 1 else "slower" if high < 1 else "none"
    return out


def speedup_text(v: dict) -> str:
    """A `speedup_verdict` as one phrase: the speed-up stated as such only where it is above the noise."""
    if v["speedup"] is None:
        return "speed-up not measured"
    repeats = min(len(v["plain_seconds"]), len(v["spec_seconds"]))
    spread = f"{v['range'][0]:.2f}x-{v['range'][1]:.2f}x over {repeats} repeat{'s' * (repeats != 1)}"
    if v["verdict"] == "gain":
        return f"speed-up {v['speedup']:.2f}x (above the noise: every pair of repeats {spread})"
    if v["verdict"] == "slower":
        return f"slower than plain decoding: {v['speedup']:.2f}x (every pair of repeats {spread})"
    why = v["reason"] or f"within the noise: pairs of repeats {spread}"
    return f"no measurable gain ({why}; timing ratio {v['speedup']:.2f}x)"


@dataclass
class ConfigRun:
    draft_max: int
    rollback: str  # "plain" for plain decoding
    seconds: list[float] = field(default_factory=list)  # per repeat, summed over prompts
    results: list[GenerationResult] = field(default_factory=list)  # first repeat, one per prompt

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.results]

    def stats(self) -> SpecStats:
        return SpecStats.merge([r.spec_stats for r in self.results])


@dataclass
class Measurement:
    n_predict: int
    repeats: int
    prompts: list[str]  # where each prompt came from
    plain: ConfigRun
    runs: list[ConfigRun]

    def rows(self) -> list[dict]:
        """One dict per speculative configuration, with verify's key names plus the timing."""
        plain_tokens = self.plain.tokens
        plain_s = self.plain.median_seconds
        plain_forwards = sum(r.target_forwards for r in self.plain.results)
        out = []
        for run in self.runs:
            s = run.stats().to_json()
            diverged = [i for i, (a, b) in enumerate(zip(run.tokens, plain_tokens)) if a != b]
            s.update(draft_max=run.draft_max, rollback=run.rollback,
                     target_decode_calls=sum(r.target_evaluations for r in run.results), exact=not diverged, diverged_prompts=diverged,
                     seconds=run.median_seconds, plain_seconds=plain_s, plain_target_forwards=plain_forwards,
                     speedup=plain_s / run.median_seconds if run.median_seconds > 0 else None,
                     seconds_per_repeat=list(run.seconds), plain_seconds_per_repeat=list(self.plain.seconds),
                     timing=speedup_verdict(self.plain.seconds, run.seconds, drafted=s["drafted"]))
            out.append(s)
        return out

    def to_json(self) -> dict:
        return {"n_predict": self.n_predict, "repeats": self.repeats, "prompts": self.prompts,
                "plain_seconds": self.plain.median_seconds,
                "plain_target_forwards": sum(r.target_forwards for r in self.plain.results),
                "rows": self.rows()}


def _run_one(target: Model, make_drafter, prompt: Sequence[int], n_predict: int, draft_max: int, rollback: str):
    if rollback == "plain":
        return generate(target, prompt, n_predict)
    n_ctx = len(prompt) + n_predict + draft_max + 2
    cfg = SpecConfig(draft_max=draft_max, rollback=rollback)
    return speculative_generate(target, make_drafter(n_ctx), prompt, n_predict, cfg, n_ctx=n_ctx)


def measure(target: Model, make_drafter: Callable[[int], object], prompts: Sequence[Sequence[int]], n_predict: int,
            configs: Sequence[tuple[int, str]], repeats: int = 3, labels: Sequence[str] | None = None,
            progress: Callable[[str], None] = lambda msg: None) -> Measurement:
    """Run plain decoding and each (draft_max, rollback) configuration over `prompts`, `repeats` times.

    make_drafter(n_ctx) returns a fresh drafter (its construction is not timed, like the target
    context's in both loops)."""
    if repeats < 1 or not prompts or n_predict < 1:
        raise ValueError("need repeats ≥ 1, a prompt and n_predict ≥ 1")
    runs = {c: ConfigRun(*c) for c in [PLAIN, *configs]}
    order = list(runs)
    # warm-up: one short run of each kind, outside the timings
    _run_one(target, make_drafter, prompts[0][:4], 2, 0, "plain")
    for k, rollback in configs[:1]:
        _run_one(target, make_drafter, prompts[0][:4], 2, k, rollback)
    for rep in range(repeats):
        shift = rep % len(order)
        for key in order[shift:] + order[:shift]:
            run = runs[key]
            progress(f"repeat {rep + 1}/{repeats}: " + ("plain" if key == PLAIN else f"draft_max {key[0]} {key[1]}"))
            total = 0.0
            for i, prompt in enumerate(prompts):
                result = _run_one(target, make_drafter, prompt, n_predict, *key)
                total += result.seconds
                if rep == 0:
                    run.results.append(result)
            run.seconds.append(total)
    return Measurement(n_predict=n_predict, repeats=repeats, prompts=list(labels or [str(i) for i in range(len(prompts))]),
                       plain=runs[PLAIN], runs=[runs[c] for c in configs])
