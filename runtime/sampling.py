"""Turning logits into tokens: greedy at temperature 0, else softmax(logits / T) sampling."""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampling distribution (float32) of one or more logit rows; one-hot argmax at T ≤ 0."""
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> int:
    """One token from one logit row. Greedy ties go to the lowest id (torch.argmax)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = probabilities(logits, temperature)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: the same seed draws the same tokens on every device."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0 if seed is None else seed)
    return gen
