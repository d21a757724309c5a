"""Speculative decoding on a tiny Qwen3.5 GGUF: greedy output identical to plain decoding, rollback state
equal to a recomputation, the MTP drafter's cache equal to a fresh teacher-forced evaluation
(checked against transformers' MtpModel), and the statistics' algebra.

Random tiny MTP heads accept almost nothing, so acceptance at every depth is produced by a scripted
drafter that knows the plain greedy continuation and proposes a planned number of right tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import Draft, DraftModelDrafter, Drafter, MtpDrafter, NgramDrafter
from specconv.runtime.generate import generate
from specconv.runtime.spec_stats import expected_tokens
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures import speculative_models

# repeated n-grams so prompt lookup finds matches; lengths 1, short, long
PROMPTS = [[7], [5, 17, 42, 99, 3, 5, 17, 42], [11, 300, 12, 64, 128, 11, 300, 12, 64, 250, 7, 77, 11, 300]]
N = 12


@pytest.fixture(scope="module")
def target():
    return load_model(speculative_models.gguf("embedded"), device="cpu")


@pytest.fixture(scope="module")
def target64():
    """float64 weights and state: rounding ~1e-12, so a state comparison separates bugs from noise
    (the tiny random Gated DeltaNet layers amplify float32 rounding to ~1e-5, docs/testing.md)."""
    return load_model(speculative_models.gguf("embedded"), device="cpu", dtype=torch.float64)


@pytest.fixture(scope="module")
def plain(target):
    return {tuple(p): generate(target, p, N).tokens for p in PROMPTS}


class ScriptedDrafter(Drafter):
    """Proposes, per round, `plan[r] = (n, good)`: the first `good` of n tokens are the plain greedy
    continuation, the rest are wrong (the right token + 1). Deterministic, no probabilities."""

    name = "scripted"
    needs_hidden = False

    def __init__(self, oracle: list[int], plan: list[tuple[int, int]], vocab_size: int):
        self.oracle, self.plan, self.vocab_size = oracle, plan, vocab_size
        self.round = 0
        self.committed = 0

    def start(self, prefix, hidden=None):
        self.committed, self.round = len(prefix), 0

    def draft(self, id_last, n_max, p_min=0.0, temperature=0.0, generator=None):
        n, good = self.plan[self.round % len(self.plan)]
        self.round += 1
        base = self.committed + 1  # oracle index of d_1
        out = [self.oracle[base + i] if i < good else (self.oracle[base + i] + 1) % self.vocab_size
               for i in range(min(n, n_max, len(self.oracle) - base))]
        return Draft(out)

    def accept(self, n_accepted, batch, hidden=None):
        self.committed += n_accepted + 1


def make_drafter(kind, target, k):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "mtp":
        return MtpDrafter(target, 128, target)
    return DraftModelDrafter(target, 128, k, target)


@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
@pytest.mark.parametrize("kind", ["ngram", "mtp", "draft"])
def test_greedy_speculative_equals_plain(target, plain, kind, rollback):
    accepted = drafted = 0
    for k in range(1, 9):
        for p in PROMPTS:
            res = speculative_generate(target, make_drafter(kind, target, k), p, N, SpecConfig(draft_max=k, rollback=rollback))
            assert res.tokens == plain[tuple(p)], (kind, rollback, k, p)
            s = res.stats["speculative"]
            accepted, drafted = accepted + s["accepted"], drafted + s["drafted"]
            if rollback == "snapshot":
                assert s["reevaluated_tokens"] == 0
    print(f"{kind}/{rollback}: draft_max 1..8 x {len(PROMPTS)} prompts identical to plain; "
          f"accepted {accepted}/{drafted} drafts")
    assert drafted > 0


def test_identical_draft_model_accepts_everything(target, plain):
    for k in (1, 3, 5):
        n = 3 * (k + 1)  # whole rounds only: the budget never shortens a draft
        p = PROMPTS[1]
        res = speculative_generate(target, DraftModelDrafter(target, 128, k, target), p, n, SpecConfig(draft_max=k))
        s = res.stats["speculative"]
        print(f"identical draft, k={k}: acceptance {s['acceptance_rate']}, tokens/forward {s['tokens_per_target_forward']}")
        assert res.tokens == generate(target, p, n).tokens
        assert s["acceptance_rate"] == 1.0 and s["per_position"] == [1.0] * k
        assert s["tokens_per_target_forward"] == k + 1 and s["target_forwards"] == 3


def _fresh_state(target, committed):
    ctx = Context(target, GraphType.MAIN, n_ctx=len(committed) + 1, n_rs_seq=0, rollback="checkpoint")
    out = ctx.decode(committed, hidden=("post_norm",))
    return ctx, out


def _rec_layers(ctx):
    return ctx.memory.layout.rec_layers


# rounds alternate multi-accept and zero-draft, with every partial j and full acceptance
PLAN = [(3, 3), (0, 0), (2, 2), (0, 0), (4, 1), (4, 0), (4, 4), (0, 0), (4, 2), (1, 1), (0, 0), (4, 3)]


@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_rollback_state_equals_recompute(target64, rollback):
    target = target64
    p = PROMPTS[1]
    expected = generate(target, p, 32).tokens  # room for the whole plan (28 tokens) before the budget bites
    oracle = p + expected
    rounds, worst = [], 0.0

    def check(ctx, rnd):
        committed = oracle[:ctx.n_past()]
        assert committed[-1 - rnd.accepted:] == [oracle[rnd.pos0]] + rnd.drafts[:rnd.accepted]
        fresh, _ = _fresh_state(target, committed)
        nonlocal worst
        for layer in _rec_layers(ctx):
            for a, b in zip(ctx.recurrent_state(0, layer), fresh.recurrent_state(0, layer)):
                worst = max(worst, float((a - b).abs().max()))
        rounds.append(rnd)

    drafter = ScriptedDrafter(oracle, PLAN, target.vocab_size)
    res = speculative_generate(target, drafter, p, 32, SpecConfig(draft_max=4, rollback=rollback), on_round=check)
    print(f"{rollback}: {len(rounds)} rounds, max |state - recompute| = {worst:.2e}")
    assert res.tokens == expected
    assert worst < 1e-9
    planned = [(min(n, 4), g) for n, g in PLAN]
    seen = [(len(r.drafts), r.accepted) for r in rounds]
    assert seen[:len(PLAN)] == planned  # the scripted rounds happened as planned (zero-draft after multi-accept)
    s = res.stats["speculative"]
    redo = sum(r.accepted + 1 for r in rounds if r.accepted < len(r.drafts))
    if rollback == "snapshot":
        assert s["reevaluated_tokens"] == 0 and s["redecode_forwards"] == 0
    else:
        assert s["reevaluated_tokens"] == redo > 0
    print(f"{rollback}: re-evaluated target tokens {s['reevaluated_tokens']} (expected {0 if rollback == 'snapshot' else redo})")


def test_rollback_check_catches_a_missing_rollback(target, plain, monkeypatch):
    # Negative control: a seq_rm that pretends to succeed leaves rejected drafts in the recurrent state.
    p = PROMPTS[1]
    oracle = p + plain[tuple(p)]
    monkeypatch.setattr(Context, "seq_rm", lambda self, seq, from_pos: True)
    res = speculative_generate(target, ScriptedDrafter(oracle, PLAN, target.vocab_size), p, N, SpecConfig(draft_max=4))
    assert res.tokens != plain[tuple(p)]


def test_target_tokens_evaluated(target, plain):
    p = PROMPTS[2]
    oracle = p + plain[tuple(p)]
    for rollback in ("snapshot", "checkpoint"):
        log = []
        res = speculative_generate(target, ScriptedDrafter(oracle, PLAN, target.vocab_size), p, N,
                                   SpecConfig(draft_max=4, rollback=rollback), on_round=lambda c, r: log.append((c, r)))
        ctx = log[-1][0]
        verified = sum(len(r.drafts) + 1 for _, r in log)
        extra = ctx.n_evaluated - (len(p) - 1) - verified
        print(f"{rollback}: target tokens evaluated beyond prompt + verification batches: {extra}")
        assert extra == res.stats["speculative"]["reevaluated_tokens"]
        assert (extra == 0) == (rollback == "snapshot")


def test_mtp_drafter_cache_is_teacher_forced(target64):
    """After every round the head's cache holds exactly the committed positions, pending_h is the target's
    hidden state of the last one, and the next draft row's logits equal a fresh MTP evaluation of the
    llama.cpp rows of the committed tokens (row 0 hidden = zeros) plus the row (id_last, h_last): in our
    runtime (float64: rounding ~1e-12) and in transformers' MtpModel (float32)."""
    from specconv.runtime.mtp_rows import mtp_rows
    from tests.fixtures.hf_reference import hf_mtp_logits_llamacpp_rows

    target = target64
    src = speculative_models.checkpoint()
    p = PROMPTS[2]
    drafter = MtpDrafter(target, 128, target)
    stream, records = list(p), []

    def probe(ctx, rnd):
        stream.extend(rnd.drafts[:rnd.accepted] + [rnd.token])
        n_past = ctx.n_past()
        assert n_past == drafter.committed_rows() == drafter.n_committed
        # the drafter's own next draft row, then removed again (attention-only cache: exact)
        out = drafter.ctx.decode([rnd.token], positions=[n_past], hidden_in=drafter.pending_h.reshape(1, -1))
        assert drafter.ctx.seq_rm(0, n_past)
        records.append((stream[:n_past + 1], drafter.pending_h.clone(), out.logits[-1].clone()))

    speculative_generate(target, drafter, p, N, SpecConfig(draft_max=3), on_round=probe)
    worst_h = worst_own = worst_hf = 0.0
    for ids, pending, own in records:
        _, fresh = _fresh_state(target, ids)
        h = fresh.hidden["post_norm"]
        worst_h = max(worst_h, float((pending - h[-2]).abs().max()))
        toks, rows, pos = mtp_rows(ids, h, "llama.cpp")
        again = Context(target, GraphType.MTP, n_ctx=len(ids)).decode(toks, pos, hidden_in=rows).logits[-1]
        worst_own = max(worst_own, float((own - again).abs().max()))
        ref = hf_mtp_logits_llamacpp_rows(src, ids, hidden=h.float().numpy())[-1]
        worst_hf = max(worst_hf, float(np.abs(own.float().numpy() - ref).max()))
    print(f"MTP drafter over {len(records)} rounds: max |pending_h - target h| = {worst_h:.2e}, next draft logits "
          f"vs fresh MTP evaluation {worst_own:.2e}, vs transformers MtpModel {worst_hf:.2e}")
    assert len(records) >= 5 and worst_h < 1e-9 and worst_own < 1e-9 and worst_hf < 1e-4


