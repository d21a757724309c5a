"""The synthetic drafter and `--draft-max auto` on a tiny Qwen3.5 GGUF (random re-initialised weights).

* greedy speculative output identical to plain greedy decoding at every A and k, and with auto;
* first-position acceptance within sampling error of A (and per-position acceptance A^i);
* auto falls back to plain decoding at A = 0 (and keeps probing), drafts long at A = 1;
* at temperature > 0 the Leviathan rule with the synthetic drafter's q keeps the target's
  distribution (chi-square over many runs of the first emitted token);
* the round log carries each round's k, the report labels the drafter synthetic, and the batched
  delta rule equals the recurrent one (float64) with the per-token states the snapshot ring keeps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters.synthetic import SyntheticDrafter, greedy_reference
from specconv.runtime.generate import generate
from specconv.runtime.graphs import gdn
from specconv.runtime.sampling import make_generator, probabilities
from specconv.runtime.spec_auto import PROBE_MIN, AutoDraft, TargetCosts
from specconv.runtime.speculative import SpecConfig, speculative_generate
from specconv.verify.roundtrip import _pooled_chi_square
from tests.fixtures import speculative_models

torch.set_num_threads(1)

PROMPTS = [[7], [5, 17, 42, 99, 3, 5, 17, 42], [11, 300, 12, 64, 128, 11, 300, 12, 64, 250, 7, 77, 11, 300]]
N = 24


@pytest.fixture(scope="module")
def target():
    return load_model(speculative_models.gguf("embedded"), device="cpu")


@pytest.fixture(scope="module")
def references(target):
    return {tuple(p): greedy_reference(target, p, N) for p in PROMPTS}


def run(target, prompt, reference, a, k, auto=False, seed=0, temperature=0.0, n=N):
    drafter = SyntheticDrafter(reference, target.vocab_size, a, seed=seed)
    return speculative_generate(target, drafter, prompt, n,
                                SpecConfig(draft_max=k, auto=auto, temperature=temperature, seed=seed))


@pytest.mark.parametrize("a", [0.0, 0.5, 0.8, 1.0])
def test_greedy_identical_every_acceptance_and_k(target, references, a):
    for p in PROMPTS:
        ref = references[tuple(p)]
        for k in (1, 2, 3, 4):
            res = run(target, p, ref, a, k)
            assert res.tokens == ref[len(p):], (p, a, k)
            s = res.stats["speculative"]
            assert s["synthetic"] is True and s["drafter"] == "synthetic" and s["set_acceptance"] == a
            assert all(r["k"] <= k for r in res.stats["rounds"])
        res = run(target, p, ref, a, 4, auto=True)
        assert res.tokens == ref[len(p):], (p, a, "auto")
    if a == 1.0:  # every draft accepted: tokens per target forward is k + 1 (up to the tail)
        res = run(target, PROMPTS[0], references[tuple(PROMPTS[0])], 1.0, 3)
        s = res.stats["speculative"]
        assert s["accepted"] == s["drafted"] and s["tokens_per_target_forward"] > 3.5


def test_first_position_acceptance_is_a(target, references):
    """k = 1 over many rounds (greedy): accepted / drafted ~ Binomial(rounds, A)/rounds."""
    p = PROMPTS[2]
    for a in (0.3, 0.7):
        accepted = drafted = 0
        per_position = []
        for seed in range(6):
            res = run(target, p, references[tuple(p)], a, 1, seed=seed)
            s = res.stats["speculative"]
            accepted += s["accepted"]
            drafted += s["drafted"]
        rate = accepted / drafted
        sigma = math.sqrt(a * (1 - a) / drafted)
        print(f"\n[synthetic A={a}] first-position acceptance {rate:.3f} over {drafted} drafts "
              f"(sampling sd {sigma:.3f}, |Δ| = {abs(rate - a) / sigma:.1f} sd)")
        assert abs(rate - a) <= 4 * sigma
        # deeper positions: cumulative acceptance A^i at k = 3
        hits, rounds = [0, 0, 0], 0
        for seed in range(6):
            res = run(target, p, references[tuple(p)], a, 3, seed=100 + seed, n=N)
            for r in res.stats["rounds"]:
                if len(r["drafted"]) == 3:
                    rounds += 1
                    for i in range(r["accepted"]):
                        hits[i] += 1
        per_position = [h / rounds for h in hits]
        print(f"[synthetic A={a}] per-position at k=3 {[round(x, 3) for x in per_position]} over {rounds} rounds "
              f"(expected {[round(a ** (i + 1), 3) for i in range(3)]})")
        for i, x in enumerate(per_position):
            assert abs(x - a ** (i + 1)) <= 4 * math.sqrt(a ** (i + 1) * (1 - a ** (i + 1)) / rounds) + 1e-9


def test_auto_falls_back_to_plain_at_zero_acceptance(target, references):
    p = PROMPTS[1]
    n = 120
    ref = greedy_reference(target, p, n)
    res = run(target, p, ref, 0.0, 8, auto=True, n=n)
    assert res.tokens == ref[len(p):]
    rounds = res.stats["rounds"]
    modes = [r["mode"] for r in rounds]
    plain = modes.count("plain")
    drafted = sum(len(r["drafted"]) for r in rounds)
    print(f"\n[auto, A=0] {len(rounds)} rounds: {plain} plain, {modes.count('probe')} probes, "
          f"{modes.count('draft')} drafting; {drafted} tokens drafted for {n} generated; k per round "
          f"{[r['k'] for r in rounds[:30]]}...")
    assert plain >= 0.75 * len(rounds)
    assert modes.count("probe") >= 1  # it keeps measuring
    assert all(r["k"] == 0 for r in rounds[-10:] if r["mode"] == "plain")
    # and drafts long when every draft is accepted
    res = run(target, p, ref, 1.0, 8, auto=True, n=n)
    ks = [r["k"] for r in res.stats["rounds"]]
    print(f"[auto, A=1] k per round {ks}")
    assert res.tokens == ref[len(p):] and max(ks) >= 3 and res.stats["speculative"]["auto"]["final_choice"] >= 3


def test_auto_model_choices():
    """The choice follows the cost model: flat target costs and high acceptance -> long drafts; a target
    whose batch costs k+1 times one token -> plain; probes back off while drafts do not pay."""
    flat = AutoDraft(TargetCosts([1.0] * 9), k_max=8)
    for _ in range(40):
        flat.observe(8, 8, "draft", 1.0)
    assert flat.choose() == (8, "draft")
    linear = AutoDraft(TargetCosts([float(n) for n in range(1, 10)]), k_max=8)
    for _ in range(5):
        linear.observe(1, 1, "draft", 2.0)
    assert linear.choose()[0] == 0  # even accepted drafts cannot pay when verification costs n forwards
    dead = AutoDraft(TargetCosts([1.0 + 0.1 * n for n in range(9)]), k_max=8)
    modes = []
    for _ in range(200):
        k, mode = dead.choose()
        modes.append(mode)
        dead.observe(k, 0, mode, 1.0)
    assert dead.best()[0] == 0 and dead.probe > PROBE_MIN  # backed off
    print(f"\n[auto model, A=0] {modes.count('probe')} probes in 200 rounds, interval now {dead.probe}")
    assert modes.count("probe") <= 12


def test_temperature_keeps_target_distribution(target, references):
    """T = 1: the first emitted token over many seeds follows the target's p (Leviathan with the synthetic q)."""
    p = PROMPTS[1]
    ref = references[tuple(p)]
    ctx = Context(target, GraphType.MAIN, n_ctx=len(p) + 1)
    probs = probabilities(ctx.decode(p, hidden=(), logits="last").logits[-1], 1.0)
    counts = torch.zeros_like(probs)
    trials, accepted = 1500, 0
    drafter = SyntheticDrafter(ref, target.vocab_size, 0.6, seed=1)
    for seed in range(trials):
        res = speculative_generate(target, drafter, p, 2, SpecConfig(draft_max=1, temperature=1.0, seed=seed))
        counts[res.tokens[0]] += 1
        accepted += res.stats["speculative"]["accepted"]
    pval = _pooled_chi_square(counts, probs)
    q = torch.full_like(probs, 0.4 / (target.vocab_size - 1))
    q[ref[len(p)]] = 0.6
    exact = float(torch.minimum(probs, q).sum())
    rate = accepted / trials
    print(f"\n[synthetic A=0.6, T=1] first token chi-square p = {pval:.3f} over {trials} runs; acceptance "
          f"{rate:.3f} vs exact Σmin(p, q) = {exact:.3f}")
    assert pval > 1e-3
    assert abs(rate - exact) <= 5 * math.sqrt(max(exact * (1 - exact), 1 / trials) / trials)
    # k = 2 at T = 0.3 (peaked enough that the reference's first token is common): the second token, among
    # runs whose first token is the reference's, follows p(· | prompt + [that token])
    first, t2 = ref[len(p)], 0.3
    ctx = Context(target, GraphType.MAIN, n_ctx=len(p) + 2)
    probs2 = probabilities(ctx.decode(p + [first], hidden=(), logits="last").logits[-1], t2)
    counts2 = torch.zeros_like(probs2)
    drafter = SyntheticDrafter(ref, target.vocab_size, 0.6, seed=2)
    for seed in range(trials):
        res = speculative_generate(target, drafter, p, 3, SpecConfig(draft_max=2, temperature=t2, seed=10_000 + seed))
        if res.tokens[0] == first:
            counts2[res.tokens[1]] += 1
    p2 = _pooled_chi_square(counts2, probs2)
    bins = int((probs2 * counts2.sum() >= 5).sum())
    print(f"[synthetic A=0.6, T={t2}, k=2] second token after the reference's first: chi-square p = {p2:.3f} over "
          f"{int(counts2.sum())} runs, {bins} categories with ≥ 5 expected")
    assert counts2.sum() >= 300 and bins >= 3 and p2 > 1e-3


