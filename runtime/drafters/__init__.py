"""Drafters for speculative decoding. The contract the loop in `runtime/speculative.py` talks to is
the `Drafter` base (runtime/drafters/base.py): every drafter subclasses it and is listed in `DRAFTERS`.
The helpers below are the drafting steps several drafters share.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specconv.runtime.drafters.base import Draft, Drafter, register


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


from specconv.runtime.drafters.dflash import DFlashDrafter  # noqa: E402
from specconv.runtime.drafters.draft_model import DraftModelDrafter  # noqa: E402
from specconv.runtime.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from specconv.runtime.drafters.gemma4_assistant import Gemma4AssistantDrafter  # noqa: E402
from specconv.runtime.drafters.mtp import MtpDrafter  # noqa: E402
from specconv.runtime.drafters.ngram import NgramDrafter  # noqa: E402
from specconv.runtime.drafters.synthetic import SyntheticDrafter  # noqa: E402  (measurement only)

DRAFTERS: dict[str, type[Drafter]] = {}  # drafter name -> class: every drafter the runtime ships
for _cls in (DraftModelDrafter, Eagle3Drafter, DFlashDrafter, Gemma4AssistantDrafter, MtpDrafter, NgramDrafter,
             SyntheticDrafter):
    register(DRAFTERS, _cls)

__all__ = ["DRAFTERS", "DFlashDrafter", "Draft", "Drafter", "DraftModelDrafter", "Eagle3Drafter",
           "Gemma4AssistantDrafter", "MtpDrafter", "NgramDrafter", "SyntheticDrafter",
           "best_candidate_probability", "choose"]