@pytest.mark.parametrize("plan", [PLAN, [(4, 4)], [(4, 2), (4, 0), (4, 3)], [(2, 1), (4, 4), (1, 0), (3, 3)]])
def test_statistics_algebra(target, plan):
    """Statistics against counts taken independently from the rounds, and docs/reference/speculative.md §6-§7 algebra."""
    p = PROMPTS[1]
    oracle = p + generate(target, p, 24).tokens
    log = []
    res = speculative_generate(target, ScriptedDrafter(oracle, plan, target.vocab_size), p, 24,
                               SpecConfig(draft_max=4), on_round=lambda c, r: log.append(r))
    s = res.stats["speculative"]
    drafting = [r for r in log if r.drafts]
    assert s["rounds"] == len(log) == s["target_forwards"]
    assert s["drafts"] == len(drafting)
    assert s["drafted"] == sum(len(r.drafts) for r in log)
    assert s["accepted"] == sum(r.accepted for r in log) == len(res.tokens) - len(log)
    assert s["per_position"] == [sum(r.accepted > i for r in drafting) / len(drafting) for i in range(4)]
    assert s["acceptance_rate"] == s["accepted"] / s["drafted"]
    assert s["acceptance_length"] == pytest.approx(1 + sum(s["per_position"]), abs=1e-12)
    assert all(a >= b for a, b in zip(s["per_position"], s["per_position"][1:]))
    assert s["accepted"] <= s["drafted"] and s["tokens_per_target_forward"] <= 4 + 1
    assert s["tokens_per_target_forward"] == len(res.tokens) / len(log)
    # alpha reproduces the accepted count given the draft lengths; bound is Leviathan's E at draft_max
    a = s["alpha"]
    if a < 1:
        assert sum(a ** i for r in drafting for i in range(1, len(r.drafts) + 1)) == pytest.approx(s["accepted"], rel=1e-9)
    assert s["bound"] == pytest.approx(sum(a ** i for i in range(5)), rel=1e-9)
    if s["uniform_drafts"]:  # full-length drafts every round: the i.i.d. E equals the measured AL
        assert s["bound"] == pytest.approx(s["acceptance_length"], rel=1e-9)
    print(f"plan {plan}: AL {s['acceptance_length']:.3f}, per_position {s['per_position']}, alpha {a:.4f}, "
          f"bound {s['bound']:.3f}, tokens/forward {s['tokens_per_target_forward']:.3f}")


