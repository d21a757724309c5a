"""`specconv compare` on a tiny random Qwen3.5 converted to F32, Q8_0 and Q4_K_M (docs/compare.md).

Every figure of the report is recomputed here from the runtime's full logits of each chunk, evaluated
in one batch (compare evaluates two), in float64 with numpy's own estimators: exact agreement with
`--resident both`; with the compact store (the default) the KL divergence within the bound the report
states and every other figure exact. KLD of a file against itself is 0 with Same top p 100 %; Q4_K_M is
further from the source than Q8_0. The transformers checkpoint as the source gives the F32 file's figures.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from specconv.cli import main as cli_main
from specconv.compare import CompareOptions, run_compare
from specconv.runtime import Context, GraphType, load_model
from tests.fixtures.gguf_files import convert_gguf

CTX = 48
N_CHUNKS = 3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("compare")
    src = build_qwen35(root / "hf", seed=11)
    out = {"hf": src}
    for t in ("f32", "q8_0", "q4_k_m"):
        out[t] = convert_gguf(src, root / f"tiny-{t}.gguf", outtype=t)
    from specconv.demo.bundled import bundled_model_dir

    out["other"] = convert_gguf(bundled_model_dir(), root / "other-q8_0.gguf", outtype="q8_0")  # another model
    rng = np.random.default_rng(0)
    out["tokens"] = root / "tokens.txt"
    out["tokens"].write_text(" ".join(str(t) for t in rng.integers(0, 500, CTX * N_CHUNKS + 7)))
    return out


def _stream(files) -> list[int]:
    return [int(t) for t in files["tokens"].read_text().split()]


def _chunk_logits(path, stream, dtype) -> list[torch.Tensor]:
    """Each chunk's logits [CTX, V] from a fresh context, the whole chunk in one batch."""
    model = load_model(path, device="cpu", dtype=dtype)
    out = []
    for i in range(N_CHUNKS):
        ctx = Context(model, GraphType.MAIN, n_ctx=CTX)
        out.append(ctx.decode(stream[i * CTX:(i + 1) * CTX], hidden=(), logits="all").logits.double())
    return out


def reference(source_logits, quant_logits, stream) -> dict:
    """The figures from full logits: rows CTX/2 .. CTX-2 of every chunk, numpy's estimators."""
    first = CTX // 2
    nll, nll_b, kld, dp, same = [], [], [], [], []
    for i, (ls, lq) in enumerate(zip(source_logits, quant_logits)):
        a = torch.log_softmax(ls[first:CTX - 1], -1)
        b = torch.log_softmax(lq[first:CTX - 1], -1)
        t = torch.tensor(stream[i * CTX + first + 1:(i + 1) * CTX])[:, None]
        nll.append(-b.gather(-1, t)[:, 0])
        nll_b.append(-a.gather(-1, t)[:, 0])
        kld.append((a.exp() * (a - b)).sum(-1))
        dp.append(b.exp().gather(-1, t)[:, 0] - a.exp().gather(-1, t)[:, 0])
        same.append(ls[first:CTX - 1].argmax(-1) == lq[first:CTX - 1].argmax(-1))
    nll, nll_b, kld, dp = (torch.cat(x).numpy() for x in (nll, nll_b, kld, dp))
    same = torch.cat(same).numpy()
    n = len(nll)
    se = lambda x: np.std(x) / math.sqrt(n - 1)  # noqa: E731
    return {"n": n, "ppl": math.exp(nll.mean()), "ppl_err": math.exp(nll.mean()) * se(nll),
            "ppl_base": math.exp(nll_b.mean()), "ln_ratio": nll.mean() - nll_b.mean(), "ln_ratio_err": se(nll - nll_b),
            "kld": kld.mean(), "kld_err": se(kld), "kld_max": kld.max(), "kld_min": kld.min(),
            "kld_p99": np.percentile(kld, 99), "kld_median": np.median(kld), "kld_p10": np.percentile(kld, 10),
            "dp": dp.mean(), "dp_err": se(dp), "dp_rms": math.sqrt((dp ** 2).mean()),
            "dp_p90": np.percentile(dp, 90), "dp_median": np.median(dp), "same": same.mean()}


def compare(files, quants, **kw) -> dict:
    opts = CompareOptions(source=kw.pop("source", files["f32"]), quants=[files[q] for q in quants],
                          tokens=files["tokens"], ctx=CTX, costs=False, device="cpu", **kw)
    return run_compare(opts)


