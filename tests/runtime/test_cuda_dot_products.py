"""The tensor-core form of the one-pass product (kernels_triton._quant_jit._dot_sums): Q8_0 matrices kept
as Q8_0_ROWS (runtime/rows_first.py) times 1-16 rows of bfloat16 / float16 values, padded to 16 rows:

* which products take it: Q8_0_ROWS with 16-bit rows; never float32 rows, the K-quants, 16-bit
  float weights or the file's Q8_0 layout (kernels_triton/matmul.py `uses_dot`), a choice that does
  not depend on the number of rows;
* the product within one rounding of the result's dtype of the float64 product of gguf.quants'
  values (the max |Δ| printed);
* a row alone (the first, a middle and the last of the tile) gets the bits it gets in batches of 3
  and 16: the batch-invariance that keeps greedy speculative decoding equal to plain decoding;
* a grouped launch, the GLU input and the norm tail give the bits of the single product, of glu then
  the product, of the product then the norm; the GLU input is one glu launch before the product (the
  padded rows would make every tile compute it 16 times over);
* products cut along their inner dimension (2 stand-in multiprocessors here) and not.

Without a GPU the kernels run in Triton's interpreter (no bfloat16 arithmetic: the tensor-core form
multiplies in IEEE float32 there); with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from tests.fixtures.triton_mode import DEVICE, WHERE, record_launches  # first: the interpreter without a GPU
from specconv.runtime import kernels_triton as kt, rows_first
from specconv.runtime.kernels_triton import matmul as qm
from specconv.runtime.rows_first import Q8_0_ROWS
from tests.fixtures.quant_rows import sane_rows

torch.set_num_threads(1)
# (file type, n_out, n_in): 72 x 512 (16 blocks: cut into 4 pieces here, two 64-row tiles, the second
# partial), 150 x 256 (3 tiles, 2 pieces) and 520 x 256 (9 tiles: not cut)
SHAPES = [(QType.Q8_0, 72, 512), (QType.Q8_0, 150, 256), (QType.Q8_0, 520, 256)]


def matrix(file_type: QType, n_out: int, n_in: int, seed: int):
    """(bytes as the CUDA backend keeps them, their type, float32 values by gguf.quants)."""
    packed = sane_rows(file_type, n_out, n_in, seed=seed)
    values = torch.from_numpy(dequantize(packed.numpy(), file_type).copy()).reshape(n_out, n_in)
    kind = rows_first.kept_as(file_type, (n_out, n_in))
    if kind is not None:
        return rows_first.to_rows_layout(packed, kind).to(DEVICE), kind, values
    return packed.to(DEVICE), file_type, values


def rows_of(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def test_which_products_take_the_tensor_cores():
    assert qm.uses_dot(Q8_0_ROWS, torch.bfloat16) and qm.uses_dot(Q8_0_ROWS, torch.float16)
    assert not qm.uses_dot(Q8_0_ROWS, torch.float32)
    for qtype in (QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16, QType.F16, QType.F32):
        assert not qm.uses_dot(qtype, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("file_type, n_out, n_in", SHAPES)
def test_each_row_gets_its_own_bits_within_one_rounding(file_type, n_out, n_in, dtype):
    w, qtype, values = matrix(file_type, n_out, n_in, seed=n_out + n_in)
    cut = qm.split_plan(qtype, n_out, n_in // qm.GEOMETRY[qtype][0], DEVICE, dtype)[0]
    x = rows_of(16, n_in, dtype, seed=5)
    batch = kt.quant_matmul(x, w, qtype, n_out, n_in)
    want = x.double().cpu() @ values.double().t()
    err = (batch.double().cpu() - want).abs().max().item()
    ulp = torch.finfo(dtype).eps * want.abs().max().item()
    print(f"{WHERE} {qtype.name} {n_out}x{n_in} in {cut} pieces, {dtype}: max |Δ| {err:.3g} against float64 "
          f"(the output's ulp at its largest value: {ulp:.3g})")
    assert err <= ulp
    for i in (0, 6, 15):  # the first, a middle and the last row of the padded tile, each alone
        assert torch.equal(kt.quant_matmul(x[i:i + 1], w, qtype, n_out, n_in), batch[i:i + 1]), i
    assert torch.equal(kt.quant_matmul(x[4:7], w, qtype, n_out, n_in), batch[4:7])


@pytest.mark.parametrize("file_type, n_out, n_in", SHAPES[:2])
def test_grouped_glu_and_norm_tail_forms_keep_the_single_products_bits(file_type, n_out, n_in, monkeypatch):
    w, qtype, _ = matrix(file_type, n_out, n_in, seed=51)
    w2, _, _ = matrix(file_type, 64, n_in, seed=52)
    x, up = rows_of(4, n_in, torch.bfloat16, seed=9), rows_of(4, n_in, torch.bfloat16, seed=10)
    grouped = kt.grouped_matmul(x, [w, w2], qtype, [n_out, 64], n_in)
    assert torch.equal(grouped[0], kt.quant_matmul(x, w, qtype, n_out, n_in))
    assert torch.equal(grouped[1], kt.quant_matmul(x, w2, qtype, 64, n_in))
    launched = record_launches(monkeypatch)
    fused = kt.quant_matmul(x, w, qtype, n_out, n_in, up=up, act="silu")
    assert launched == ["glu_kernel", "fused_rows_kernel"]
    assert torch.equal(fused, kt.quant_matmul(kt.glu(x, up, "silu"), w, qtype, n_out, n_in))
    h = rows_of(4, 64, torch.bfloat16, seed=11)  # the norm tail's stream: 64 values wide
    norm_w = (1 + 0.5 * torch.randn(64, generator=torch.Generator().manual_seed(12))).to(DEVICE)
    s, o = kt.quant_matmul_add_rms_norm(x, w2, qtype, 64, n_in, h, norm_w, 1e-6)
    s_ref, o_ref = kt.rms_norm(h, norm_w, 1e-6, residual=kt.quant_matmul(x, w2, qtype, 64, n_in))
    assert torch.equal(s, s_ref) and torch.equal(o, o_ref)
