"""Drafters for speculative decoding: the protocol the loop in `runtime/speculative.py` talks to.

A drafter proposes a chain of tokens after the target's last chosen token `id_last`. The loop tells
it what the target committed, so it can keep its own memory consistent with the target's:

* `start(prefix, hidden)`: the target evaluated and committed `prefix` at positions 0..len-1
  (the prompt minus its last token, llama.cpp's split); `hidden` are the target's post-norm rows
  of those positions (only when `needs_hidden`), or None.
* `draft(id_last, n_max, p_min, temperature, generator) -> Draft`: up to `n_max` tokens for the
  positions after `id_last`. `Draft.probs` is exactly the distribution each token was sampled
  from (Leviathan rejection sampling uses it); None means the drafter is deterministic (greedy,
  n-gram) and the loop verifies with the sample-and-compare rule, which is exact for it.
* `accept(n_accepted, batch, hidden)`: the target evaluated `batch = [id_last, d_1..d_n]` at
  positions n_past.. and kept `batch[:n_accepted + 1]`; `hidden` are its post-norm rows of the
  batch (when `needs_hidden`). Afterwards the drafter's memory must hold exactly the committed
  positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [n, n_vocab]: q_i, the distribution d_{i+1} was drawn from

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> "Draft":
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n])


@runtime_checkable
class Drafter(Protocol):
    name: str
    needs_hidden: bool  # the loop asks the target for post-norm hidden rows of every batch

    def start(self, prefix: Sequence[int], hidden: torch.Tensor | None) -> None: ...

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Draft: ...

    def accept(self, n_accepted: int, batch: Sequence[int], hidden: torch.Tensor | None) -> None: ...


TOP_K_P_MIN = 10  # llama.cpp's draft sampler keeps the top 10 candidates; p_min is judged among them


def best_candidate_probability(logits: torch.Tensor) -> float:
    """Probability of the best candidate in the softmax over the top-10 logits (llama.cpp's p_min test)."""
    top = torch.topk(logits.float(), min(TOP_K_P_MIN, logits.shape[-1])).values
    return float(torch.softmax(top, dim=-1)[0])


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
    """(token, q row or None): greedy at T ≤ 0 (deterministic, no q), else a sample from softmax(l/T)."""
    from specconv.runtime.sampling import probabilities

    if temperature <= 0:
        return int(logits.argmax()), None
    q = probabilities(logits.detach().cpu(), temperature)
    return int(torch.multinomial(q, 1, generator=generator)), q


def chain_drafts(ctx, token: int, hidden: torch.Tensor, positions: Sequence[int], p_min: float,
                 temperature: float, generator: torch.Generator | None) -> Draft:
    """Draft one token per position by feeding each step's `nextn` hidden output back in.

    Shared by the heads that chain on their own output (MTP, EAGLE-3, the Gemma 4 assistant); the
    caller decides the positions (advancing for MTP / EAGLE-3, fixed for the assistant).
    """
    tokens, rows = [], []
    for pos in positions:
        out = ctx.decode([token], positions=[pos], hidden_in=hidden.reshape(1, -1))
        logits = out.logits[-1]
        if p_min > 0 and best_candidate_probability(logits) < p_min:
            break
        token, q = choose(logits, temperature, generator)
        tokens.append(token)
        rows.append(q)
        hidden = out.hidden["nextn"][-1]
    probs = torch.stack(rows) if tokens and rows[0] is not None else None
    return Draft(tokens, probs)


from specconv.runtime.drafters.draft_model import DraftModelDrafter  # noqa: E402
from specconv.runtime.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from specconv.runtime.drafters.gemma4_assistant import Gemma4AssistantDrafter  # noqa: E402
from specconv.runtime.drafters.mtp import MtpDrafter  # noqa: E402
from specconv.runtime.drafters.ngram import NgramDrafter  # noqa: E402
from specconv.runtime.drafters.synthetic import SyntheticDrafter  # noqa: E402  (measurement only)

__all__ = ["Draft", "Drafter", "DraftModelDrafter", "Eagle3Drafter", "Gemma4AssistantDrafter", "MtpDrafter",
           "NgramDrafter", "SyntheticDrafter",
           "best_candidate_probability", "choose"]
