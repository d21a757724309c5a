"""Temperature > 0: the acceptance rules leave the target's distribution unchanged.

Statistic: Pearson's chi-square of the emitted tokens' counts against the target's probabilities
(every category has an expected count ≥ 5), with its p-value from the regularised incomplete gamma
function; the test fails when p < 1e-3. Seeds are fixed, so each test is deterministic; the
threshold says how unlikely a pass would be for a wrong rule: each test also runs a deliberately
wrong rule (emitting the draft without rejection) on the same data and requires it to fail.
Acceptance rates are compared with their exact values (Σ min(p, q), Σ p·q, p(d)) within 5 binomial
standard errors.
"""

from __future__ import annotations

import math

import torch

from specconv.runtime.spec_rules import accept_compare, accept_leviathan

TRIALS = 20000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    assert float(expected.min()) >= 5, "choose p so that every expected count is ≥ 5"
    stat = float(((counts.double() - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def within(measured: float, exact: float, n: int, sigmas: float = 5.0) -> bool:
    return abs(measured - exact) <= sigmas * math.sqrt(max(exact * (1 - exact), 1e-12) / n)


P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.25, 0.15])  # far from p on purpose
P_BONUS = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.1, 0.1])


def _one_step(rule, seed=1):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(P))
    accepted = 0
    for _ in range(TRIALS):
        d = int(torch.multinomial(Q, 1, generator=gen))
        j, t = rule([d], gen)
        first = d if j == 1 else t
        counts[first] += 1
        accepted += j
    return counts, accepted / TRIALS


def test_leviathan_rule_keeps_the_target_distribution():
    rows_p, rows_q = torch.stack([P, P_BONUS]), Q.reshape(1, -1)
    counts, rate = _one_step(lambda d, g: accept_leviathan(rows_p, rows_q, d, g))
    pval, exact_rate = chi_square_p(counts, P), float(torch.minimum(P, Q).sum())
    wrong = chi_square_p(_one_step(lambda d, g: (1, 0))[0], P)
    print(f"Leviathan, {TRIALS} trials: chi-square p = {pval:.3f} (draft-only control p = {wrong:.1e}); "
          f"acceptance {rate:.4f} vs Σmin(p,q) = {exact_rate:.4f}")
    assert pval > 1e-3 and wrong < 1e-3
    assert within(rate, exact_rate, TRIALS)


def test_compare_rule_with_a_stochastic_drafter():
    rows_p = torch.stack([P, P_BONUS])
    counts, rate = _one_step(lambda d, g: accept_compare(rows_p, d, g))
    pval, exact_rate = chi_square_p(counts, P), float((P * Q).sum())
    print(f"sample-and-compare, stochastic q, {TRIALS} trials: chi-square p = {pval:.3f}; "
          f"acceptance {rate:.4f} vs Σp·q = {exact_rate:.4f} (< Σmin(p,q) = {float(torch.minimum(P, Q).sum()):.4f})")
    assert pval > 1e-3
    assert within(rate, exact_rate, TRIALS)


