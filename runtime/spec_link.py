"""The speculative loop's side of a drafter: what it is given of the target, the prompt start, and the
seconds spent in it.

* `hidden_request` / `drafter_rows`: the target hidden states a drafter declared it needs
  (runtime/drafters/base.py) and the rows it is handed, concatenated in that order.
* `start_prompt`: the prompt start shared by `speculative_generate` and `specconv verify`
  (specconv/verify/roundtrip.py), split as llama.cpp does: the drafter gets the target context
  (`attach`), the target evaluates all but the prompt's last token, the drafter starts on those
  positions, and the last token is the first round's `id_last`.
* `DrafterLink`: `draft` and `accept` as the round calls them, timed (`RoundTimes`, for
  `--draft-max auto`), with the deferred catch-up of auto mode (below).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from specconv.runtime.backend import evaluating_prompt_prefix
from specconv.runtime.drafters import Draft, Drafter


def hidden_request(drafter: Drafter) -> tuple[str, ...]:
    """The target hidden states a drafter needs: its `target_hidden` (EAGLE-3: "layer:J" for its three
    layers; default the post-norm rows); none when it needs no hidden states."""
    return tuple(drafter.target_hidden) if drafter.needs_hidden else ()


def drafter_rows(hidden: dict, want: Sequence[str]):
    """The rows given to the drafter: the requested hidden states concatenated in order (None if none)."""
    if not want:
        return None
    return hidden[want[0]] if len(want) == 1 else torch.cat([hidden[name] for name in want], dim=-1)


def start_prompt(ctx, drafter: Drafter, prompt: Sequence[int]) -> int:
    """Evaluate all but the prompt's last token in the target context `ctx` and start the drafter on
    them (after handing it `ctx`); returns the last token, the first round's id_last."""
    drafter.attach(ctx)
    prefix, want = list(prompt[:-1]), hidden_request(drafter)
    hidden = None
    if prefix:
        with evaluating_prompt_prefix():  # evaluated as plain decoding evaluates it (runtime/generate.py)
            hidden = drafter_rows(ctx.decode(prefix, hidden=want, logits=None).hidden, want)
    drafter.start(prefix, hidden)
    return int(prompt[-1])


@dataclass
class RoundTimes:
    """Seconds of one round's parts: the target's verification and rollback, drafting, and telling the
    drafter what was committed (with the deferred catch-up it did before drafting)."""

    target: float
    draft: float
    accept: float


class DrafterLink:
    """The drafter as the round calls it: `draft` (at most k tokens; none asked when k = 0) and `accept`
    (with the target's rows the drafter declared), each timed for the round in progress.

    With `defer` (auto mode), rounds without drafts are kept and told in one call before the next
    drafting round: a drafter with its own memory (an MTP head) then catches up on a plain stretch in
    one batched forward instead of one forward per token, and pays nothing while the loop decodes
    plainly."""

    def __init__(self, drafter: Drafter, defer: bool):
        self.drafter, self.defer = drafter, defer
        self.hidden = hidden_request(drafter)  # asked of the target in every verification
        self.tokens: list[int] = []  # deferred: committed tokens not told yet, and their rows
        self.rows: list = []
        self.draft_seconds = self.accept_seconds = 0.0

    def draft(self, id_last: int, k: int, p_min: float, temperature: float, generator) -> Draft:
        if k <= 0:
            return Draft([])
        t0 = time.perf_counter()
        self._flush()  # auto: the drafter catches up on the plain rounds before it drafts
        t1 = time.perf_counter()
        draft = self.drafter.draft(id_last, k, p_min, temperature, generator).truncated(k)
        self.accept_seconds += t1 - t0
        self.draft_seconds += time.perf_counter() - t1
        return draft

    def accept(self, j: int, batch: list[int], hidden: dict, drafted: bool) -> None:
        """The target kept batch[:j + 1]; `hidden` are its hidden states of the batch."""
        t0 = time.perf_counter()
        rows = drafter_rows(hidden, self.hidden)
        if self.defer:
            self.tokens += batch[:j + 1]
            self.rows.append(None if rows is None else rows[:j + 1])
            if drafted:
                self._flush()
        else:
            self.drafter.accept(j, batch, rows)
        self.accept_seconds += time.perf_counter() - t0

    def _flush(self) -> None:
        if not self.tokens:
            return
        rows = None if self.rows[0] is None else torch.cat(self.rows)
        tokens, self.tokens, self.rows = self.tokens, [], []
        self.drafter.accept(len(tokens) - 1, tokens, rows)

    def times(self, round_seconds: float) -> RoundTimes:
        """The parts of the round that took `round_seconds` (the target's is the rest); resets the clock."""
        draft, accept = self.draft_seconds, self.accept_seconds
        self.draft_seconds = self.accept_seconds = 0.0
        return RoundTimes(target=round_seconds - draft - accept, draft=draft, accept=accept)