def test_batched_delta_rule_equals_recurrent():
    gen = torch.Generator().manual_seed(3)
    worst = {torch.float64: 0.0, torch.float32: 0.0}
    for dtype in worst:
        for n, keep in [(2, 2), (4, 4), (5, 3), (9, 9), (70, 4)]:
            nv, dk, dv = 4, 16, 8
            q = torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=gen, dtype=dtype), dim=-1) * dk ** -0.5
            k = torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=gen, dtype=dtype), dim=-1)
            v = torch.randn(n, nv, dv, generator=gen, dtype=dtype)
            g = -8 * torch.rand(n, nv, generator=gen, dtype=dtype) * torch.rand(n, nv, generator=gen, dtype=dtype)
            beta = torch.rand(n, nv, generator=gen, dtype=dtype)
            state = torch.randn(nv, dk, dv, generator=gen, dtype=dtype)
            o_r, s_r = gdn.recurrent_delta_rule(q, k, v, g, beta, state, keep=keep)
            o_b, s_b = gdn.delta_rule(q, k, v, g, beta, state, keep=keep, mode="auto")
            assert s_b.shape == s_r.shape == (keep, nv, dk, dv)
            worst[dtype] = max(worst[dtype], float((o_r - o_b).abs().max()), float((s_r - s_b).abs().max()))
    print(f"\n[GDN batched vs recurrent] max |Δ| float64 {worst[torch.float64]:.2e}, float32 {worst[torch.float32]:.2e}")
    assert worst[torch.float64] <= 1e-12 and worst[torch.float32] <= 1e-5


