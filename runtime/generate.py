"""Plain (non-speculative) decoding: evaluate the prompt, then one token per target evaluation.

`generate` is what `specconv generate` calls for `--spec none`; speculative variants return the same
`GenerationResult` so the command can print either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from specconv.archs.errors import SpecconvError
from specconv.runtime.context import Context
from specconv.runtime.model import Model
from specconv.runtime.sampling import make_generator, sample
from specconv.runtime.types import GraphType


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]  # generated ids (the prompt excluded)
    text: str
    seconds: float  # wall time of prompt evaluation + generation
    target_evaluations: int  # decode calls on the target
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        n = len(self.tokens)
        return {
            "prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "text": self.text,
            "n_generated": n, "seconds": self.seconds,
            "tokens_per_second": n / self.seconds if self.seconds > 0 else None,
            "target_evaluations": self.target_evaluations, **self.stats,
        }


def generate(model: Model, prompt_tokens: Sequence[int], n_predict: int, temperature: float = 0.0,
             seed: int | None = 0, stop_at_eos: bool = False, n_ctx: int | None = None) -> GenerationResult:
    """Greedy (T = 0) or sampled decoding of up to `n_predict` tokens after `prompt_tokens`."""
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise SpecconvError("generate: the prompt is empty")
    if n_predict < 0:
        raise SpecconvError("generate: -n must be ≥ 0")
    ctx = Context(model, GraphType.MAIN, n_seq=1, n_ctx=n_ctx or len(prompt) + n_predict + 1, n_rs_seq=0,
                  rollback="checkpoint")
    gen = make_generator(seed)
    out: list[int] = []
    start = time.perf_counter()
    if n_predict:
        logits = ctx.decode(prompt, hidden=(), logits="last").logits[-1]
        while True:
            token = sample(logits, temperature, gen)
            out.append(token)
            if len(out) >= n_predict or (stop_at_eos and model.tokenizer.is_end_of_generation(token)):
                break
            logits = ctx.decode([token], hidden=(), logits="last").logits[-1]
    seconds = time.perf_counter() - start
    return GenerationResult(prompt_tokens=prompt, tokens=out, text=decode_text(model, out), seconds=seconds,
                            target_evaluations=ctx.n_decode_calls)


def decode_text(model: Model, tokens: Sequence[int]) -> str:
    """Detokenized text, or "" for a file without a usable tokenizer (ids are still reported)."""
    try:
        return model.tokenizer.decode(tokens)
    except SpecconvError:
        return ""
