"""Float32 weights (the small matrices a graph keeps float32: MoE routers, Qwen3.5's shared-expert
gate) through the one-pass product kernel (runtime/kernels_triton/matmul.py, the F32 decode of
_quant_jit.py), and the CUDA backend taking them there:

* 1, 3 and 16 rows against the exact (float64) product, within the fused products' bound of
  tests/runtime/test_triton_kernels.py (FUSED_BOUND; its derivation covers these shapes, see
  F32_DEPTH below); odd shapes (1, 7, 37 outputs; 100, 352, 2048 inputs, the last cut along its
  inner dimension); the result float32 whatever x's dtype, a bfloat16 / float16 x giving the bits
  of x.float(); a row alone == the same row in a batch of 16; prompts (17+ rows) the bits of torch's
  float32 product; a group of F32 matrices each the bits of its own product;
* CudaBackend.linear: a dense float32 matrix (viewed as bytes, no copy) or a stored F32 one times
  float32 rows through the kernel; rows in another dtype, where the torch reference multiplies in
  that dtype, through the reference (its bits). CudaBackend.linear_wide (acc(x) @ wᵀ, what the
  graphs ask of a router or a gate): bfloat16 rows by an F32 weight straight into the kernel, the
  bits of the widened rows' product; by a weight of another type, the widened rows through `linear`;
* launches of the tiny Qwen3.5 MoE (counted on `meta` by benchmarks/cuda_op_count.py): a block's
  two F32 products (the router, the shared gate) one grouped launch, the same in a decode step and
  in a 4-row verification, where the reference took, per product, the widening cast, a cast and a
  product per row and a concatenation.
Without a GPU the kernels run in Triton's interpreter; with one, compiled on CUDA.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE, ON_GPU  # first: the interpreter without a GPU
from tests.runtime.test_triton_kernels import FUSED_BOUND, exact_product, noise  # skips where Triton is missing
from benchmarks import cuda_op_count
from specconv.runtime import kernels_triton as kt
from specconv.runtime.backend import batch_invariant
from specconv.runtime.backend_cuda import CudaBackend
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.kernels_triton import matmul as qm
from specconv.runtime.stored import StoredWeight
from tests.fixtures.counted_calls import CountedCalls
from tests.fixtures.runtime_common import tiny_gguf

torch.set_num_threads(1)
SHAPES = [(1, 100), (7, 2048), (37, 352)]  # (n_out, n_in): a 100-value row ends inside a 32-value step
MAX_DEPTH = 84  # 21 · (8 / 4)²: FUSED_BOUND's margin over the measured worst halved (f32_depth)


def f32_depth(n_out: int, n_in: int) -> int:
    """Float32 roundings on the way to one output: the product, the tree over a step's tile of 32 · NB
    values, one add per step of a piece, one per piece. The pieces follow the device (split_plan:
    more multiprocessors, more pieces; 7x2048 has depth 25 on a 132-SM H200). FUSED_BOUND
    (tests/runtime/test_triton_kernels.py) is 8 times the worst measured at depth 21 (under 0.5), and
    random-sign errors grow as √depth: it keeps a margin of 4 up to MAX_DEPTH."""
    values = 32 * qm.STEP_BLOCKS[QType.F32]
    n_blocks = -(-n_in // 32)
    pieces, per_piece = qm.split_plan(QType.F32, n_out, n_blocks, DEVICE)
    return 1 + (values - 1).bit_length() + -(-per_piece * 32 // values) + pieces


def matrix(n_out: int, n_in: int, seed: int) -> torch.Tensor:
    return torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed))


def rows_of(n: int, n_in: int, seed: int) -> torch.Tensor:
    return torch.randn(n, n_in, generator=torch.Generator().manual_seed(seed))


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return kt.quant_matmul(x.to(DEVICE), w.to(DEVICE).view(torch.uint8), QType.F32, *w.shape).cpu()


@pytest.mark.parametrize("n_out,n_in", SHAPES, ids=str)
def test_f32_product_within_summation_noise(n_out, n_in):
    w = matrix(n_out, n_in, seed=n_out + n_in)
    assert f32_depth(n_out, n_in) <= MAX_DEPTH
    worst = 0.0
    for n in (1, 3, 16):
        x = rows_of(n, n_in, seed=n)
        y = product(x, w)
        assert y.shape == (n, n_out) and y.dtype == torch.float32
        worst = max(worst, noise(y, *exact_product(x, w)))
    where = "CUDA" if ON_GPU else "interpreter"
    print(f"\n[triton fused F32 {n_out}x{n_in}, {where}] worst |Δ| = {worst:.3f} eps·Σ|x·w| "
          f"(depth {f32_depth(n_out, n_in)}, bound {FUSED_BOUND})")
    assert worst <= FUSED_BOUND


def test_a_long_row_is_cut_along_its_inner_dimension():
    """The 2048-value shape takes the cut path (pieces summed by a second launch), so the bound above
    covers it; the cut depends on W's shape and the device only."""
    assert qm.split_plan(QType.F32, 7, 2048 // 32, DEVICE)[0] > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n_out,n_in", SHAPES, ids=str)
def test_16bit_rows_are_read_as_they_are(n_out, n_in, dtype):
    """x in bfloat16 / float16: a float32 result with the bits of x.float() (widened exactly inside)."""
    w = matrix(n_out, n_in, seed=3)
    x = rows_of(5, n_in, seed=4).to(dtype)
    y = product(x, w)
    assert y.dtype == torch.float32
    assert torch.equal(y, product(x.float(), w))


@pytest.mark.parametrize("n_out,n_in", SHAPES, ids=str)
def test_a_row_alone_has_the_bits_of_the_row_in_a_batch_of_16(n_out, n_in):
    w = matrix(n_out, n_in, seed=5)
    x = rows_of(16, n_in, seed=6)
    full = product(x, w)
    assert torch.equal(product(x[5:8], w), full[5:8])
    for m in (0, 7, 15):
        assert torch.equal(product(x[m:m + 1], w), full[m:m + 1])


def test_prompt_rows_take_torchs_float32_product():
    n_out, n_in = 37, 352
    w = matrix(n_out, n_in, seed=7)
    for dtype in (torch.float32, torch.bfloat16):
        x = rows_of(20, n_in, seed=8).to(dtype)
        y = product(x, w)
        assert y.dtype == torch.float32
        assert torch.equal(y, (x.float().to(DEVICE) @ w.to(DEVICE).t()).cpu())


def test_a_group_of_f32_matrices_gives_each_its_own_bits():
    n_in = 352
    ws = [matrix(n_out, n_in, seed=n_out) for n_out in (1, 7, 37)]
    x = rows_of(3, n_in, seed=9).bfloat16()
    ys = kt.grouped_matmul(x.to(DEVICE), [w.to(DEVICE).view(torch.uint8) for w in ws], QType.F32,
                           [w.shape[0] for w in ws], n_in)
    for w, y in zip(ws, ys):
        assert y.dtype == torch.float32 and torch.equal(y.cpu(), product(x, w))


def test_f32_rows_dequantized():
    """The tile source of the prompt path: float32 values as stored, float16 as torch rounds them."""
    w = matrix(37, 100, seed=19)
    packed = w.to(DEVICE).view(torch.uint8)
    assert torch.equal(kt.dequantize_rows(packed, QType.F32, 37, 100, torch.float32).cpu(), w)
    assert torch.equal(kt.dequantize_rows(packed, QType.F32, 37, 100, torch.float16).cpu(), w.half())


# ---- the CUDA backend ---------------------------------------------------------------------------------

def stored(w: torch.Tensor) -> StoredWeight:
    return StoredWeight(w.to(DEVICE).view(torch.uint8), QType.F32, tuple(w.shape), torch.float32, DEVICE)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of kernels_triton.quant_matmul the backend makes."""
    calls = Counter()
    real = kt.quant_matmul

    def counted(x, packed, qtype, *args, **kwargs):
        calls[qtype] += 1
        return real(x, packed, qtype, *args, **kwargs)

    monkeypatch.setattr(kt, "quant_matmul", counted)
    return calls


@pytest.mark.parametrize("form", ["dense", "stored"])
def test_the_backend_takes_float32_rows_by_float32_weights_to_the_kernel(form, kernel_calls):
    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    n_out, n_in = 37, 352
    w = matrix(n_out, n_in, seed=10)
    weight = w.to(DEVICE) if form == "dense" else stored(w)
    for n in (1, 3, 16):
        x = rows_of(n, n_in, seed=11 + n)
        before = kernel_calls[QType.F32]
        y = backend.linear(x.to(DEVICE), weight).cpu()
        assert kernel_calls[QType.F32] == before + 1
        assert y.dtype == torch.float32 and torch.equal(y, product(x, w))
        ref = TorchBackend().linear(x, w)
        print(f"\n[{form} F32, {n} rows] kernel vs torch reference: max |Δ| "
              f"{float((y - ref).abs().max()):.2e}")
        assert noise(y, *exact_product(x, w)) <= FUSED_BOUND


@pytest.mark.parametrize("form", ["dense", "stored"])
def test_other_rows_keep_the_torch_reference(form, kernel_calls):
    """bfloat16 rows: the reference multiplies in bfloat16 (w rounded), so the backend gives its bits;
    17 dense rows outside batch-invariant mode: torch's product; in it, pieces of 16 through the
    kernel, each row the bits of a decode step."""
    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    n_out, n_in = 7, 100
    w = matrix(n_out, n_in, seed=12)
    weight = w.to(DEVICE) if form == "dense" else stored(w)
    def reference(x, w):  # torch's product on the same device (a GPU's cuBLAS is not the CPU's)
        return TorchBackend().linear(x.to(DEVICE), w.to(DEVICE)).cpu()

    x = rows_of(3, n_in, seed=13).bfloat16()
    y = backend.linear(x.to(DEVICE), weight).cpu()
    assert kernel_calls[QType.F32] == 0
    assert y.dtype == torch.bfloat16 and torch.equal(y, reference(x, w))
    x = rows_of(17, n_in, seed=14)
    if form == "dense":
        assert torch.equal(backend.linear(x.to(DEVICE), weight).cpu(), reference(x, w))
        columns = w.t().contiguous().t()  # values not contiguous along a row: no byte view
        assert torch.equal(backend.linear(x[:2].to(DEVICE), columns.to(DEVICE)).cpu(), reference(x[:2], columns))
        assert kernel_calls[QType.F32] == 0
    with batch_invariant(True):
        y = backend.linear(x.to(DEVICE), weight).cpu()
    assert kernel_calls[QType.F32] == 2
    assert torch.equal(y[16:], product(x[16:], w)) and torch.equal(y[:1], product(x[:1], w))


@pytest.mark.parametrize("form", ["dense", "stored"])
def test_wide_products_read_16bit_rows_as_they_are(form, kernel_calls):
    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    n_out, n_in = 7, 352
    w = matrix(n_out, n_in, seed=15)
    weight = w.to(DEVICE) if form == "dense" else stored(w)
    for n in (1, 4):
        x = rows_of(n, n_in, seed=16 + n).bfloat16()
        before = kernel_calls[QType.F32]
        y = backend.linear_wide(x.to(DEVICE), weight).cpu()
        assert kernel_calls[QType.F32] == before + 1
        assert y.dtype == torch.float32 and torch.equal(y, product(x.float(), w))
        assert torch.equal(TorchBackend().linear_wide(x, w), TorchBackend().linear(x.float(), w))


def test_wide_products_by_other_types_widen_the_rows_first(kernel_calls):
    """A router stored as BF16 (kept float32 when used): bfloat16 rows widened, then the BF16 kernel
    with a float32 result, as `linear` of the widened rows gives."""
    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    n_out, n_in = 7, 352
    w = matrix(n_out, n_in, seed=17).bfloat16()
    weight = StoredWeight(w.to(DEVICE).view(torch.uint8), QType.BF16, (n_out, n_in), torch.float32, DEVICE)
    x = rows_of(3, n_in, seed=18).bfloat16().to(DEVICE)
    y = backend.linear_wide(x, weight)
    assert y.dtype == torch.float32 and torch.equal(y, backend.linear(x.float(), weight))
    assert kernel_calls[QType.BF16] == 2 and not kernel_calls[QType.F32]


# ---- launches -------------------------------------------------------------------------------------------

def _is_f32(w) -> bool:
    return (w.qtype == QType.F32) if isinstance(w, StoredWeight) else (isinstance(w, torch.Tensor)
                                                                       and w.dtype == torch.float32)


class CountedF32(CudaBackend, CountedCalls):
    """The CUDA backend (or with `reference`, its products by float32 weights through the torch
    reference, as before the F32 kernel), counting those products (`linear`, `linear_wide`) and the
    launches inside them (the widening of `linear_wide` included)."""

    def __init__(self, reference: bool):
        super().__init__(kt, device_types=("meta",))
        self.reference = reference
        self.init_counts()

    def linear(self, x, w):
        return self._counted(x, w, CudaBackend.linear, TorchBackend.linear)

    def linear_wide(self, x, w):
        return self._counted(x, w, CudaBackend.linear_wide, TorchBackend.linear_wide)

    def linear_wide_group(self, x, ws):
        """The kernel form: one counted call (one grouped launch); the reference: linear_wide each."""
        if self.reference:  # each product counted as the torch reference's
            return TorchBackend.linear_wide_group(self, x, ws)
        if cuda_op_count.active_counters() and all(_is_f32(w) for w in ws):
            return self.counted(lambda: CudaBackend.linear_wide_group(self, x, ws))
        return CudaBackend.linear_wide_group(self, x, ws)

    def _counted(self, x, w, kernel_form, torch_form):
        counters = cuda_op_count.active_counters()
        if not (counters and _is_f32(w)):
            return kernel_form(self, x, w)
        method = torch_form if self.reference else kernel_form
        return self.counted(lambda: method(self, x, w))  # linear_wide's own `linear`: counted with it


@pytest.fixture(scope="module")
def moe_q8(tmp_path_factory):
    return tiny_gguf(tmp_path_factory, moe=True, outtype="q8_0")[1]


def test_an_f32_product_is_one_launch_in_a_step_and_a_verification(moe_q8):
    k = 3
    new_backend, old_backend = CountedF32(reference=False), CountedF32(reference=True)
    new = cuda_op_count.count_steps(moe_q8, "bf16", k, backend=new_backend)
    old = cuda_op_count.count_steps(moe_q8, "bf16", k, backend=old_backend)
    n_blocks = len(new.recurrent)  # every block of the tiny model is a MoE block: a router, a shared gate
    for name, fresh, before in (("step", new.step, old.step), ("verification", new.verify, old.verify)):
        calls, inside = new_backend.calls[id(fresh)], new_backend.inside[id(fresh)]
        old_calls, old_inside = old_backend.calls[id(before)], old_backend.inside[id(before)]
        print(f"\n[meta, bf16, {name}] {before.total} -> {fresh.total} launches: {calls} grouped F32 products, "
              f"{old_inside} launches of the torch reference -> {inside}")
        assert old_calls == 2 * n_blocks and calls == n_blocks  # the router and the shared gate: one group
        assert inside == calls  # one launch each (these matrices are not cut)
        assert fresh.total == before.total - old_inside + inside
    rows = k + 1  # the reference: the widening, a cast and a product per row, a concatenation
    assert old_backend.inside[id(old.step)] == (2 + 2) * 2 * n_blocks
    assert old_backend.inside[id(old.verify)] == (2 + 2 * rows) * 2 * n_blocks
    assert new_backend.inside[id(new.verify)] == new_backend.inside[id(new.step)]
