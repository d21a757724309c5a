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

from specconv.runtime import Context, GraphType, backend as backend_module, context as context_module, load_model
from specconv.runtime.backend import Experts, batch_invariant
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.drafters import MtpDrafter
from specconv.runtime.drafters.synthetic import SyntheticDrafter
from specconv.runtime.generate import generate
from specconv.runtime.graphs.ops import swiglu
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures.experts import routing as _routing, stored_experts as _stored_experts
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf

torch.set_num_threads(1)
K = 3
# the tiny fixture's heads, rope and vocabulary, with real models' widths where sums are long
WIDE = {"hidden_size": 1024, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
WIDE_FFN = {False: {"intermediate_size": 2048},
            True: {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512}}


@pytest.fixture(params=["device", "torch"])
def backend(request, monkeypatch):
    """The CPU's own backend, or the torch reference (what CUDA runs where no Triton kernel applies)."""
    if request.param == "torch":
        monkeypatch.setattr(backend_module, "_backend", lambda kind: TorchBackend())
    return request.param


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def model(request, tmp_path_factory):
    text = {**WIDE, **WIDE_FFN[request.param]}
    path = tiny_gguf(tmp_path_factory, moe=request.param, outtype="q8_0", text_over=text)[1]
    return load_model(path, device="cpu", dtype="bf16")


def _rows_vs_steps(model, ids, split):
    """(logits and post-norm rows of one verification batch ids[split:], the same of one-row forwards
    after the same prefix) — the prefix itself once as one batch, once token by token."""
    batch = Context(model, GraphType.MAIN, n_ctx=len(ids) + 1, n_rs_seq=K)
    batch.decode(ids[:split])
    out = batch.decode(ids[split:])
    steps = Context(model, GraphType.MAIN, n_ctx=len(ids) + 1, n_rs_seq=0, rollback="checkpoint")
    for t in ids[:split]:
        steps.decode([t])
    rows = [steps.decode([t]) for t in ids[split:]]
    return ((out.logits, out.hidden["post_norm"]),
            (torch.cat([r.logits for r in rows]), torch.cat([r.hidden["post_norm"] for r in rows])))


def test_verification_rows_are_the_bits_of_one_row_forwards(model, backend, monkeypatch):
    ids = [int(t) for t in prompt_ids(14, seed=8)]
    (logits, hidden), (one_logits, one_hidden) = _rows_vs_steps(model, ids, len(ids) - K - 1)
    same = [bool(torch.equal(logits[i], one_logits[i]) and torch.equal(hidden[i], one_hidden[i]))
            for i in range(K + 1)]
    monkeypatch.setattr(context_module, "INVARIANT_DTYPES", ())  # the batched forms, for contrast
    (b_logits, _), (o_logits, _) = _rows_vs_steps(model, ids, len(ids) - K - 1)
    without = float((b_logits - o_logits).abs().max())
    print(f"\n[bf16 {model.hparams.arch}, {backend} backend] {K + 1}-row verification vs one-row forwards: "
          f"{sum(same)}/{K + 1} rows bit-identical (max |Δlogit| {float((logits - one_logits).abs().max()):.1e}); "
          f"with the batched forms instead: max |Δlogit| {without:.2e}")
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
    total = accepted = 0
    for seed, length in ((1, 1), (2, 7), (3, 12)):
        prompt = [int(t) for t in prompt_ids(length, seed=seed)]
        plain = generate(model, prompt, n).tokens
        if drafter == "synthetic":  # a drafter right with probability 0.8 per token (measurement drafter)
            made = SyntheticDrafter(prompt + plain, model.n_vocab, 0.8, seed=seed)
        else:
            made = MtpDrafter(model, len(prompt) + n + K + 2, model)
        res = speculative_generate(model, made, prompt, n, SpecConfig(draft_max=K))
        stats = res.stats["speculative"]
        total, accepted = total + stats["drafted"], accepted + stats["accepted"]
        assert res.tokens == plain, (drafter, prompt)
    print(f"\n[bf16 {model.hparams.arch}, {backend} backend, {drafter} k={K}] 3 prompts x {n} tokens identical "
          f"to plain decoding; accepted {accepted}/{total} drafts")
    assert total > 0
