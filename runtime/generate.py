"""Plain (non-speculative) decoding: evaluate the prompt, then one token per target evaluation.

`generate` is what `specconv generate` calls for `--spec none`; speculative variants return the same
`GenerationResult` so the command can print either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specconv.archs.errors import SpecconvError
from specconv.runtime.backend import evaluating_prompt_prefix
from specconv.runtime.context import Context
from specconv.runtime.context_pool import pooled
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
    prompt_seconds: float | None = None  # evaluation of the prompt (plain decoding)
    weight_bytes_read: int | None = None  # stored weight bytes dequantized by the whole run
    prefix_calls: int = 0  # decode calls on the prompt's prefix (all but its last token), at most one

    @property
    def target_forwards(self) -> int:
        """Target forwards that produced tokens: the decode calls less the one on the prompt's prefix."""
        return self.target_evaluations - self.prefix_calls

    def to_json(self) -> dict:
        n = len(self.tokens)
        out = {
            "prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "text": self.text,
            "n_generated": n, "seconds": self.seconds,
            "tokens_per_second": n / self.seconds if self.seconds > 0 else None,
            "target_evaluations": self.target_evaluations, **self.stats,
        }
        if self.prompt_seconds is not None:
            decode_s = self.seconds - self.prompt_seconds
            out.update(prompt_seconds=self.prompt_seconds,
                       prompt_tokens_per_second=_rate(len(self.prompt_tokens), self.prompt_seconds),
                       decode_tokens_per_second=_rate(n - 1, decode_s) if n > 1 else None)
        if self.weight_bytes_read is not None:
            out["weight_bytes_read"] = self.weight_bytes_read
        return out


def _rate(count: int, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def generate(model: Model, prompt_tokens: Sequence[int], n_predict: int, temperature: float = 0.0,
             seed: int | None = 0, stop_at_eos: bool = False, n_ctx: int | None = None,
             on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Greedy (T = 0) or sampled decoding of up to `n_predict` tokens after `prompt_tokens`; `on_token`
    is called with each token as it is chosen (a caller timing the steps)."""
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise SpecconvError("generate: the prompt is empty")
    if n_predict < 0:
        raise SpecconvError("generate: -n must be ≥ 0")
    with pooled(model, GraphType.MAIN, n_ctx or len(prompt) + n_predict + 1, 0, rollback="checkpoint",
                span=len(prompt) + n_predict) as ctx:
        return _generate(ctx, prompt, n_predict, temperature, seed, stop_at_eos, on_token)


def _generate(ctx: Context, prompt: list[int], n_predict: int, temperature: float, seed: int | None,
              stop_at_eos: bool, on_token: Callable[[int], None] | None) -> GenerationResult:
    model = ctx.model
    gen = make_generator(seed)
    out: list[int] = []
    counter = model.weights.counter
    counter.reset()
    start = time.perf_counter()
    prompt_seconds = 0.0
    if n_predict:
        # the prompt as speculative decoding splits it (runtime/speculative.py): all but its last token,
        # then that one alone, so that the two compute every position in batches of the same rows
        # (8-bit activation products turn a last-bit difference into another code: dq_dot_i8.inc)
        if len(prompt) > 1:
            with evaluating_prompt_prefix():
                ctx.decode(prompt[:-1], hidden=(), logits=None)
        logits = ctx.decode(prompt[-1:], hidden=(), logits="last").logits[-1]
        prompt_seconds = time.perf_counter() - start
        while True:
            token = sample(logits, temperature, gen)
            out.append(token)
            if on_token is not None:
                on_token(token)
            if len(out) >= n_predict or (stop_at_eos and model.tokenizer.is_end_of_generation(token)):
                break
            logits = ctx.decode([token], hidden=(), logits="last").logits[-1]
    seconds = time.perf_counter() - start
    return GenerationResult(prompt_tokens=prompt, tokens=out, text=decode_text(model, out), seconds=seconds,
                            target_evaluations=ctx.n_decode_calls, prompt_seconds=prompt_seconds,
                            weight_bytes_read=counter.reset(), prefix_calls=int(n_predict > 0 and len(prompt) > 1))


def decode_text(model: Model, tokens: Sequence[int]) -> str:
    """Detokenized text, or "" for a file without a usable tokenizer (ids are still reported)."""
    try:
        return model.tokenizer.decode(tokens)
    except SpecconvError:
        return ""
