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
from specconv.runtime.drafters import Draft, Drafter
from specconv.runtime.generate import GenerationResult, decode_text
from specconv.runtime.model import Model
from specconv.runtime.sampling import make_generator
from specconv.runtime.spec_auto import AutoDraft, cached_target_costs
from specconv.runtime.spec_rules import verify_rows
from specconv.runtime.spec_stats import SpecStats, per_block
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
    """What one round did (for tests and tracing)."""

    pos0: int
    drafts: list[int]
    accepted: int
    token: int
    rule: str


def hidden_request(drafter: Drafter) -> tuple[str, ...]:
    """The target hidden states a drafter needs: its `target_hidden` (EAGLE-3: "layer:J" for its three
    layers), else the post-norm rows; none when it needs no hidden states."""
    if not drafter.needs_hidden:
        return ()
    return tuple(getattr(drafter, "target_hidden", ("post_norm",)))


def drafter_rows(hidden: dict, want: Sequence[str]):
    """The rows given to the drafter: the requested hidden states concatenated in order (None if none)."""
    if not want:
        return None
    return hidden[want[0]] if len(want) == 1 else torch.cat([hidden[name] for name in want], dim=-1)


def speculative_generate(target: Model, drafter: Drafter, prompt_tokens: Sequence[int], n_predict: int,
                         config: SpecConfig | None = None, n_ctx: int | None = None,
                         on_round: Callable[[Context, Round], None] | None = None) -> GenerationResult:
    """Generate up to n_predict tokens. result.stats["speculative"] holds the statistics and
    result.stats["rounds"] each round's drafted token ids and accepted count (`generate --json` prints both)."""
    cfg = config or SpecConfig()
    cfg.check()
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise SpecconvError("generate: the prompt is empty")
    n_ctx = n_ctx or len(prompt) + n_predict + cfg.draft_max + 2
    ctx = Context(target, GraphType.MAIN, n_ctx=n_ctx, n_rs_seq=cfg.draft_max, rollback=cfg.rollback)
    if hasattr(drafter, "attach"):  # drafters that read the target's K/V (Gemma 4 assistant)
        drafter.attach(ctx)
    want = hidden_request(drafter)
    gen = make_generator(cfg.seed)
    stats = SpecStats(cfg.draft_max)
    auto = AutoDraft(cached_target_costs(target, cfg.draft_max + 1), k_max=cfg.draft_max) if cfg.auto else None
    told = _Teller(drafter, defer=auto is not None)
    out_tokens: list[int] = []
    start = time.perf_counter()
    prompt_seconds = 0.0  # the prompt minus its last token, and the drafter's start on it
    if n_predict > 0:
        prefix, id_last = prompt[:-1], prompt[-1]
        hidden = drafter_rows(ctx.decode(prefix, hidden=want, logits=None).hidden, want) if prefix else None
        drafter.start(prefix, hidden)
        prompt_seconds = time.perf_counter() - start
        while len(out_tokens) < n_predict:
            pos0 = ctx.n_past()
            k, mode = auto.choose() if auto else (cfg.draft_max, None)
            budget = max(0, min(k, n_predict - len(out_tokens) - 1, n_ctx - pos0 - 2))
            t0 = time.perf_counter()
            if budget:
                told.flush()  # auto: the drafter catches up on the plain rounds before it drafts
            t1 = time.perf_counter()
            draft = drafter.draft(id_last, budget, cfg.p_min, cfg.temperature, gen) if budget else Draft([])
            draft = draft.truncated(budget)
            if len(draft) < cfg.draft_min:
                stats.discarded += len(draft)
                draft = Draft([])
            t2 = time.perf_counter()
            new, stop, j, times = _round(ctx, told, id_last, draft, cfg, gen, stats, want, on_round, budget, mode)
            if auto is not None:
                auto.observe(len(draft.tokens), j, mode, times[0], draft_seconds=t2 - t1,
                             accept_seconds=t1 - t0 + times[1])
            out_tokens.extend(new)
            id_last = out_tokens[-1]
            if stop:
                break
    seconds = time.perf_counter() - start
    stats.generated = len(out_tokens)
    report = stats.to_json()
    report.update(drafter=drafter.name, draft_max="auto" if cfg.auto else cfg.draft_max, draft_min=cfg.draft_min,
                  p_min=cfg.p_min, temperature=cfg.temperature, rollback=cfg.rollback, seconds=seconds,
                  prompt_seconds=prompt_seconds)
    if getattr(drafter, "synthetic", False):  # a measurement drafter, never a head's result
        report.update(synthetic=True, set_acceptance=drafter.acceptance)
    if auto is not None:
        report["auto"] = auto.summary()
    if hasattr(drafter, "block_of_position"):  # MTP heads: acceptance by block (chained heads, docs/mtp.md)
        report["per_block"] = per_block(stats, drafter.block_of_position)
    result = GenerationResult(prompt_tokens=prompt, tokens=out_tokens, text=decode_text(target, out_tokens),
                              seconds=seconds, target_evaluations=ctx.n_decode_calls,
                              prefix_calls=int(n_predict > 0 and len(prompt) > 1),
                              stats={"speculative": report, "rounds": [dict(r) for r in stats.round_log]})
    result.spec_stats = stats  # the raw counts, for merging runs (verify)
    return result


