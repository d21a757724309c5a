"""`specconv generate --spec ...`: the same tokens as plain generation, and a `speculative` object
with verify's key names."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specconv import cli
from tests import speculative_models

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
