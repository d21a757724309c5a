"""Speculative decoding: draft, verify with one target evaluation, accept, roll back, count.

One round (docs/reference/speculative.md §1): the drafter proposes d_1..d_n after `id_last` (the target's last
chosen token, not yet evaluated by it, at position pos0 = n_past); the target evaluates
[id_last, d_1..d_n] at pos0..pos0+n once; the rule of `spec_rules` accepts j drafts and adds one
target token t; the target's memory is cut back to positions ≤ pos0+j; the drafter is told.
The prompt is split as llama.cpp does: all but its last token are evaluated first (feeding the
drafter), the last one is the first round's id_last.

Rollback of the target's memory:
* "snapshot" (default): the context keeps a ring of n_rs_seq = draft_max recurrent states, one per
  verified token, so dropping rejected positions is `seq_rm`, an index change; no target token is
  evaluated twice.
* "checkpoint": the sequence state is saved before a verification with drafts; on a partial
  acceptance it is restored and the j+1 kept tokens are evaluated again. Those re-evaluated
  tokens are counted in `reevaluated_tokens` (and the extra evaluations in `target_forwards`),
  never as accepted drafts.
A round with zero drafts (no n-gram match, `draft_min`, `p_min`, the budget near n_predict) is an
ordinary one-token evaluation after whichever state the previous round promoted (§5.5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.context import ROLLBACK_MODES, Context
from specconv.runtime.context_pool import pooled
from specconv.runtime.drafters import Draft, Drafter
from specconv.runtime.generate import GenerationResult, decode_text
from specconv.runtime.model import Model
from specconv.runtime.sampling import make_generator
from specconv.runtime.spec_auto import AutoDraft, FixedDraft, RoundPlan, cached_target_costs
from specconv.runtime.spec_link import DrafterLink, start_prompt
from specconv.runtime.spec_rules import verify_rows
from specconv.runtime.spec_stats import SpecStats
from specconv.runtime.types import GraphType


@dataclass
class SpecConfig:
    draft_max: int = 3
    draft_min: int = 0  # a shorter draft is discarded (a zero-draft round), as llama.cpp's n_min
    p_min: float = 0.0  # drafting stops when the best candidate's top-10 probability is below it
    temperature: float = 0.0
    seed: int | None = 0
    rollback: str = "snapshot"
    stop_at_eos: bool = False
    auto: bool = False  # --draft-max auto: k chosen per round in 0..draft_max (runtime/spec_auto.py)

    def check(self) -> None:
        if self.draft_max < 0 or self.draft_min < 0:
            raise SpecconvError("--draft-max and --draft-min must be ≥ 0")
        if self.auto and self.draft_max < 1:
            raise SpecconvError("--draft-max auto needs a longest draft ≥ 1")
        if not 0.0 <= self.p_min <= 1.0:
            raise SpecconvError("--p-min must be in [0, 1]")
        if self.rollback not in ROLLBACK_MODES:
            raise SpecconvError(f"rollback must be one of {ROLLBACK_MODES}, not {self.rollback!r}")


@dataclass
class Round:
    """What one round did (for tests and tracing): its drafts verified at pos0.., the accepted count, the
    target's added token and the rule that chose."""

    pos0: int
    drafts: list[int]
    accepted: int
    token: int
    rule: str

    @property
    def tokens(self) -> list[int]:
        """The tokens the round committed after id_last: the accepted drafts and the target's token."""
        return self.drafts[:self.accepted] + [self.token]


