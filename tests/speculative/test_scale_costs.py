"""Cost ratios in verify and the model card, and benchmarks/spec_scale.py on a tiny Qwen3.5 GGUF.

* `predicted`: E(α, k) / (t(k+1)/t(1) + k·c + c_round), checked on hand-computed numbers;
* verify measures t(n)/t(1) for n = 1..k+1 for the runtime and for llama.cpp on the same file, the
  drafter's c, and the predicted speed-up at the measured α; the report's JSON round-trips through
  the card's reader and the card shows both runners; a malformed `costs` is refused with its key;
* the benchmark (quick) runs the synthetic drafter with output identical to plain decoding, reports
  the bound and auto's choices, and rewrites only its own docs section, with a PNG plot.
"""

from __future__ import annotations

import json

import pytest
import torch

from specconv.errors import SpecconvError
from specconv.hub.card import verify_section
from specconv.hub.report import parse_report
from specconv.verify import VerifyOptions, run_verify
from specconv.verify.costs import predicted
from tests.fixtures import speculative_models
from tests.fixtures.peers import require_llama_cpp

torch.set_num_threads(1)


def test_predicted_speedup_formula():
    p = predicted(0.5, [1.0, 1.1, 1.2, 1.3], 0.1, 0.2, 3)
    # k=1: E = 1.5, cost 1.1 + 0.1 + 0.2 = 1.4; k=2: E = 1.75, cost 1.2 + 0.2 + 0.2; k=3: E = 1.875, cost 1.8
    assert p["by_k"]["1"] == pytest.approx(1.5 / 1.4)
    assert p["by_k"]["2"] == pytest.approx(1.75 / 1.6)
    assert p["by_k"]["3"] == pytest.approx(1.875 / 1.8)
    assert p["best_k"] == 2 and p["best"] == pytest.approx(1.75 / 1.6)
    assert predicted(None, [1.0, 1.1], 0.1, 0.1, 1)["best"] is None
    assert predicted(0.5, [1.0, 1.1], None, None, 1)["best"] is None


@pytest.fixture(scope="module")
def report():
    require_llama_cpp()
    path = speculative_models.gguf("embedded")
    return run_verify(VerifyOptions(model=path, n_predict=8, draft_max=3, device="cpu", thorough=True))  # llama.cpp too


def test_verify_reports_costs_for_both_runners(report):
    s = report.to_json()["speculative"]
    costs = s["costs"]
    assert costs["drafter"] == "mtp" and costs["alpha"] == s["alpha"]
    for runner in ("specconv", "llama.cpp"):
        c = costs[runner]
        assert "error" not in c, c
        print(f"\n[verify costs, {runner}] t(n)/t(1) {[round(r, 2) for r in c['target_ratios']]}, c {c['c']}, "
              f"predicted {c['predicted']['best']} at k={c['predicted']['best_k']}")
        assert len(c["target_ratios"]) == 4 and c["target_ratios"][0] == 1.0
        assert all(t > 0 for t in c["target_seconds"])
        assert c["c"] is not None and c["c"] > 0  # an MTP step costs something in both runtimes
        assert set(c["predicted"]["by_k"]) == {"1", "2", "3"}
    ours = costs["specconv"]
    k = 1
    expected = (1 + s["alpha"]) / (ours["target_ratios"][k] + k * ours["c"] + ours["c_round"])
    assert ours["predicted"]["by_k"]["1"] == pytest.approx(expected)


def test_card_shows_costs_and_reader_checks_them(report):
    data = json.loads(json.dumps(report.to_json()))
    parsed = parse_report(data)
    card = verify_section(parsed)
    print(card)
    assert "### Cost ratios and the speed-up they predict" in card
    assert "| specconv |" in card and "| llama.cpp |" in card
    ratios = data["speculative"]["costs"]["llama.cpp"]["target_ratios"]
    assert f"{ratios[1]:.2f}" in card
    data["speculative"]["costs"]["specconv"]["target_ratios"] = ["fast"]
    with pytest.raises(SpecconvError, match=r"speculative.costs.specconv.target_ratios\[0\]"):
        parse_report(data)
    data["speculative"]["costs"] = {"specconv": {"error": "not run"}}
    assert "not measured: not run" in verify_section(parse_report(data))
    synthetic = {"speculative": {"synthetic": True, "drafted": 3, "accepted": 2}}
    assert "synthetic drafter" in verify_section(parse_report(synthetic))


def test_benchmark_quick(tmp_path):
    require_llama_cpp()
    from benchmarks import spec_scale

    path = speculative_models.gguf("embedded")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nbefore\n\n<!-- BEGIN other -->\nkept\n<!-- END other -->\n")
    args = ["--model", str(path), "--quick", "--threads", "1", "--docs", str(docs), "--plot", str(tmp_path / "p.png")]
    out = spec_scale.main(args)
    res = out["results"][0]
    assert len(res["specconv_ratios"]) == 4 and len(res["llamacpp"]["target_ratios"]) == 4
    rows = {(r["acceptance"], r["k"]): r for r in res["rows"]}
    assert set(rows) == {(0.8, 1), (0.8, 3), (0.8, "auto"), (0.0, "auto")}
    assert all(r["exact"] for r in res["rows"])
    assert rows[(0.8, 3)]["bound"] > 0 and rows[(0.0, "auto")]["tokens_per_forward"] == pytest.approx(1.0, abs=0.2)
    spec_scale.main(args)  # twice: the section is replaced, not appended
    text = docs.read_text()
    assert text.count(spec_scale.BEGIN) == 1 and "kept" in text and "before" in text
    assert "| embedded" in text and "Goals:" in text
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
