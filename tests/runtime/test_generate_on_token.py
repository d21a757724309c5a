"""generate(on_token=...): called once per chosen token, in order, with the tokens the result holds,
each call after the step that chose it (a caller timing the steps: benchmarks/cuda_decode.py)."""

import torch

from specconv.runtime import load_model
from specconv.runtime.generate import generate
from tests.fixtures.runtime_common import tiny_gguf

torch.set_num_threads(1)


def test_each_token_is_reported_as_it_is_chosen(tmp_path_factory):
    model = load_model(tiny_gguf(tmp_path_factory)[1], device="cpu")
    seen, calls = [], []
    result = generate(model, [5, 9, 13, 2], 7, on_token=lambda t: seen.append(t) or calls.append(model.weights.counter.bytes))
    assert seen == result.tokens and len(seen) == 7
    assert generate(model, [5, 9, 13, 2], 7).tokens == result.tokens  # the callback changes nothing
    assert all(a < b for a, b in zip(calls, calls[1:]))  # each call after one more step's weight reads
