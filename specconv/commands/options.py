"""Parameter types shared by the commands' numeric options: a value out of range is a usage error
(exit 2) naming the option, before anything is loaded. Floats must be finite: click's FloatRange
lets `nan` through every bound (comparisons with nan are false)."""

from __future__ import annotations

import math

import click

MAX_DRAFT = 64  # draft tokens per round; each is a snapshot of the recurrent state in the target's context


class FiniteFloatRange(click.FloatRange):
    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


NON_NEGATIVE = FiniteFloatRange(min=0.0)
PROBABILITY = FiniteFloatRange(0.0, 1.0)
SEED = click.IntRange(0, 2**64 - 1)  # what torch.Generator.manual_seed takes
DRAFT_COUNT = click.IntRange(0, MAX_DRAFT)


class DraftMaxType(click.ParamType):
    """--draft-max: a count 0..MAX_DRAFT, or "auto" (when `auto` is allowed)."""

    def __init__(self, minimum: int = 0, auto: bool = True):
        self.minimum, self.auto = minimum, auto
        self.name = f"{minimum}..{MAX_DRAFT}" + ("|auto" if auto else "")

    def convert(self, value, param, ctx):
        if value == "auto" and self.auto:
            return value
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a count nor auto" if self.auto else f"{value!r} is not a count",
                      param, ctx)
        if not self.minimum <= n <= MAX_DRAFT:
            self.fail(f"{n} is not in the range {self.minimum}..{MAX_DRAFT}", param, ctx)
        return n


def cuda_graphs_option(command):
    """--cuda-graphs / --no-cuda-graphs (generate, verify, demo): decode steps and verification batches
    replayed as CUDA graphs (runtime/step_graphs.py); neither flag: on for CUDA."""
    return click.option("--cuda-graphs/--no-cuda-graphs", "cuda_graphs", default=None,
                        help="Replay decode steps and verification batches as CUDA graphs (default: on for CUDA; "
                             "a capture that fails falls back to eager decoding with a warning).")(command)


def graphs_mode(flag: bool | None) -> str:
    """The runtime's CUDA-graphs mode for the flag: neither given -> auto."""
    return "auto" if flag is None else "on" if flag else "off"