def test_cli_synthetic_and_auto(tmp_path):
    from specconv.cli import cli as main

    path = str(speculative_models.gguf("embedded"))
    runner = CliRunner()
    out = runner.invoke(main, ["generate", path, "--tokens", "5,17,42,99", "-n", "12", "--spec", "synthetic",
                               "--acceptance", "0.8", "--draft-max", "auto", "--json", "--device", "cpu"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.output.strip().splitlines()[-1])
    s = payload["speculative"]
    assert s["synthetic"] and s["draft_max"] == "auto" and s["auto"]["target_ratios"][0] == 1.0
    assert all("k" in r and r["mode"] in ("draft", "plain", "probe") for r in payload["rounds"])
    plain = runner.invoke(main, ["generate", path, "--tokens", "5,17,42,99", "-n", "12", "--json", "--device", "cpu"])
    assert json.loads(plain.output.strip().splitlines()[-1])["tokens"] == payload["tokens"]
    text = runner.invoke(main, ["generate", path, "--tokens", "5,17,42,99", "-n", "6", "--spec", "synthetic",
                                "--acceptance", "0.5", "--draft-max", "2", "--device", "cpu", "--no-baseline"])
    assert text.exit_code == 0 and "synthetic drafter, set acceptance 0.50" in text.output
    bad = runner.invoke(main, ["generate", path, "--tokens", "5", "--spec", "synthetic", "--device", "cpu"])
    assert bad.exit_code != 0 and "--acceptance" in bad.output + str(bad.exception)
    bad = runner.invoke(main, ["generate", path, "--tokens", "5", "--spec", "mtp", "--draft-max", "many"])
    assert bad.exit_code != 0 and "auto" in bad.output + str(bad.exception)


def test_auto_with_every_drafter_is_exact(target, references):
    """--draft-max auto with the MTP head, a draft model and prompt lookup: greedy output equal to plain,
    and the MTP head, told of plain stretches in one batched catch-up, ends holding the rows it would
    hold had it been told every round."""
    from specconv.runtime.drafters import DraftModelDrafter, MtpDrafter, NgramDrafter

    for p in PROMPTS:
        ref = references[tuple(p)]
        for make in (lambda: MtpDrafter(target, 128, target), lambda: DraftModelDrafter(target, 128, 8, target),
                     NgramDrafter):
            drafter = make()
            synced = []

            def check(ctx, rnd):  # after a drafting round the MTP head holds exactly the committed rows
                if rnd.drafts and drafter.name == "mtp":
                    synced.append(drafter.committed_rows() == ctx.n_past())

            res = speculative_generate(target, drafter, p, N, SpecConfig(draft_max=8, auto=True), on_round=check)
            assert res.tokens == ref[len(p):], (p, drafter.name)
            rounds = res.stats["rounds"]
            assert all(r["mode"] in ("draft", "plain", "probe") and 0 <= r["k"] <= 8 for r in rounds)
            assert all(len(r["drafted"]) <= r["k"] for r in rounds)
            assert all(synced)
            if drafter.name == "mtp" and len(p) > 1:
                assert synced  # the random head accepts nothing, but the first rounds draft


def test_verification_forward_has_no_token_loop(target, monkeypatch):
    """A verification batch (and a single token) runs the batched Gated DeltaNet form: the token-by-token
    recurrence is never called in the default mode, and the snapshot states it writes roll back exactly."""
    calls = []
    real = gdn.recurrent_delta_rule
    monkeypatch.setattr(gdn, "recurrent_delta_rule", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = PROMPTS[2]
    ctx = Context(target, GraphType.MAIN, n_ctx=64, n_rs_seq=4)
    ctx.decode(p, hidden=(), logits=None)
    n0 = ctx.n_past()
    ctx.decode([5, 6, 7, 8, 9], hidden=(), logits="all")  # a verification of k + 1 = 5 tokens
    assert ctx.seq_rm(0, n0 + 2)  # keep 2 of them
    got = ctx.decode([4], hidden=(), logits="last").logits[-1]  # and one token
    assert calls == []
    fresh = Context(target, GraphType.MAIN, n_ctx=64, n_rs_seq=0, gdn_mode="recurrent")
    want = fresh.decode(p + [5, 6, 4], hidden=(), logits="last").logits[-1]
    assert calls  # the reference context did use the recurrence
    print(f"\n[verification forward] rolled back to 2 of 5 tokens then decoded: max |Δlogit| vs recurrent "
          f"recomputation {float((got - want).abs().max()):.2e}")
    assert torch.allclose(got, want, atol=1e-4)
