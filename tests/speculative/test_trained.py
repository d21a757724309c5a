"""Speculative decoding on the bundled trained model, whose MTP head accepts often enough to exercise
partial acceptance at every depth with real drafts: greedy output stays identical to plain decoding."""

from __future__ import annotations

import pytest

from specconv.runtime import load_model
from specconv.runtime.drafters import MtpDrafter, NgramDrafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate

N = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from specconv.demo.bundled import bundled_model_dir
    from tests.fixtures.gguf_files import convert_gguf

    out = convert_gguf(bundled_model_dir(), tmp_path_factory.mktemp("bundled") / "tiny.gguf", mtp="embed")
    model = load_model(out, device="cpu")
    texts = ["import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n",
             "class Counter:\n    def __init__(self, start=0):\n        self.value = start\n\n    def increment(self):\n"]
    prompts = [model.tokenizer.encode(t) for t in texts]
    return model, prompts, [generate(model, p, N).tokens for p in prompts]


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_trained_head_greedy_equals_plain(trained, kind):
    model, prompts, plain = trained
    hist, accepted, drafted = {}, 0, 0
    for k in (1, 2, 3, 4):
        for rollback in ("snapshot", "checkpoint"):
            for p, ref in zip(prompts, plain):
                drafter = MtpDrafter(model, 512, model) if kind == "mtp" else NgramDrafter()
                res = speculative_generate(model, drafter, p, N, SpecConfig(draft_max=k, rollback=rollback))
                assert res.tokens == ref, (kind, k, rollback)
                s = res.stats["speculative"]
                accepted, drafted = accepted + s["accepted"], drafted + s["drafted"]
                for j, c in s["acceptance_histogram"].items():
                    hist[int(j)] = hist.get(int(j), 0) + c
    print(f"trained model, {kind}: accepted {accepted}/{drafted}, rounds by accepted count {dict(sorted(hist.items()))}")
    assert 0 < accepted < drafted
    if kind == "mtp":  # rejections after 0, 1, 2 and 3 accepted drafts, and full acceptance
        assert all(hist.get(j, 0) > 0 for j in range(5))