def speculative_round(ctx: Context, link: DrafterLink, id_last: int, plan: RoundPlan, cfg: SpecConfig,
                      gen: torch.Generator | None, stats: SpecStats) -> Round:
    """One round (docs/reference/speculative.md §1): draft, verify, accept, roll back, account."""
    # draft: up to plan.k tokens after id_last; one shorter than draft_min is dropped (a plain round)
    draft = link.draft(id_last, plan.k, cfg.p_min, cfg.temperature, gen)
    if len(draft) < cfg.draft_min:
        stats.discarded += len(draft)
        draft = Draft([])
    pos0, drafts = ctx.n_past(), list(draft.tokens)
    batch = [id_last] + drafts

    # verify: the target evaluates [id_last, d_1..d_n] at pos0..pos0+n once
    saved = ctx.checkpoint(0) if cfg.rollback == "checkpoint" and drafts else None
    out = ctx.decode(batch, hidden=link.hidden, logits="all")

    # accept: j drafts and one target token t (the correction at the first rejection, or the bonus)
    j, t, rule = verify_rows(out.logits, drafts, draft.probs, cfg.temperature, gen)

    # roll back: the target keeps positions ≤ pos0 + j
    if j < len(drafts):
        if saved is not None:  # checkpoint: the state before the batch, and the kept tokens again
            ctx.restore(0, saved)
            ctx.decode(batch[:j + 1], hidden=(), logits=None)
            stats.record_redecode(j + 1)
        elif not ctx.seq_rm(0, pos0 + j + 1):
            raise SpecconvError(f"rollback of {len(drafts) - j} position(s) is outside the snapshot ring "
                                f"(n_rs_seq={ctx.n_rs_seq})")

    # account: the statistics, and the drafter told what the target committed
    stats.record_round(len(drafts), j, drafts, k=plan.k, mode=plan.mode)
    link.accept(j, batch, out.hidden, drafted=bool(drafts))
    return Round(pos0, drafts, j, t, rule)


def speculative_generate(target: Model, drafter: Drafter, prompt_tokens: Sequence[int], n_predict: int,
                         config: SpecConfig | None = None, n_ctx: int | None = None,
                         on_round: Callable[[Context, Round], None] | None = None) -> GenerationResult:
    """Generate up to n_predict tokens, one `speculative_round` after another. result.stats["speculative"]
    holds the statistics and result.stats["rounds"] each round's drafted token ids and accepted count
    (`generate --json` prints both)."""
    cfg = config or SpecConfig()
    cfg.check()
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise SpecconvError("generate: the prompt is empty")
    n_ctx = n_ctx or len(prompt) + n_predict + cfg.draft_max + 2
    # a pooled context: its CUDA graphs captured by an earlier call are replayed (context_pool.py)
    with pooled(target, GraphType.MAIN, n_ctx, cfg.draft_max, rollback=cfg.rollback,
                span=len(prompt) + n_predict) as ctx:
        lengths = (AutoDraft(cached_target_costs(target, cfg.draft_max + 1), k_max=cfg.draft_max) if cfg.auto
                   else FixedDraft(cfg.draft_max))
        link, stats, gen = DrafterLink(drafter, defer=cfg.auto), SpecStats(cfg.draft_max), make_generator(cfg.seed)
        out: list[int] = []
        start = time.perf_counter()
        prompt_seconds = 0.0  # the prompt minus its last token, and the drafter's start on it
        if n_predict > 0:
            id_last = start_prompt(ctx, drafter, prompt)
            prompt_seconds = time.perf_counter() - start
            while len(out) < n_predict:
                plan = lengths.next_round().capped(min(n_predict - len(out) - 1, n_ctx - ctx.n_past() - 2))
                t0 = time.perf_counter()
                r = speculative_round(ctx, link, id_last, plan, cfg, gen, stats)
                lengths.observe_round(plan, len(r.drafts), r.accepted, link.times(time.perf_counter() - t0))
                if on_round is not None:
                    on_round(ctx, r)
                new, ended = _until_end(r.tokens, target.tokenizer) if cfg.stop_at_eos else (r.tokens, False)
                out.extend(new)
                id_last = out[-1]
                if ended:
                    break
        seconds = time.perf_counter() - start
        stats.generated = len(out)
        result = GenerationResult(prompt_tokens=prompt, tokens=out, text=decode_text(target, out), seconds=seconds,
                                  target_evaluations=ctx.n_decode_calls,
                                  prefix_calls=int(n_predict > 0 and len(prompt) > 1),
                                  stats={"speculative": _report(stats, drafter, cfg, lengths, seconds, prompt_seconds),
                                         "rounds": [dict(r) for r in stats.round_log]})
        result.spec_stats = stats  # the raw counts, for merging runs (verify)
        return result


def _until_end(tokens: list[int], tokenizer) -> tuple[list[int], bool]:
    """The tokens up to and including the first end of generation, and whether there was one."""
    for i, x in enumerate(tokens):
        if tokenizer.is_end_of_generation(x):
            return tokens[:i + 1], True
    return tokens, False