class _Teller:
    """Tells the drafter what the target committed (`Drafter.accept`). With `defer` (auto mode), rounds
    without drafts are kept and told in one call before the next drafting round: a drafter with its
    own memory (an MTP head) then catches up on a plain stretch in one batched forward instead of one
    forward per token, and pays nothing while the loop decodes plainly."""

    def __init__(self, drafter: Drafter, defer: bool):
        self.drafter, self.defer = drafter, defer
        self.tokens: list[int] = []
        self.rows: list = []

    def tell(self, j: int, batch: list[int], rows, drafted: bool) -> None:
        if not self.defer:
            self.drafter.accept(j, batch, rows)
            return
        self.tokens += batch[:j + 1]
        self.rows.append(None if rows is None else rows[:j + 1])
        if drafted:
            self.flush()

    def flush(self) -> None:
        if not self.tokens:
            return
        rows = None if self.rows[0] is None else torch.cat(self.rows)
        tokens, self.tokens, self.rows = self.tokens, [], []
        self.drafter.accept(len(tokens) - 1, tokens, rows)


def _round(ctx: Context, told: _Teller, id_last: int, draft: Draft, cfg: SpecConfig, gen, stats: SpecStats,
           want, on_round, k: int | None = None, mode: str | None = None):
    """One verification round: (new tokens, stop, accepted count, (target seconds, accept seconds))."""
    pos0, drafts = ctx.n_past(), list(draft.tokens)
    saved = ctx.checkpoint(0) if cfg.rollback == "checkpoint" and drafts else None
    batch = [id_last] + drafts
    t0 = time.perf_counter()
    out = ctx.decode(batch, hidden=want, logits="all")
    j, t, rule = verify_rows(out.logits, drafts, draft.probs, cfg.temperature, gen)
    t1 = time.perf_counter()
    stats.record_round(len(drafts), j, drafts, k=k, mode=mode)
    if j < len(drafts):
        if saved is not None:
            ctx.restore(0, saved)
            ctx.decode(batch[:j + 1], hidden=(), logits=None)
            stats.record_redecode(j + 1)
        elif not ctx.seq_rm(0, pos0 + j + 1):
            raise SpecconvError(f"rollback of {len(drafts) - j} position(s) is outside the snapshot ring "
                                f"(n_rs_seq={ctx.n_rs_seq})")
    t2 = time.perf_counter()
    told.tell(j, batch, drafter_rows(out.hidden, want), bool(drafts))
    t3 = time.perf_counter()
    if on_round is not None:
        on_round(ctx, Round(pos0, drafts, j, t, rule))
    new = drafts[:j] + [t]
    times = (t1 - t0 + t2 - t1, t3 - t2)
    if cfg.stop_at_eos:
        tok = ctx.model.tokenizer
        for i, x in enumerate(new):
            if tok.is_end_of_generation(x):
                return new[:i + 1], True, j, times
    return new, False, j, times


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
        return SyntheticDrafter(reference, target.n_vocab, acceptance, seed)
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

        if GGUFModelFile([draft_path]).arch == "gemma4-assistant":  # reads the target's K/V, no memory of its own
            from specconv.runtime.drafters import Gemma4AssistantDrafter

            assistant = load_model(draft_path, device=target.device, dtype=target.dtype, share_from=target)
            return Gemma4AssistantDrafter(assistant, target)
        return DraftModelDrafter(load_model(draft_path, device=target.device, dtype=target.dtype), n_ctx, draft_max, target)
    raise SpecconvError(f"unknown drafter {kind!r} (one of {', '.join(SPEC_KINDS)})")
