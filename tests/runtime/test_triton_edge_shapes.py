"""The Triton kernels at the edges of their shapes stay inside their tensors: one block per row, one
output row, one value per row, one expert, a single key cell, head widths that are not powers of
two, 17 rows (past the one-pass products' 16). Under the interpreter each launch runs with the
bounds check of tests/fixtures/triton_guard.py, which fails the test at the first access outside a
tensor argument's storage (a GPU's "illegal memory access"); the values are checked elsewhere
(test_triton_kernels.py, test_cuda_*.py), here only that they are finite.

Interpreter only: skipped where the kernels run compiled on a GPU (the guard wraps the interpreter).
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import ON_GPU  # noqa: E402 (no GPU: the interpreter)

pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.runtime import kernels_triton as kt  # noqa: E402
from tests.fixtures import triton_guard  # noqa: E402
from tests.runtime.test_triton_kernels import encoded  # noqa: E402

pytestmark = [
    pytest.mark.skipif(ON_GPU, reason="the bounds check wraps the interpreter; on a GPU kernels run compiled"),
    pytest.mark.skipif(os.environ.get("SPECCONV_TRITON_GUARD") == "0", reason="SPECCONV_TRITON_GUARD=0"),
]

# values per block: a row of one block (the float types: 3 values, part of one 32-value step)
ONE_BLOCK = {QType.Q8_0: 32, QType.Q4_K: 256, QType.Q5_K: 256, QType.Q6_K: 256, QType.BF16: 3, QType.F16: 3}


@pytest.fixture(autouse=True)
def guarded():
    assert triton_guard._installed, "the kernels would run without the bounds check"


def finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors)


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("n_out", [1, 17])
@pytest.mark.parametrize("qtype", list(ONE_BLOCK), ids=lambda q: q.name)
def test_products_of_one_block_rows(qtype, n_out, rows):
    n_in = ONE_BLOCK[qtype]
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
    y = kt.quant_matmul(x, encoded(qtype, n_out, n_in, seed=n_out), qtype, n_out, n_in)
    assert y.shape == (rows, n_out) and finite(y)


@pytest.mark.parametrize("width", [1, 3, 130])
def test_norms_and_gates_of_narrow_rows(width):
    x = torch.randn(17, width, dtype=torch.bfloat16)
    w = torch.randn(width, dtype=torch.bfloat16)
    assert finite(kt.rms_norm(x, w, 1e-6), kt.rms_norm(x, w, 1e-6, residual=x.flip(0))[0],
                  kt.l2_norm(x, 1e-6), kt.silu_mul(x, x.flip(0)))


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("head_dim", [2, 10])
def test_rope_of_narrow_heads(head_dim, style):
    x = torch.randn(5, 3, head_dim)
    cos, sin = torch.randn(5, head_dim // 2), torch.randn(5, head_dim // 2)
    assert finite(kt.rope(x, cos, sin, style))


@pytest.mark.parametrize("experts,k", [(1, 1), (7, 3)])
def test_routers_of_few_experts(experts, k):
    logits = torch.randn(17, experts)
    weights, chosen = kt.softmax_topk(logits, k)
    assert finite(weights) and bool(((chosen >= 0) & (chosen < experts)).all())
    weights, chosen = kt.grouped_topk(logits, k, True, torch.randn(experts))
    assert finite(weights) and bool(((chosen >= 0) & (chosen < experts)).all())


@pytest.mark.parametrize("n,heads,kv_heads,dk,dv,cells",
                         [(1, 1, 1, 1, 1, 1), (3, 4, 2, 5, 7, 3), (17, 6, 3, 72, 40, 40)])
def test_attention_of_odd_heads_and_few_cells(n, heads, kv_heads, dk, dv, cells):
    q, k, v = torch.randn(n, heads, dk), torch.randn(cells, kv_heads, dk), torch.randn(cells, kv_heads, dv)
    q_pos, k_pos = torch.arange(n) % cells, torch.arange(cells)  # each query sees its own cell at least
    plain = kt.attention(q, k, v, q_pos, k_pos, 0.1, window=2)
    gated = kt.attention(q, k, v, q_pos, k_pos, 0.1, gate=torch.randn(n, heads, dv), sinks=torch.randn(heads))
    assert plain.shape == (n, heads, dv) and finite(plain, gated)