def test_leviathan_expectation_matches_published_table():
    # docs/reference/speculative.md §7 table (computed from the paper's formula): (alpha, k) -> E
    for alpha, k, e in [(0.70, 1, 1.70), (0.70, 3, 2.53), (0.80, 2, 2.44), (0.85, 3, 3.19), (0.90, 7, 5.70)]:
        assert round(expected_tokens(alpha, k), 2) == e
    assert expected_tokens(1.0, 3) == 4.0


def test_draft_min_and_p_min_make_zero_draft_rounds(target, plain):
    p = PROMPTS[1]
    res = speculative_generate(target, MtpDrafter(target, 128, target), p, N, SpecConfig(draft_max=3, p_min=1.0))
    s = res.stats["speculative"]
    assert res.tokens == plain[tuple(p)] and s["drafted"] == 0 and s["rounds"] == N
    res = speculative_generate(target, NgramDrafter(), p, N, SpecConfig(draft_max=3, draft_min=4))
    s = res.stats["speculative"]
    assert res.tokens == plain[tuple(p)] and s["drafted"] == 0 and s["rounds"] == N


def test_ngram_lookup():
    from specconv.runtime.drafters.ngram import lookup

    assert lookup([1, 2, 3, 9, 1, 2, 3, 4, 1, 2], 3, 3, 1) == [3, 4, 1]  # longest suffix [1, 2], most recent full match
    assert lookup([5, 5, 5, 5, 5], 3, 3, 1) == [5, 5]  # suffix [5, 5, 5]: at most two followers
    assert lookup([7, 7, 7, 7, 7, 7], 3, 2, 1) == [7, 7, 7]  # a repeated token: a match with three followers exists
    assert lookup([1, 2, 3], 2, 3, 1) == []  # no earlier occurrence: zero-draft round
    assert lookup([4, 8, 4], 2, 3, 1) == [8, 4]