def test_two_positions_with_a_deterministic_drafter():
    """Drafts (d1, d2) fixed: the first emitted token follows p0, and given x1 = d1 the second follows p1
    (the rule consumes row 1 only after accepting d1); acceptance of d1 is p0(d1)."""
    p0, p1, p2 = P, P_BONUS, torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    rows = torch.stack([p0, p1, p2])
    drafts = [0, 2]
    gen = torch.Generator().manual_seed(7)
    first, second = torch.zeros(6), torch.zeros(6)
    acc1 = 0
    for _ in range(TRIALS):
        j, t = accept_compare(rows, drafts, gen)
        emitted = drafts[:j] + [t]
        first[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            acc1 += j >= 1
            second[emitted[1]] += 1
    p_first, p_second = chi_square_p(first, p0), chi_square_p(second, p1)
    print(f"deterministic drafts, {TRIALS} trials: first token p = {p_first:.3f}, second | first=d1 p = {p_second:.3f}, "
          f"acceptance of d1 {acc1 / TRIALS:.4f} vs p0(d1) = {float(p0[0]):.4f}")
    assert p_first > 1e-3 and p_second > 1e-3
    assert within(acc1 / TRIALS, float(p0[0]), TRIALS)


def test_leviathan_with_q_equal_p_always_accepts():
    gen = torch.Generator().manual_seed(3)
    rows = torch.stack([P, P_BONUS])
    assert all(accept_leviathan(rows, P.reshape(1, -1), [int(torch.multinomial(P, 1, generator=gen))], gen)[0] == 1
               for _ in range(500))


# --- through the loop, on the tiny GGUF -------------------------------------------------------------

def _pooled(counts: torch.Tensor, probs: torch.Tensor, trials: int):
    """Categories in decreasing probability, each with expected count ≥ 5; the rest pooled into one."""
    order = torch.argsort(probs, descending=True)
    keep = [int(i) for i in order if float(probs[i]) * trials >= 5]
    rest = [int(i) for i in order if int(i) not in set(keep)]
    c = torch.cat([counts[keep], counts[rest].sum().reshape(1)])
    p = torch.cat([probs[keep], probs[rest].sum().reshape(1)])
    return c, p


def test_loop_first_token_follows_the_target():
    from specconv.runtime import Context, GraphType, load_model
    from specconv.runtime.drafters import DraftModelDrafter
    from specconv.runtime.sampling import probabilities
    from specconv.runtime.speculative import SpecConfig, speculative_generate
    from tests.fixtures import speculative_models

    target = load_model(speculative_models.gguf("trunk"), device="cpu")
    other = load_model(speculative_models.gguf("trunk", seed=1), device="cpu")  # q ≠ p: Leviathan path
    prompt, temp, trials = [5, 17, 42, 99], 0.5, 600
    p = probabilities(Context(target, GraphType.MAIN, n_ctx=8).decode(prompt).logits[-1], temp)
    drafter = DraftModelDrafter(other, 16, 1, target)
    counts, accepted = torch.zeros(target.vocab_size), 0
    for seed in range(trials):
        res = speculative_generate(target, drafter, prompt, 2, SpecConfig(draft_max=1, temperature=temp, seed=seed))
        counts[res.tokens[0]] += 1
        accepted += res.stats["speculative"]["accepted"]
    pval = chi_square_p(*_pooled(counts, p, trials))
    print(f"loop, draft model with q ≠ p, T={temp}, {trials} runs: first-token chi-square p = {pval:.3f}, "
          f"{accepted} first drafts accepted")
    assert pval > 1e-3 and 0 < accepted < trials


def test_loop_identical_draft_accepts_everything_at_temperature():
    # q = p exactly (same model, same temperature): Leviathan accepts with probability 1; any mismatch
    # between the q the drafter sampled from and the q the rule uses would lower it.
    from specconv.runtime import load_model
    from specconv.runtime.drafters import DraftModelDrafter
    from specconv.runtime.speculative import SpecConfig, speculative_generate
    from tests.fixtures import speculative_models

    target = load_model(speculative_models.gguf("trunk"), device="cpu")
    cfg = SpecConfig(draft_max=3, temperature=0.8, seed=5)
    res = speculative_generate(target, DraftModelDrafter(target, 64, 3, target), [5, 17, 42], 16, cfg)
    again = speculative_generate(target, DraftModelDrafter(target, 64, 3, target), [5, 17, 42], 16, cfg)
    other = speculative_generate(target, DraftModelDrafter(target, 64, 3, target), [5, 17, 42], 16,
                                 SpecConfig(draft_max=3, temperature=0.8, seed=6))
    s = res.stats["speculative"]
    print(f"identical draft at T=0.8: acceptance {s['acceptance_rate']}, tokens/forward {s['tokens_per_target_forward']}")
    assert s["acceptance_rate"] == 1.0 and s["tokens_per_target_forward"] == 4.0
    assert res.tokens == again.tokens and res.tokens != other.tokens  # seeded and reproducible