def _check(entry, ref, rel, kld_abs):
    got = {"n": entry["positions"], "ppl": entry["ppl"]["value"], "ppl_err": entry["ppl"]["error"],
           "ppl_base": entry["ppl_base"]["value"], "ln_ratio": entry["ln_ppl_ratio"]["value"],
           "ln_ratio_err": entry["ln_ppl_ratio"]["error"], "kld": entry["kld"]["mean"],
           "kld_err": entry["kld"]["error"], "kld_max": entry["kld"]["max"], "kld_min": entry["kld"]["min"],
           "kld_p99": entry["kld"]["99.0%"], "kld_median": entry["kld"]["median"], "kld_p10": entry["kld"]["10.0%"],
           "dp": entry["delta_p"]["mean"], "dp_err": entry["delta_p"]["error"], "dp_rms": entry["delta_p"]["rms"],
           "dp_p90": entry["delta_p"]["90.0%"], "dp_median": entry["delta_p"]["median"],
           "same": entry["same_top_p"]["value"]}
    worst = 0.0
    for key, want in ref.items():
        if key.startswith("kld") and kld_abs is not None:
            # each position's KLD moves by at most kld_abs, so the mean and every order statistic do; the
            # standard error (std / sqrt(n − 1), std 1-Lipschitz in the RMS) by at most kld_abs / sqrt(n − 1)
            tol = kld_abs / math.sqrt(ref["n"] - 1) if key == "kld_err" else kld_abs
            assert abs(got[key] - want) <= tol, (key, got[key], want, tol)
            continue
        d = abs(got[key] - want)
        worst = max(worst, d / max(abs(want), 1e-12))
        assert d <= rel * max(abs(want), 1e-12) + 1e-15, (key, got[key], want)
    return worst


