"""The statistics `llama-perplexity --kl-divergence` prints, from per-position scores (docs/compare.md §3).

Every figure is defined as llama.cpp's tools/perplexity/perplexity.cpp defines it (pinned source in
docs/compare.md), computed here in float64:

* mean ± error: mean = Σx/n; error = sqrt((Σx²/n − mean²)/(n − 1)) when that variance is positive
  and n > 10, else 0;
* covariance of two series: (Σab/n − Σa/n · Σb/n)/(n − 1), 0 when n < 10;
* percentile f of the sorted values v: t = f·(n − 1), i = ⌊t⌋, (1 − (t − i))·v[i] + (t − i)·v[min(i+1, n−1)]
  (f ≤ 0 the minimum, f ≥ 1 the maximum); the median: the middle value, or the mean of the two middle ones;
* PPL = exp(mean nll) ± PPL·error(nll); ln(PPL(Q)/PPL(base)) = mean nll_Q − mean nll_base ±
  sqrt(err_Q² + err_base² − 2·cov); RMS Δp = sqrt(mean Δp²) ± error(Δp²)/(2·RMS); Same top p ± sqrt(p(1 − p)/(n − 1)).
"""

from __future__ import annotations

import math

import numpy as np

# The percentiles llama.cpp prints, highest first (fractions of the sorted values).
KLD_PERCENTILES = (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.90), ("median", 0.5),
                   ("10.0%", 0.10), ("5.0%", 0.05), ("1.0%", 0.01), ("0.1%", 0.001))
DELTA_P_PERCENTILES = (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.90), ("75.0%", 0.75),
                       ("median", 0.5), ("25.0%", 0.25), ("10.0%", 0.10), ("5.0%", 0.05), ("1.0%", 0.01),
                       ("0.1%", 0.001))
MIN_COUNT_FOR_DISTRIBUTION = 100  # llama.cpp prints no distribution statistics below this many positions


def mean_and_error(x: np.ndarray) -> tuple[float, float]:
    """llama.cpp's mean_and_uncertainty: the mean and the standard error of the mean."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n < 1:
        return 0.0, 0.0
    mean = float(x.sum() / n)
    var = float((x * x).sum() / n - mean * mean)
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def covariance_of_means(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's covariance: the covariance of the two series divided by n − 1 (that of their means)."""
    n = len(a)
    if n < 10:
        return 0.0
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1))


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """Linear interpolation between the two sorted values around fraction·(n − 1)."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    t = fraction * (len(v) - 1)
    i = int(t)
    t -= i
    return float((1 - t) * v[i] + t * v[min(i + 1, len(v) - 1)])


def median(sorted_values: np.ndarray) -> float:
    n = len(sorted_values)
    return float(sorted_values[n // 2] if n % 2 else 0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]))


def distribution(values: np.ndarray, points) -> dict:
    """Maximum, the named percentiles (the median as llama.cpp takes it) and minimum of `values`."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    out = {"max": float(v[-1])}
    for name, f in points:
        out[name] = median(v) if name == "median" else percentile(v, f)
    out["min"] = float(v[0])
    return out


def value_error(value: float, error: float) -> dict:
    return {"value": value, "error": error}


def perplexity(nll: np.ndarray) -> dict:
    """PPL = exp(mean negative log-likelihood) ± PPL·(its standard error)."""
    mean, err = mean_and_error(nll)
    ppl = math.exp(mean)
    return value_error(ppl, ppl * err)


def summarize(nll_q: np.ndarray, nll_base: np.ndarray, kld: np.ndarray, p_diff: np.ndarray,
              same_top: np.ndarray) -> dict:
    """Every figure of llama.cpp's KL-divergence summary for one quant against the base."""
    n = len(nll_q)
    lq, eq = mean_and_error(nll_q)
    lb, eb = mean_and_error(nll_base)
    cov = covariance_of_means(nll_q, nll_base)
    ppl_q, ppl_b = perplexity(nll_q), perplexity(nll_base)
    ln_ratio = lq - lb
    ln_ratio_err = math.sqrt(max(eq * eq + eb * eb - 2.0 * cov, 0.0))
    ratio = math.exp(ln_ratio)
    diff_err2 = ppl_q["error"] ** 2 + ppl_b["error"] ** 2 - 2.0 * ppl_q["value"] * ppl_b["value"] * cov
    kld_mean, kld_err = mean_and_error(kld)
    dp_mean, dp_err = mean_and_error(p_diff)
    mse, mse_err = mean_and_error(np.asarray(p_diff, dtype=np.float64) ** 2)
    rms = math.sqrt(mse)
    same = float(np.count_nonzero(same_top)) / n if n else 0.0
    out = {
        "positions": n,
        "ppl": ppl_q,
        "ppl_base": ppl_b,
        "cor_ln_ppl": cov / (eq * eb) if eq > 0 and eb > 0 else None,
        "ln_ppl_ratio": value_error(ln_ratio, ln_ratio_err),
        "ppl_ratio": value_error(ratio, ratio * ln_ratio_err),
        "ppl_diff": value_error(ppl_q["value"] - ppl_b["value"], math.sqrt(max(diff_err2, 0.0))),
        "kld": {"mean": kld_mean, "error": kld_err},
        "delta_p": {"mean": dp_mean, "error": dp_err, "rms": rms, "rms_error": 0.5 / rms * mse_err if rms > 0 else 0.0},
        "same_top_p": value_error(same, math.sqrt(same * (1.0 - same) / (n - 1)) if n > 1 else 0.0),
        "distribution": n >= MIN_COUNT_FOR_DISTRIBUTION,
    }
    if n:
        out["kld"].update(distribution(kld, KLD_PERCENTILES))
        out["delta_p"].update(distribution(p_diff, DELTA_P_PERCENTILES))
    return out
