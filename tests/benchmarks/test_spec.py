"""benchmarks/spec_decode.py on a short run of the bundled model: consistent metrics, exact output,
llama.cpp's draft-mtp loop agreeing with ours, and the docs section rewritten in place.

Evidence:
* every row: AL − 1 == Σ per_position, per_position non-increasing, accepted ≤ drafted,
  tokens/forward ≤ k + 1; the statistics' target forwards equal the context's own decode-call
  count (minus the prompt's one call), plus the re-decodes in checkpoint mode;
* the speculative tokens equal an independent plain run, for every draft_max and both rollbacks;
* snapshot and checkpoint rollback accept the same drafts (the rollback changes the cost, not the
  tokens); checkpoint mode re-evaluates the kept tokens of the rounds that rejected a draft;
* llama.cpp (the independent peer) emits the same greedy tokens and accepts the same drafts;
* the markdown section replaces only its own block; the plot is a PNG.
"""

from __future__ import annotations

import pytest

from benchmarks import spec_decode, spec_report

from tests.fixtures.peers import require_llama_cpp

N_PROMPTS, PROMPT_TOKENS, N_PREDICT, K = 2, 24, 16, 2


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    files, src, target, prompts = spec_decode.load_setup("f32", tmp_path_factory.mktemp("bench"), "cpu",
                                                         N_PROMPTS, PROMPT_TOKENS)
    ours = spec_decode.run_ours(target, prompts, N_PREDICT, K, repeats=1, checkpoint=True, progress=lambda m: None)
    return files, target, prompts, ours


def test_metrics_are_consistent(short_run):
    _, _, prompts, ours = short_run
    assert len(ours["rows"]) == 2 * K
    for r in ours["rows"]:
        k = r["draft_max"]
        print(f"{r['rollback']} k={k}: per-position {r['per_position']}, AL {r['acceptance_length']:.3f}, "
              f"tokens/forward {r['tokens_per_target_forward']:.3f}, forwards {r['target_forwards']}, "
              f"re-decodes {r['redecode_forwards']}")
        assert r["drafts"] > 0
        assert abs((r["acceptance_length"] - 1) - sum(r["per_position"])) < 1e-12
        assert all(a >= b for a, b in zip(r["per_position"], r["per_position"][1:]))
        assert r["accepted"] <= r["drafted"] <= k * r["drafts"]
        assert r["tokens_per_target_forward"] <= k + 1
        assert r["generated"] == N_PREDICT * len(prompts)
        assert r["target_decode_calls"] - len(prompts) == r["target_forwards"]
        assert r["target_forwards"] == r["rounds"] + r["redecode_forwards"]
        assert r["speedup"] == pytest.approx(r["plain_seconds"] / r["seconds"])
        assert r["plain_target_forwards"] == N_PREDICT * len(prompts)


def test_speculative_output_equals_plain(short_run):
    from specconv.runtime.generate import generate

    _, target, prompts, ours = short_run
    independent = [generate(target, list(p.ids), N_PREDICT).tokens for p in prompts]
    assert ours["plain_tokens"] == independent
    assert ours["all_exact"] and all(r["exact"] and not r["diverged_prompts"] for r in ours["rows"])


def test_rollback_changes_cost_not_acceptance(short_run):
    _, _, _, ours = short_run
    snap = {r["draft_max"]: r for r in ours["rows"] if r["rollback"] == "snapshot"}
    for c in (r for r in ours["rows"] if r["rollback"] == "checkpoint"):
        s = snap[c["draft_max"]]
        assert (c["accepted"], c["drafted"], c["per_position"]) == (s["accepted"], s["drafted"], s["per_position"])
        assert s["redecode_forwards"] == 0 and s["reevaluated_tokens"] == 0
        hist = {int(a): n for a, n in c["acceptance_histogram"].items()}
        # one re-decode of the j+1 kept tokens per round that rejected a draft; a round that rejected
        # accepted fewer than draft_max, and only the budget-cut rounds at the end of a prompt (those that
        # drafted fewer than draft_max) can accept fewer than draft_max without rejecting
        short = c["drafts"] - c["per_position_drafted"][-1]
        below_k = sum(n for a, n in hist.items() if a < c["draft_max"])
        assert below_k - short <= c["redecode_forwards"] <= below_k
        assert c["redecode_forwards"] <= c["reevaluated_tokens"] <= c["redecode_forwards"] * c["draft_max"]
        assert c["redecode_forwards"] > 0  # the short run does exercise the checkpoint path


def test_llamacpp_draft_mtp_agrees(short_run):
    require_llama_cpp()
    files, _, prompts, ours = short_run
    llama = spec_decode.run_llamacpp(files, prompts, N_PREDICT, K, 1, ours["plain_tokens"], ours["rows"],
                                     progress=lambda m: None)
    assert "skipped" not in llama, llama
    for r in llama["rows"]:
        print(f"llama.cpp k={r['draft_max']}: per-position {r['per_position']}, tokens/forward "
              f"{r['tokens_per_target_forward']:.3f}, same tokens {r['same_tokens_as_ours']}")
        assert abs((r["acceptance_length"] - 1) - sum(r["per_position"])) < 1e-12
        assert r["exact"] and r["same_tokens_as_ours"] and r["same_counts_as_ours"]
    assert all(llama["plain_equals_ours"]) and llama["sidecar_equals_embedded"]


def test_docs_section_and_plot(short_run, tmp_path):
    _, target, _, ours = short_run
    res = {"settings": {"outtype": "f32", "prompt_tokens": PROMPT_TOKENS, "n_predict": N_PREDICT, "threads": 1,
                        "repeats": 1},
           "date": "today", "machine": "test", "device": str(target.device), "ours": ours,
           "llamacpp": {"skipped": "not run here"}, "training": {}, "seconds": 1.0}
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Conversion throughput\n\nother helper's numbers\n")
    for _ in range(2):  # rewriting replaces the block instead of adding a second one
        spec_report.write_section(doc, spec_report.markdown(res, "spec_decode.png"))
    text = doc.read_text()
    assert text.count(spec_report.BEGIN) == 1 and text.count(spec_report.END) == 1
    assert "other helper's numbers" in text and "## Speculative decoding" in text
    first = next(r for r in ours["rows"] if r["draft_max"] == 1 and r["rollback"] == "snapshot")
    assert f"| 1 | {first['per_position'][0]:.2f} |" in text
    png = tmp_path / "spec_decode.png"
    spec_report.plot(res, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_forward_costs_measure_every_batch_size(short_run):
    _, target, prompts, _ = short_run
    costs = spec_decode.forward_costs(target, list(prompts[0].ids), K, reps=3)
    print("forward costs:", costs)
    assert sorted(costs["target_ms"]) == list(range(1, K + 2))
    assert all(v > 0 for v in costs["target_ms"].values()) and costs["mtp_ms"] > 0
    assert costs["c"] == pytest.approx(costs["mtp_ms"] / costs["target_ms"][1])