@pytest.mark.parametrize("resident", ["both", "one"])
def test_figures_equal_a_direct_float64_computation(files, resident):
    """float64 runtime: our two-batch chunks equal the one-batch reference to rounding; the store's KLD
    error stays inside the bound the report states (mean bound for the mean, max bound for each figure)."""
    stream = _stream(files)
    rep = compare(files, ["q8_0", "q4_k_m"], resident=resident, dtype="f64", heads=False)
    src = _chunk_logits(files["f32"], stream, "f64")
    assert rep["text"] == {"tokens": len(stream), "ctx": CTX, "chunks": N_CHUNKS, "scored_per_chunk": CTX // 2 - 1,
                           "scored": N_CHUNKS * (CTX // 2 - 1), "bos_replaces_first_token": False}
    for entry, q in zip(rep["quants"], ["q8_0", "q4_k_m"]):
        ref = reference(src, _chunk_logits(files[q], stream, "f64"), stream)
        bound = entry["kld"]["store_bound"]
        kld_abs = None if resident == "both" else bound["max"]
        worst = _check(entry, ref, 1e-9, kld_abs)
        err = abs(entry["kld"]["mean"] - ref["kld"])
        print(f"{resident} {q}: mean KLD {entry['kld']['mean']:.6e} (reference {ref['kld']:.6e}, |Δ| {err:.1e}, "
              f"store bound mean {bound['mean']:.1e}), other figures max rel Δ {worst:.1e}")
        if resident == "both":
            assert bound == {"mean": 0.0, "max": 0.0}
        else:
            assert err <= bound["mean"] and 0 < bound["mean"] < 0.05 * ref["kld"]


def test_float32_runs_match_the_reference_closely(files):
    """The default compute dtype: the chunked evaluation's float32 rounding is all that differs."""
    stream = _stream(files)
    rep = compare(files, ["q4_k_m"], heads=False)
    ref = reference(_chunk_logits(files["f32"], stream, None), _chunk_logits(files["q4_k_m"], stream, None), stream)
    e = rep["quants"][0]
    print(f"f32: PPL {e['ppl']['value']:.6f} vs {ref['ppl']:.6f}, KLD {e['kld']['mean']:.6e} vs {ref['kld']:.6e}")
    assert e["ppl"]["value"] == pytest.approx(ref["ppl"], rel=1e-5)
    assert e["kld"]["mean"] == pytest.approx(ref["kld"], rel=2e-3)
    assert e["same_top_p"]["value"] == pytest.approx(ref["same"], abs=1.5 / ref["n"])


@pytest.mark.parametrize("resident", ["both", "one"])
def test_file_against_itself(files, resident):
    rep = compare(files, ["f32"], resident=resident, heads=False)
    e = rep["quants"][0]
    print(f"{resident}: KLD(f32, f32) mean {e['kld']['mean']:.1e} max {e['kld']['max']:.1e}, "
          f"bound {e['kld']['store_bound']['mean']:.1e}")
    assert e["same_top_p"] == {"value": 1.0, "error": 0.0}
    assert e["delta_p"]["mean"] == 0.0 and e["delta_p"]["rms"] == 0.0
    assert e["ln_ppl_ratio"]["value"] == 0.0 and e["ppl"] == e["ppl_base"]
    if resident == "both":
        assert e["kld"]["mean"] == 0.0 and e["kld"]["max"] == 0.0
    else:  # the store's codes: not exactly 0, inside the bound, and far below any quant's
        assert abs(e["kld"]["mean"]) <= e["kld"]["store_bound"]["mean"] < 1e-5


def test_coarser_quant_is_further_away(files):
    rep = compare(files, ["q8_0", "q4_k_m"], heads=False)
    q8, q4 = rep["quants"]
    print(f"mean KLD Q8_0 {q8['kld']['mean']:.3e}, Q4_K_M {q4['kld']['mean']:.3e}; RMS Δp "
          f"{q8['delta_p']['rms']:.3e}, {q4['delta_p']['rms']:.3e}")
    assert (q8["type"], q4["type"]) == ("Q8_0", "Q4_K_M")
    assert 0 < q8["kld"]["mean"] < q4["kld"]["mean"]
    assert q8["delta_p"]["rms"] < q4["delta_p"]["rms"]
    assert q8["bits_per_weight"] > q4["bits_per_weight"]
    assert q8["size_bytes"] == files["q8_0"].stat().st_size
    from specconv.digest import sha256_file

    assert q8["sha256"] == sha256_file(files["q8_0"]).hex() != q4["sha256"]


def test_transformers_checkpoint_as_source(files):
    """The checkpoint through transformers gives the F32 file's figures (the runtime matches transformers
    to float32 rounding: docs/reference/peers.md §1.4)."""
    hf = compare(files, ["q4_k_m"], source=files["hf"], heads=False)
    gg = compare(files, ["q4_k_m"], heads=False)
    a, b = hf["quants"][0], gg["quants"][0]
    print(f"source transformers: PPL(base) {a['ppl_base']['value']:.6f}, KLD {a['kld']['mean']:.6e}; source F32 "
          f"GGUF: {b['ppl_base']['value']:.6f}, {b['kld']['mean']:.6e}")
    assert hf["source"]["kind"] == "transformers checkpoint" and hf["source"]["mtp"] is None
    assert a["ppl_base"]["value"] == pytest.approx(b["ppl_base"]["value"], rel=1e-5)
    assert a["kld"]["mean"] == pytest.approx(b["kld"]["mean"], rel=1e-3)
    assert a["ppl"] == b["ppl"]  # the quant's own figures do not depend on the source


def test_cli_json_and_table(files, capsys, monkeypatch):
    args = ["compare", str(files["f32"]), str(files["q8_0"]), str(files["q4_k_m"]), "--tokens", str(files["tokens"]),
            "--ctx", str(CTX), "--chunks", "2", "--no-costs", "--no-mtp", "--device", "cpu"]
    cli_main(args + ["--json"])
    rep = json.loads(capsys.readouterr().out)
    assert [q["type"] for q in rep["quants"]] == ["Q8_0", "Q4_K_M"] and rep["text"]["chunks"] == 2
    monkeypatch.setenv("COLUMNS", "80")
    cli_main(args)
    out = capsys.readouterr().out
    assert "KL divergence" in out and "Q4_K_M" in out and "same top p" in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("extra, message", [
    (["--ctx", "4096"], "needs at least 4096"),
    (["--mtp", "{f32}", "--mtp", "{f32}"], "2 --mtp file(s) for 1 quant(s)"),
    (["{other}"], "other-q8_0.gguf is qwen35 of width 192 and vocabulary 2048"),
])
def test_cli_errors_are_one_line(files, capsys, extra, message):
    args = ["compare", str(files["f32"]), str(files["q8_0"]), "--tokens", str(files["tokens"]), "--device", "cpu"]
    with pytest.raises(SystemExit) as exc:
        cli_main(args + [a.format(**files) for a in extra])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_cli_needs_text_or_tokens(files, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["compare", str(files["f32"]), str(files["q8_0"]), "--device", "cpu"])
    assert exc.value.code == 2 and "--text FILE or --tokens FILE" in capsys.readouterr().err