def _report(stats: SpecStats, drafter: Drafter, cfg: SpecConfig, lengths: FixedDraft | AutoDraft, seconds: float,
            prompt_seconds: float) -> dict:
    """result.stats["speculative"]: the counts (runtime/spec_stats.py), the run's settings and timing, the
    drafter's own entries (synthetic, per-block) and the auto choice's summary."""
    report = stats.to_json()
    report.update(drafter=drafter.name, draft_max="auto" if cfg.auto else cfg.draft_max, draft_min=cfg.draft_min,
                  p_min=cfg.p_min, temperature=cfg.temperature, rollback=cfg.rollback, seconds=seconds,
                  prompt_seconds=prompt_seconds)
    report.update(drafter.report(stats))
    report.update(lengths.report())
    return report


def measure_speedup(target: Model, result: GenerationResult, temperature: float = 0.0, seed: int | None = 0) -> dict:
    """Plain decoding of the same prompt and length, timed in the same process: speed-up = plain / spec."""
    from specconv.runtime.generate import generate

    plain = generate(target, result.prompt_tokens, len(result.tokens), temperature=temperature, seed=seed)
    spec = result.stats["speculative"]
    spec["plain_seconds"] = plain.seconds
    spec["speedup"] = plain.seconds / result.seconds if result.seconds > 0 else None
    return {"plain": plain, "speedup": spec["speedup"]}


SPEC_KINDS = ("mtp", "draft", "eagle3", "dflash", "ngram", "synthetic")


def build_drafter(kind: str, target: Model, n_ctx: int, draft_max: int, mtp_path=None, draft_path=None,
                  reference: Sequence[int] | None = None, acceptance: float | None = None, seed: int | None = 0) -> Drafter:
    """A drafter by name: "mtp" (the target's embedded head or an --mtp sidecar), "draft" (a --draft GGUF),
    "eagle3" (an EAGLE-3 head given as --draft), "dflash" (a DFlash drafter given as --draft), "ngram" (prompt lookup),
    "synthetic" (measurement: the greedy `reference` continuation, each token kept with probability `acceptance`)."""
    from specconv.runtime.drafters import DraftModelDrafter, MtpDrafter, NgramDrafter
    from specconv.runtime.model import load_model

    if kind == "ngram":
        return NgramDrafter()
    if kind == "synthetic":
        from specconv.runtime.drafters.synthetic import SyntheticDrafter

        if reference is None or acceptance is None:
            raise SpecconvError("--spec synthetic needs --acceptance A (and the plain run's tokens as its reference)")
        return SyntheticDrafter(reference, target.vocab_size, acceptance, seed)
    if kind == "mtp":
        head = load_model(mtp_path, device=target.device, dtype=target.dtype, share_from=target) if mtp_path else target
        head.require(GraphType.MTP)
        return MtpDrafter(head, n_ctx, target)
    if kind == "eagle3":
        from specconv.runtime.drafters import Eagle3Drafter

        if not draft_path:
            raise SpecconvError("--spec eagle3 needs --draft EAGLE3_HEAD.gguf")
        head = load_model(draft_path, device=target.device, dtype=target.dtype, share_from=target)
        return Eagle3Drafter(head, target, n_ctx)
    if kind == "dflash":
        from specconv.runtime.drafters.dflash import DFlashDrafter

        if not draft_path:
            raise SpecconvError("--spec dflash needs --draft DFLASH.gguf")
        head = load_model(draft_path, device=target.device, dtype=target.dtype, share_from=target)
        return DFlashDrafter(head, target, n_ctx, draft_max)
    if kind == "draft":
        if not draft_path:
            raise SpecconvError("--spec draft needs --draft D.gguf")
        from specconv.runtime.gguf_file import GGUFModelFile
        from specconv.runtime.graphs import kind_of

        if kind_of(GGUFModelFile([draft_path]).arch) == "assistant":  # reads the target's K/V, no memory of its own
            from specconv.runtime.drafters import Gemma4AssistantDrafter

            assistant = load_model(draft_path, device=target.device, dtype=target.dtype, share_from=target)
            return Gemma4AssistantDrafter(assistant, target)
        return DraftModelDrafter(load_model(draft_path, device=target.device, dtype=target.dtype), n_ctx, draft_max, target)
    raise SpecconvError(f"unknown drafter {kind!r} (one of {', '.join(SPEC_KINDS)})")
