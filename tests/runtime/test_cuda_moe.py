"""Routed experts by index on the CUDA backend (runtime/backend_cuda_experts.py `moe_by_pairs`,
runtime/kernels_triton `expert_matmul`): each (row, slot) pair multiplied by its expert in one launch,
the expert index read on the device.

Checked against the one-row product by the same expert (`quant_matmul` of that expert's 2-D slice,
bit for bit), against the torch reference's by-index form through the same backend (bit for bit:
the same products summed in the same order) and against float64 products of the dequantized experts.
Without a GPU the kernels run in Triton's interpreter; with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import kernels_triton as kt  # noqa: E402
from specconv.runtime.backend import Experts  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.dequant import dequantize_rows  # noqa: E402
from specconv.runtime.graphs.ops import swiglu  # noqa: E402
from specconv.runtime.stored import StoredWeight  # noqa: E402
from tests.fixtures.quant_rows import sane_rows  # noqa: E402

torch.set_num_threads(1)
N_EXPERT, HIDDEN, FFN = 5, 256, 64  # whole blocks: Q4_K rows of 256, Q8_0 rows of 64


def stored_experts(qtype: QType, n_out: int, n_in: int, seed: int, dtype=torch.float32) -> StoredWeight:
    raw = sane_rows(qtype, N_EXPERT * n_out, n_in, seed=seed)
    raw = raw.reshape(N_EXPERT, n_out, raw.shape[-1]).to(DEVICE)
    return StoredWeight(raw, qtype, (N_EXPERT, n_out, n_in), dtype, DEVICE)


def routing(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(N_EXPERT, generator=gen)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=gen)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), chosen.to(DEVICE)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.BF16], ids=lambda t: t.name)
def test_each_pair_has_the_bits_of_a_one_row_product_by_its_expert(qtype):
    experts = stored_experts(qtype, FFN, HIDDEN, seed=1)
    chosen = torch.tensor([3, 0, 3, 4, 1, 2, 0], device=DEVICE)  # repeats and every expert
    x = torch.randn(chosen.shape[0], HIDDEN, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    y = kt.expert_matmul(x, experts.raw, qtype, FFN, HIDDEN, chosen)
    assert y.shape == (7, FFN) and y.dtype == x.dtype
    for r, e in enumerate(chosen.tolist()):
        alone = kt.quant_matmul(x[r:r + 1], experts.raw[e], qtype, FFN, HIDDEN)
        assert torch.equal(y[r:r + 1], alone), (qtype, r)
    values = dequantize_rows(experts.raw.cpu(), qtype, torch.float64)
    exact = torch.stack([x[r].cpu().double() @ values[e].t() for r, e in enumerate(chosen.tolist())])
    scale = torch.stack([x[r].cpu().double().abs() @ values[e].abs().t() for r, e in enumerate(chosen.tolist())])
    worst = float(((y.cpu().double() - exact).abs() / (torch.finfo(torch.float32).eps * scale)).max())
    print(f"\n[expert_matmul {qtype.name}] max |Δ| = {worst:.2f} eps·Σ|x·w| against float64")
    assert worst <= 4


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_routed_experts_by_pairs_are_the_bits_of_experts_by_index(cuda_backend, n, dtype, monkeypatch):
    """moe_by_pairs (one launch per product over all pairs) against moe_by_index (each row's experts
    taken one by one, each product a one-row quant_matmul) through the same backend: equal bits; and
    the pairs path is what moe takes for stored experts of a kernel type."""
    experts = Experts(stored_experts(QType.Q8_0, FFN, HIDDEN, 3, dtype), stored_experts(QType.Q4_K, FFN, HIDDEN, 4, dtype),
                      stored_experts(QType.Q8_0, HIDDEN, FFN, 5, dtype), swiglu)
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n)).to(DEVICE).to(dtype)
    weights, chosen = routing(n, 3, seed=n)
    taken = []
    pairs = cuda_backend.moe_by_pairs
    monkeypatch.setattr(cuda_backend, "moe_by_pairs", lambda *a: taken.append(1) or pairs(*a))
    got = cuda_backend.moe(x, weights, chosen, experts)
    assert taken, "stored experts of a kernel type take the pairs path"
    by_index = cuda_backend.moe_by_index(x, weights, chosen, experts)
    assert torch.equal(got, by_index)
    ref = TorchBackend().moe_by_expert(x.cpu().double(), weights.cpu().double(), chosen.cpu(),
                                       dense_experts(experts))
    diff = float((got.cpu().double() - ref).abs().max() / ref.abs().max())
    print(f"\n[moe by pairs, n={n}, {dtype}] equal bits to by index; max |Δ| / max |y| against float64 {diff:.1e}")
    assert diff <= (1e-5 if dtype == torch.float32 else 3e-2)


def dense_experts(experts: Experts) -> Experts:
    def values(w):
        return dequantize_rows(w.raw.cpu(), w.qtype, torch.float64)
    return Experts(values(experts.gate), values(experts.up), values(experts.down), swiglu)


def test_dense_experts_take_the_reference_path(cuda_backend, monkeypatch):
    gate = torch.randn(N_EXPERT, FFN, HIDDEN, device=DEVICE)
    experts = Experts(gate, gate.clone(), torch.randn(N_EXPERT, HIDDEN, FFN, device=DEVICE), swiglu)
    monkeypatch.setattr(cuda_backend, "moe_by_pairs", lambda *a: pytest.fail("dense experts took the pairs path"))
    weights, chosen = routing(2, 2, seed=7)
    x = torch.randn(2, HIDDEN, device=DEVICE)
    assert cuda_backend.moe(x, weights, chosen, experts).shape == (2, HIDDEN)


def test_bad_input_one_line_errors():
    experts = stored_experts(QType.Q8_0, FFN, HIDDEN, seed=8)
    x = torch.randn(3, HIDDEN, device=DEVICE)
    cases = [
        (lambda: kt.expert_matmul(x, experts.raw, QType.Q8_0, FFN, HIDDEN, torch.zeros(3, 1, dtype=torch.long, device=DEVICE)),
         "1-D tensor of integer"),
        (lambda: kt.expert_matmul(x, experts.raw, QType.Q8_0, FFN, HIDDEN, torch.zeros(3, device=DEVICE)),
         "integer expert indices"),
        (lambda: kt.expert_matmul(x[:2], experts.raw, QType.Q8_0, FFN, HIDDEN, torch.zeros(3, dtype=torch.long, device=DEVICE)),
         "x has shape"),
        (lambda: kt.expert_matmul(x, experts.raw[0], QType.Q8_0, FFN, HIDDEN, torch.zeros(3, dtype=torch.long, device=DEVICE)),
         "3-D packed tensor"),
    ]
    for call, message in cases:
        with pytest.raises(SpecconvError, match=message):
            call()
