"""benchmarks/cuda_matmul_variants.py: both forms the runtime does not run compute x @ Wᵀ of the packed
Q8_0 matrix (Triton's interpreter here, compiled on a GPU), so the benchmark's timings compare forms
that give the same answer (the runtime's own are tested in tests/runtime/test_cuda_dot_products.py).

Evidence: each form (the split layout per lane, tensor cores over the file's bytes) on random Q8_0
rows, 1, 3 and 5 activation rows, a matrix cut into several pieces and a tile past the last weight
row, against torch's float64 product of gguf.quants' values; the split layout holds the packed
bytes (its decode equals the packed one's).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE, WHERE  # noqa: E402 (no GPU: the interpreter)

from benchmarks import cuda_matmul_variants as variants  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from tests.fixtures.quant_rows import sane_rows  # noqa: E402

N_OUT, N_IN = 40, 256  # a partial last tile of 16 / 32 rows, 8 blocks (cut into pieces by the plan)


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("form, block_n, nb, warps",
                         [("split-lanes", 16, 2, 4), ("split-lanes", 32, 4, 4), ("packed-dot", 16, 1, 4),
                          ("packed-dot", 32, 1, 4)])
def test_each_form_computes_the_product(form, block_n, nb, warps, rows):
    torch.manual_seed(rows * 7 + block_n)
    packed = sane_rows(QType.Q8_0, N_OUT, N_IN, seed=int(torch.randint(0, 2**31, ())))
    dense = torch.from_numpy(dequantize(packed.numpy(), QType.Q8_0).copy()).reshape(N_OUT, N_IN)
    q, d = variants.split_layout(packed, N_OUT, N_IN)
    assert torch.equal(q.double() * d.double().repeat_interleave(32, 1), dense.double())
    x = torch.randn(rows, N_IN)
    packed_d, q_d, d_d, x_d = (t.to(DEVICE) for t in (packed, q, d, x))
    got = variants.run_form(form, x_d, packed_d, q_d, d_d, N_OUT, N_IN, block_n, nb, warps).cpu()
    want = x.double() @ dense.double().t()
    err = (got.double() - want).abs().max().item()
    print(f"{WHERE} {form} N {block_n} NB {nb} rows {rows}: max |Δ| {err:.2e} (against float64)")
    assert err < 1e-5 * max(1.0, want.abs().max().item())
