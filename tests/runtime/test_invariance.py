"""Greedy exactness in half precision (runtime/backend.py, "batch invariance"): a bfloat16 model
computes every row of a batch as a batch of that one row would — products row by row in float32,
each query attending alone over the whole fixed-size K/V buffer, the delta rule token by token —
so the verification forward of k+1 tokens gives each row the bits of k+1 one-row forwards, and
speculative greedy decoding gives exactly the tokens of plain decoding, prompt split included.

On a tiny Qwen3.5, dense and MoE, made wide enough (hidden 1024, 128 x 128 Gated DeltaNet states)
that the batched forms do change bits; on the CPU's backend and on the torch reference (routed
experts by index, as on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from specconv.runtime import load_model
from specconv.runtime.backend import Experts, batch_invariant
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.drafters import MtpDrafter
from specconv.runtime.graphs.ops import swiglu
from tests.fixtures.invariance import BACKENDS, K, greedy_check, synthetic, use_backend, verification_rows_check
from tests.fixtures.experts import routing as _routing, stored_experts as _stored_experts
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf

torch.set_num_threads(1)
# the tiny fixture's heads, rope and vocabulary, with real models' widths where sums are long
WIDE = {"hidden_size": 1024, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
WIDE_FFN = {False: {"intermediate_size": 2048},
            True: {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512}}


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """The CPU's own backend, or the torch reference (what CUDA runs where no Triton kernel applies)."""
    return use_backend(request.param, monkeypatch)


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def model(request, tmp_path_factory):
    text = {**WIDE, **WIDE_FFN[request.param]}
    path = tiny_gguf(tmp_path_factory, moe=request.param, outtype="q8_0", text_over=text)[1]
    return load_model(path, device="cpu", dtype="bf16")


def test_verification_rows_are_the_bits_of_one_row_forwards(model, backend, monkeypatch):
    ids = [int(t) for t in prompt_ids(14, seed=8)]
    same, _ = verification_rows_check(model, ids, f"{model.hparams.arch}, {backend} backend", monkeypatch)
    assert all(same)


def test_experts_by_index_are_the_bits_of_experts_by_expert_in_half_precision():
    """The two MoE forms (decode/verification vs prompts) in bfloat16, rows alone: equal bit for bit,
    so a token gets the same expert sums in a prompt as in a verification batch."""
    experts = Experts(_stored_experts(6, 32, 64, 1), _stored_experts(6, 32, 64, 2), _stored_experts(6, 64, 32, 3),
                      swiglu)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    weights, chosen = _routing(7, 6, 3, seed=4)
    ref = TorchBackend()
    with batch_invariant(True):
        by_index, by_expert = ref.moe_by_index(x, weights, chosen, experts), ref.moe_by_expert(x, weights, chosen, experts)
        alone = torch.cat([ref.moe_by_index(x[i:i + 1], weights[i:i + 1], chosen[i:i + 1], experts) for i in range(7)])
    assert torch.equal(by_index, by_expert) and torch.equal(by_index, alone)


@pytest.mark.parametrize("drafter", ["synthetic", "mtp"])
def test_greedy_speculative_decoding_in_bfloat16_equals_plain_decoding(model, backend, drafter):
    n = 16
    prompts = [[int(t) for t in prompt_ids(length, seed=seed)] for seed, length in ((1, 1), (2, 7), (3, 12))]
    if drafter == "synthetic":
        make = synthetic(model)
    else:
        def make(prompt, plain):
            return MtpDrafter(model, len(prompt) + n + K + 2, model)
    total, _ = greedy_check(model, prompts, n, make, f"{model.hparams.arch}, {backend} backend, {drafter}")
    assert total > 0