def test_stop_at_end_of_generation(target, plain, monkeypatch):
    """An end-of-generation token inside an accepted draft ends the output there, as plain decoding does.
    The tiny random model never picks its EOS, so the 5th plain token is declared end-of-generation."""
    p = PROMPTS[1]
    eog = plain[tuple(p)][4]
    tok = target.tokenizer
    monkeypatch.setattr(type(tok), "is_end_of_generation", lambda self, t: t == eog)
    ref = generate(target, p, N, stop_at_eos=True).tokens
    assert ref[-1] == eog and len(ref) <= 5
    for k in (2, 4, 7):
        res = speculative_generate(target, DraftModelDrafter(target, 128, k, target), p, N,
                                   SpecConfig(draft_max=k, stop_at_eos=True))
        assert res.tokens == ref


def test_alpha_and_merge():
    from collections import Counter

    from specconv.runtime.spec_stats import SpecStats, solve_alpha

    assert solve_alpha(Counter({1: 4}), 3) == pytest.approx(0.75)  # one draft per round: alpha = rate
    assert solve_alpha(Counter({2: 4}), 3) == pytest.approx(0.5)  # 4 (a + a^2) = 3
    assert solve_alpha(Counter({2: 1, 1: 2}), 0) == 0.0 and solve_alpha(Counter({2: 1}), 2) == 1.0
    a, b = SpecStats(3), SpecStats(3)
    for s, rounds in ((a, [(3, 3), (0, 0), (2, 1)]), (b, [(1, 0), (3, 2)])):
        for n, j in rounds:
            s.record_round(n, j)
    m, whole = SpecStats.merge([a, b]), SpecStats(3)
    for n, j in [(3, 3), (0, 0), (2, 1), (1, 0), (3, 2)]:
        whole.record_round(n, j)
    assert m.to_json() == whole.to_json()
    with pytest.raises(ValueError):
        a.record_round(2, 3)


def test_draft_model_vocabulary_check():
    from types import SimpleNamespace

    from specconv.archs.errors import SpecconvError
    from specconv.runtime.drafters.draft_model import check_same_vocabulary

    def model(n, tokens):
        return SimpleNamespace(vocab_size=n, file=SimpleNamespace(get=lambda key: tokens))

    check_same_vocabulary(model(3, ["a", "b", "c"]), model(3, ["a", "b", "c"]))
    check_same_vocabulary(model(3, ["a", "b", "c"]), model(3, None))  # no token list to compare: sizes decide
    with pytest.raises(SpecconvError, match="vocabulary"):
        check_same_vocabulary(model(3, ["a", "b", "c"]), model(4, ["a", "b", "c", "d"]))
    with pytest.raises(SpecconvError, match="token id 1"):
        check_same_vocabulary(model(3, ["a", "b", "c"]), model(3, ["a", "x", "c"]))
