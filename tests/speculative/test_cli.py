"""`specconv generate --spec ...`: the same tokens as plain generation, and a `speculative` object
with verify's key names."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specconv import cli
from tests.fixtures import speculative_models

KEYS = {"drafted", "accepted", "acceptance_rate", "acceptance_length", "per_position", "tokens_per_target_forward",
        "bound", "speedup", "rollback"}


def run(*args) -> dict:
    res = CliRunner().invoke(cli.cli, ["generate", *map(str, args), "--json", "--device", "cpu"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spec", ["mtp", "ngram", "draft"])
def test_generate_spec_matches_plain(spec):
    model = speculative_models.gguf("embedded")
    base = ["--tokens", "5,17,42,99,5,17", "-n", "10"]
    plain = run(model, *base)
    extra = ["--draft", model] if spec == "draft" else []
    out = run(model, *base, "--spec", spec, "--draft-max", "3", *extra)
    s = out["speculative"]
    print(f"generate --spec {spec}: {s['accepted']}/{s['drafted']} accepted, speed-up {s['speedup']}")
    assert out["tokens"] == plain["tokens"]
    assert KEYS <= set(s) and s["drafter"] == spec and s["speedup"] is not None
    if spec == "draft":  # the model drafting for itself
        assert s["acceptance_rate"] == 1.0


def test_generate_spec_with_sidecar_and_checkpoint():
    trunk, side = speculative_models.gguf("trunk"), speculative_models.gguf("sidecar")
    base = ["--tokens", "5,17,42,99", "-n", "8"]
    plain = run(trunk, *base)
    out = run(trunk, *base, "--spec", "mtp", "--mtp", side, "--rollback", "checkpoint", "--no-baseline")
    assert out["tokens"] == plain["tokens"] and out["speculative"]["rollback"] == "checkpoint"
    assert out["speculative"]["speedup"] is None


def test_generate_spec_errors():
    trunk = speculative_models.gguf("trunk")
    for args in (["--spec", "mtp"], ["--spec", "draft"], ["--spec", "ngram", "--mtp", trunk]):
        res = CliRunner().invoke(cli.cli, ["generate", str(trunk), "--tokens", "5,17", "-n", "4", "--device", "cpu",
                                           *map(str, args)])
        assert res.exit_code != 0


def test_speculative_json_carries_the_rates_and_weight_bytes():
    """What `generate --help` promises for --json holds for speculative runs too: prompt and decode rates
    and the stored weight bytes the timed run read (the sidecar's own blocks included)."""
    trunk, side = speculative_models.gguf("trunk"), speculative_models.gguf("sidecar")
    base = ["--tokens", "5,17,42,99,5,17", "-n", "12"]
    plain = run(trunk, *base)
    out = run(trunk, *base, "--spec", "mtp", "--mtp", side, "--repeats", "2")
    s = out["speculative"]
    print(f"plain: {plain['decode_tokens_per_second']:.1f} tok/s, {plain['weight_bytes_read']} bytes; spec: "
          f"{out['decode_tokens_per_second']:.1f} tok/s, {out['weight_bytes_read']} bytes")
    for key in ("decode_tokens_per_second", "prompt_tokens_per_second", "weight_bytes_read"):
        assert out[key] is not None and out[key] > 0
    decode = s["seconds"] - s["prompt_seconds"]
    assert out["decode_tokens_per_second"] == pytest.approx(len(out["tokens"]) / decode)
    # every target forward reads the trunk's matrices; drafts read the sidecar's block too
    assert out["weight_bytes_read"] > s["target_forwards"] * plain["weight_bytes_read"] / plain["target_evaluations"] * 0.5
    timing = s["timing"]
    assert len(timing["plain_seconds"]) == len(timing["spec_seconds"]) == 2
    assert timing["spec_seconds"][0] == s["seconds"]  # the first repeat is the output run


def test_no_draft_no_gain():
    """`--spec ngram --draft-max 0` drafts nothing: whatever the clock says, no speed-up is claimed."""
    model = speculative_models.gguf("embedded")
    res = CliRunner().invoke(cli.cli, ["generate", str(model), "--tokens", "5,17,42,99", "-n", "12", "--device", "cpu",
                                       "--spec", "ngram", "--draft-max", "0"], catch_exceptions=False)
    print(res.stderr)
    assert res.exit_code == 0 and "no measurable gain (nothing was drafted" in res.stderr and "speed-up " not in res.stderr
    out = run(model, "--tokens", "5,17,42,99", "-n", "12", "--spec", "ngram", "--draft-max", "0")
    assert out["speculative"]["drafted"] == 0 and out["speculative"]["timing"]["verdict"] == "none"


def test_speedup_verdict_against_the_spread_of_the_repeats():
    from specconv.demo.measure import speedup_text, speedup_verdict

    gain = speedup_verdict([2.0, 2.1, 1.9], [1.0, 1.1, 1.05], drafted=10)
    assert gain["verdict"] == "gain" and gain["speedup"] == pytest.approx(2.0 / 1.05)
    assert gain["range"] == pytest.approx([1.9 / 1.1, 2.1 / 1.0])
    assert speedup_text(gain).startswith("speed-up 1.90x (above the noise")
    overlap = speedup_verdict([1.0, 1.3, 1.1], [1.05, 0.9, 1.0], drafted=10)  # median ratio 1.1, yet within noise
    assert overlap["verdict"] == "none" and speedup_text(overlap).startswith("no measurable gain (within the noise")
    assert speedup_verdict([1.0, 1.1], [2.0, 2.2], drafted=5)["verdict"] == "slower"
    assert speedup_verdict([2.0], [1.0], drafted=5)["reason"] == "one repeat cannot tell a gain from noise"
    assert speedup_verdict([2.0, 2.0], [1.0, 1.0], drafted=0)["verdict"] == "none"
