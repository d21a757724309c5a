"""`specconv compare`'s building blocks: llama.cpp's statistics, the compact log-probability store and its
stated error bound, the chunk layout (docs/compare.md §2-§4).

The statistics are checked against numpy's own estimators (np.percentile's linear method, np.median,
np.std, np.cov), not against a copy of the same formulas. The store is checked on rows built to stress
it: wide spans cut at 32 nats, narrow rows, near-ties, quants that move mass into the cut tail, a vocabulary
of 150 k: every row's |estimate − exact KL| stays under its bound, and the bound is small where the
quant is close (a bound of 1 would be true and useless)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from specconv.compare import stats
from specconv.compare.chunks import Chunks, read_token_file
from specconv.compare.scoring import ExactRows, score_rows
from specconv.compare.store import LEVELS, RANGE, LogProbStore, decode, encode
from specconv.errors import SpecconvError


# ------------------------------------------------------------------ statistics


def test_statistics_match_numpy_estimators():
    rng = np.random.default_rng(0)
    for n in (11, 12, 100, 1001):
        x = rng.gamma(0.5, 0.01, n)
        mean, err = stats.mean_and_error(x)
        assert mean == pytest.approx(np.mean(x), rel=1e-12)
        assert err == pytest.approx(np.std(x) / math.sqrt(n - 1), rel=1e-9)  # llama.cpp: population var / (n − 1)
        v = np.sort(x)
        for f in (0.001, 0.01, 0.05, 0.1, 0.25, 0.75, 0.9, 0.95, 0.99, 0.999):
            assert stats.percentile(v, f) == pytest.approx(np.percentile(x, 100 * f, method="linear"), rel=1e-12)
        assert stats.median(v) == pytest.approx(np.median(x), rel=1e-12)
        y = x + rng.normal(0, 0.001, n)
        assert stats.covariance_of_means(x, y) == pytest.approx(np.cov(x, y, ddof=0)[0, 1] / (n - 1), rel=1e-9)


def test_statistics_small_counts_as_llama_cpp():
    x = np.arange(10, dtype=float)
    assert stats.mean_and_error(x) == (4.5, 0.0)  # n ≤ 10: no error estimate
    assert stats.covariance_of_means(x[:9], x[:9]) == 0.0  # n < 10
    assert stats.mean_and_error(np.full(50, 0.25)) == (0.25, 0.0)  # no variance
    v = np.array([1.0, 2.0, 4.0])
    assert stats.percentile(v, 0.0) == 1.0 and stats.percentile(v, 1.0) == 4.0
    assert stats.median(np.array([1.0, 2.0, 4.0, 8.0])) == 3.0


def test_summary_figures():
    rng = np.random.default_rng(1)
    n = 500
    nll_b = rng.gamma(2.0, 1.0, n)
    nll_q = nll_b + rng.normal(0.01, 0.05, n)
    kld = rng.gamma(0.5, 0.01, n)
    dp = rng.normal(0, 0.02, n)
    same = rng.random(n) < 0.93
    s = stats.summarize(nll_q, nll_b, kld, dp, same)
    assert s["ppl"]["value"] == pytest.approx(math.exp(nll_q.mean()))
    assert s["ppl"]["error"] == pytest.approx(math.exp(nll_q.mean()) * np.std(nll_q) / math.sqrt(n - 1))
    cov = np.cov(nll_q, nll_b, ddof=0)[0, 1] / (n - 1)
    eq, eb = np.std(nll_q) / math.sqrt(n - 1), np.std(nll_b) / math.sqrt(n - 1)
    assert s["ln_ppl_ratio"]["value"] == pytest.approx(nll_q.mean() - nll_b.mean())
    assert s["ln_ppl_ratio"]["error"] == pytest.approx(math.sqrt(eq ** 2 + eb ** 2 - 2 * cov))
    # the ratio's error is the ln ratio's (the differences' standard error)
    assert s["ln_ppl_ratio"]["error"] == pytest.approx(np.std(nll_q - nll_b) / math.sqrt(n - 1), rel=1e-6)
    assert s["cor_ln_ppl"] == pytest.approx(np.corrcoef(nll_q, nll_b)[0, 1], rel=1e-9)
    assert s["same_top_p"]["value"] == pytest.approx(same.mean())
    assert s["same_top_p"]["error"] == pytest.approx(math.sqrt(same.mean() * (1 - same.mean()) / (n - 1)))
    rms = math.sqrt((dp ** 2).mean())
    assert s["delta_p"]["rms"] == pytest.approx(rms)
    assert s["delta_p"]["rms_error"] == pytest.approx(0.5 / rms * np.std(dp ** 2) / math.sqrt(n - 1))
    assert s["kld"]["99.9%"] == pytest.approx(np.percentile(kld, 99.9))
    assert s["delta_p"]["75.0%"] == pytest.approx(np.percentile(dp, 75))
    assert s["kld"]["max"] == kld.max() and s["delta_p"]["min"] == dp.min()


# ------------------------------------------------------------------ the store


def _rows(rng, n, vocab, spread):
    return torch.from_numpy((rng.standard_normal((n, vocab)) * spread).astype(np.float32))


def _exact_kld(base: torch.Tensor, quant: torch.Tensor) -> np.ndarray:
    a = torch.log_softmax(base.double(), -1)
    b = torch.log_softmax(quant.double(), -1)
    return (a.exp() * (a - b)).sum(-1).numpy()


def _check_store(base, quant, label):
    n = base.shape[0]
    store = LogProbStore(n, base.shape[1])
    targets = torch.randint(0, base.shape[1], (n,), generator=torch.Generator().manual_seed(0))
    rows = store.append(base, targets)
    b = torch.log_softmax(quant.double(), -1)
    est, bound = rows.kld(0, n, b)
    exact = _exact_kld(base, quant)
    err = np.abs(est - exact)
    print(f"{label}: exact KLD mean {exact.mean():.3e}, |store − exact| max {err.max():.2e}, bound mean "
          f"{bound.mean():.2e} max {bound.max():.2e}, worst error/bound {np.max(err / bound):.3f}")
    assert np.all(err <= bound), f"{label}: a row's error exceeds its bound"
    # the exact figures of the row stay exact
    a = torch.log_softmax(base.double(), -1)
    assert np.array_equal(rows.target_logprob, a.gather(-1, targets[:, None])[:, 0].numpy())
    assert np.array_equal(rows.argmax, base.argmax(-1).numpy())
    return exact, err, bound


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])
def test_store_kld_within_bound_near_quant(spread):
    rng = np.random.default_rng(int(spread * 10))
    base = _rows(rng, 64, 4096, spread)
    quant = base + _rows(rng, 64, 4096, 0.02)  # a close quant, as q8_0 is
    exact, err, bound = _check_store(base, quant, f"spread {spread}, close quant")
    # close quants get a bound well under their KL divergence (not just a true but useless bound)
    assert bound.mean() < 0.2 * exact.mean()


def test_store_kld_within_bound_far_quant_and_cut_tail():
    rng = np.random.default_rng(7)
    base = _rows(rng, 32, 8192, 10.0)  # spans of ~80 nats: the codes cut at 32 nats below the maximum
    far = _rows(rng, 32, 8192, 10.0)  # an unrelated distribution
    tail = base.clone()  # the quant moves mass onto the base's cut tail
    low = base < (base.max(-1, keepdim=True).values - RANGE)
    tail[low] += 30.0
    assert low.any(-1).all()
    _check_store(base, far, "unrelated quant, cut rows")
    _check_store(base, tail, "quant favouring the cut tail")


def test_store_large_vocabulary_and_ties():
    rng = np.random.default_rng(3)
    base = _rows(rng, 4, 150_000, 4.0)
    base[0, :10] = base[0].max() + 1.0  # ten tied maxima: argmax is the first, as llama.cpp takes it
    base[1] = 0.0  # a flat row: step 0, every token coded at the offset
    quant = base + _rows(rng, 4, 150_000, 0.05)
    _check_store(base, quant, "150k vocabulary")
    codes, step, offset = encode(base)
    assert step[1] == 0 and np.all(codes[1] == 0)
    assert float(decode(codes[1:2], step[1:2], offset[1:2])[0, 0]) == pytest.approx(-math.log(150_000), rel=1e-6)


def test_store_codes_cover_the_range():
    rng = np.random.default_rng(5)
    base = _rows(rng, 8, 1000, 20.0)
    codes, step, offset = encode(base)
    assert codes.dtype == np.uint16 and codes.max() == LEVELS
    assert np.allclose(step, RANGE / LEVELS, rtol=1e-6)  # wide rows: cut at RANGE nats
    rec = decode(codes, step, offset)
    a = torch.log_softmax(base.double(), -1)
    coded = torch.from_numpy(codes > 0)
    assert float((rec - a)[coded].abs().max()) <= float(step.max()) / 2 + 1e-5


def test_store_fills_in_order_and_refuses_more():
    store = LogProbStore(3, 16)
    x = torch.randn(2, 16)
    rows = store.append(x, [1, 2])
    assert (rows.start, rows.stop, store.filled) == (0, 2, 2)
    with pytest.raises(ValueError):
        store.append(torch.randn(2, 16), [0, 0])


def test_scores_against_exact_rows():
    rng = np.random.default_rng(9)
    base, quant = _rows(rng, 40, 300, 2.0), _rows(rng, 40, 300, 2.0)
    targets = rng.integers(0, 300, 40)
    s = score_rows(ExactRows(base, targets), quant, targets)
    a, b = torch.log_softmax(base.double(), -1), torch.log_softmax(quant.double(), -1)
    t = torch.from_numpy(targets)[:, None]
    assert np.allclose(s.nll, -b.gather(-1, t)[:, 0].numpy(), rtol=1e-12)
    assert np.allclose(s.nll_base, -a.gather(-1, t)[:, 0].numpy(), rtol=1e-12)
    assert np.allclose(s.kld, _exact_kld(base, quant), rtol=1e-10)
    assert np.allclose(s.p_diff, b.exp().gather(-1, t)[:, 0].numpy() - a.exp().gather(-1, t)[:, 0].numpy())
    assert np.array_equal(s.same_top, base.argmax(-1).numpy() == quant.argmax(-1).numpy())
    same = score_rows(ExactRows(base, targets), base, targets)
    assert np.all(same.kld == 0) and same.same_top.all() and np.all(same.p_diff == 0)


# ------------------------------------------------------------------ chunks


def test_chunks_layout_as_llama_perplexity():
    tokens = list(range(100, 100 + 2 * 16 + 5))
    c = Chunks.plan(tokens, 16, bos=None)
    assert (c.n_chunks, c.first, c.scored) == (2, 8, 7)  # the 5 tokens after the last chunk are left out
    assert c.ids(1) == tokens[16:32]
    assert c.targets(1) == tokens[16 + 9:32]  # rows 8..14 predict tokens 9..15
    b = Chunks.plan(tokens, 16, bos=1, limit=1)
    assert b.n_chunks == 1 and b.ids(0) == [1] + tokens[1:16] and b.targets(0) == tokens[9:16]
    with pytest.raises(SpecconvError, match="needs at least 64"):
        Chunks.plan(tokens, 64, bos=None)


def test_token_files(tmp_path):
    (tmp_path / "a.txt").write_text("1 2,3\n4")
    (tmp_path / "b.json").write_text(json.dumps([5, 6]))
    (tmp_path / "c.txt").write_text("1 x 3")
    (tmp_path / "d.txt").write_text("1 99")
    assert read_token_file(tmp_path / "a.txt", 10) == [1, 2, 3, 4]
    assert read_token_file(tmp_path / "b.json", 10) == [5, 6]
    with pytest.raises(SpecconvError, match="not a list of integer"):
        read_token_file(tmp_path / "c.txt", 10)
    with pytest.raises(SpecconvError, match="outside the vocabulary"):
        read_token_file(tmp_path / "d.txt", 10)
