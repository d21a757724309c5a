"""A block's residual add and RMSNorm done by the product that ends its mixer or FFN: the one-pass
product kernel's norm tail (runtime/kernels_triton/matmul.py `quant_matmul_add_rms_norm`,
_tail_jit._norm_tail, the formula _pointwise_jit.norm_row shared with norm_kernel), the backend
seam (`linear_add_rms_norm`) and the graphs' deferred products (ops.Deferred):

* bit for bit the product then the norm kernel's add_rms_norm (kernels_triton.quant_matmul, then
  rms_norm(h, w, eps, residual=y)): Q8_0, Q4_K and BF16 weights, products cut along their inner
  dimension and not, bfloat16 and float32 rows, 1 to 16 rows, widths not a power of two; the GLU
  input (a SwiGLU's down product) too; one launch, the counters back at zero, h untouched;
* a row alone gives the bits it has in a batch of 16;
* without counters (a CUDA graph capture with too small a buffer) the product and the norm launch,
  the same bits;
* the seam: CudaBackend.linear_add_rms_norm is its own linear then add_rms_norm bit for bit (in
  batch-invariant mode 17+ rows in 16-row pieces with each row's one-row bits), TorchBackend's and
  the CPU backend's are exactly linear then add_rms_norm; ops.add_rms_norm of a Deferred product
  is that, and under an activation observer the observer still sees the product's rows;
* launches (benchmarks/cuda_op_count.py, meta): in the tiny Qwen3.5 step and the llama family's,
  each add_rms_norm after a product is in the product's launch: two launches fewer per block.

Without a GPU the kernels run in Triton's interpreter (one program after another); with one,
compiled on CUDA, in any order.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE, WHERE, record_launches  # first: the interpreter without a GPU
from tests.runtime.test_cuda_split_products import KEY, counters_at_rest, pieces  # skips where Triton is missing
from specconv.archs.errors import SpecconvError
from specconv.runtime import backend as backend_module, kernels_triton as kt
from specconv.runtime.backend import batch_invariant, observing
from specconv.runtime.backend_cuda import CudaBackend
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.dequant import dequantize_rows as torch_dequantize
from specconv.runtime.kernels_triton import _common, norm as kt_norm
from specconv.runtime.stored import StoredWeight
from tests.fixtures.counted_calls import family_q8_0, fused_against_separate, fused_or_separate
from tests.fixtures.quant_rows import sane_rows

torch.set_num_threads(1)
REF = TorchBackend()
EPS = 1e-6
# (type, n_out = the stream's width, n_in): widths the tail takes (multiples of 16), not powers of
# two; under the interpreter's 2 stand-in multiprocessors 48 rows of 352 Q8_0 values and 48 of 1024
# Q4_K values are cut in 2, 48 of 520 BF16 in 3; 144 rows (9 tiles) are not cut; 4176 is wider than
# a norm block (norm.ROW_CHUNK): two whole chunks and a part of one
WIDE_ROW = 2 * kt_norm.ROW_CHUNK + 80
SHAPES = [(QType.Q8_0, 48, 352), (QType.Q8_0, 144, 352), (QType.Q4_K, 48, 1024), (QType.BF16, 48, 520),
          (QType.Q8_0, WIDE_ROW, 64)]


def rows_of(n: int, width: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(n, width, generator=torch.Generator().manual_seed(seed))).to(dtype).to(DEVICE)


def norm_weight(width: int, seed: int) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(width, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


def two_launches(x, packed, qtype, n_out, n_in, h, w, up=None, act=None):
    """The product, then the norm kernel's residual add and norm (what the tail replaces)."""
    y = kt.quant_matmul(x, packed, qtype, n_out, n_in, up=up, act=act)
    return kt.rms_norm(h, w, EPS, residual=y)


def without_counters(monkeypatch, run):
    """`run()` as while a CUDA graph is captured with no counter buffer at hand."""
    with monkeypatch.context() as m:
        m.setattr(_common, "_counters", {})
        m.setattr(_common, "capturing", lambda device: True)
        out = run()
        assert _common._counters.get(KEY, []) == []  # nothing was made
    return out


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("qtype, n_out, n_in", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_the_tail_is_the_product_then_add_rms_norm(qtype, n_out, n_in, dtype, monkeypatch):
    """1..16 rows (1, 3, 16 in float32): (s, o) the bits of the product then the norm launch, in ONE
    launch, h unchanged, counters zero after; a row alone the bits of its row in the batch of 16;
    the path without counters (product, then norm_kernel) the same bits; float32 within the float32
    noise of the torch reference on the dequantized weight."""
    launched = record_launches(monkeypatch)
    packed = sane_rows(qtype, n_out, n_in, seed=n_out + n_in).to(DEVICE)
    cut = pieces(qtype, n_out, n_in) > 1
    x16, h16 = rows_of(16, n_in, dtype, seed=n_in), rows_of(16, n_out, dtype, seed=n_out, scale=4.0)
    w = norm_weight(n_out, seed=3)
    kept = h16.clone()
    for rows in (range(1, 17) if dtype == torch.bfloat16 else (1, 3, 16)):
        x, h = x16[:rows], h16[:rows]
        del launched[:]
        got = kt.quant_matmul_add_rms_norm(x, packed, qtype, n_out, n_in, h, w, EPS)
        assert launched == ["fused_rows_kernel"], launched
        assert counters_at_rest()
        assert same(got, two_launches(x, packed, qtype, n_out, n_in, h, w)), rows
        del launched[:]
        fallback = without_counters(monkeypatch, lambda: kt.quant_matmul_add_rms_norm(x, packed, qtype, n_out, n_in,
                                                                                      h, w, EPS))
        assert launched == ["fused_rows_kernel", *(["sum_parts_kernel"] if cut else []), "norm_kernel"], launched
        assert same(fallback, got), rows
    assert torch.equal(h16, kept)
    full = got
    for m in (0, 7, 15):
        alone = kt.quant_matmul_add_rms_norm(x16[m:m + 1], packed, qtype, n_out, n_in, h16[m:m + 1], w, EPS)
        assert same(alone, tuple(t[m:m + 1] for t in full)), m
    ds, do = reference_gaps(full, REF.add_rms_norm(h16.cpu().float(), x16.cpu().float() @ torch_dequantize(
        packed.cpu(), qtype).float().t(), w.cpu(), EPS), dtype)
    print(f"\n[{WHERE}] {qtype.name} [{n_out}, {n_in}] {dtype}, {pieces(qtype, n_out, n_in)} piece(s): tail = product "
          f"+ norm launch bit for bit, 1..16 rows, one launch; max |Δ| from the torch reference s {ds:.2e}, "
          f"o {do:.2e}")


def reference_gaps(got: tuple, want: tuple, dtype: torch.dtype) -> list[float]:
    """max |Δ| of each output from its float32 torch reference, asserted within float32 noise (1e-4 of
    the reference's largest value) or, for bf16, a few bf16 ulps of values up to ~10 (0.1 of it)."""
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    gaps = [float((a.cpu().float() - b).abs().max()) for a, b in zip(got, want, strict=True)]
    for gap, b in zip(gaps, want):
        assert gap <= tolerance * float(b.abs().max()), (gap, float(b.abs().max()))
    return gaps


def test_the_glu_down_product_with_its_tail(monkeypatch):
    """A SwiGLU's down product (the GLU read by the product kernel) with the tail: the bits of the GLU
    product then the norm launch, 1..16 rows, one launch; a row alone its row's bits."""
    launched = record_launches(monkeypatch)
    qtype, n_out, n_in = QType.Q8_0, 48, 352
    packed = sane_rows(qtype, n_out, n_in, seed=5).to(DEVICE)
    gate, up = rows_of(16, n_in, torch.bfloat16, 6, scale=3.0), rows_of(16, n_in, torch.bfloat16, 7)
    h, w = rows_of(16, n_out, torch.bfloat16, 8, scale=4.0), norm_weight(n_out, 9)
    for rows in range(1, 17):
        del launched[:]
        got = kt.quant_matmul_add_rms_norm(gate[:rows], packed, qtype, n_out, n_in, h[:rows], w, EPS, up=up[:rows],
                                           act="silu")
        assert launched == ["fused_rows_kernel"], launched
        assert same(got, two_launches(gate[:rows], packed, qtype, n_out, n_in, h[:rows], w, up=up[:rows], act="silu"))
    for m in (0, 15):
        alone = kt.quant_matmul_add_rms_norm(gate[m:m + 1], packed, qtype, n_out, n_in, h[m:m + 1], w, EPS,
                                             up=up[m:m + 1], act="silu")
        assert same(alone, tuple(t[m:m + 1] for t in got)), m
    print(f"\n[{WHERE}] SwiGLU down product + tail: the two launches' bits, 1..16 rows")


def test_rows_the_tail_does_not_take(monkeypatch):
    """A width not a multiple of 16 (37, and 2085: wider than a norm block too) and 17 rows: the
    product, then the norm launch, the bits of the two launches."""
    launched = record_launches(monkeypatch)
    for n_out, rows in ((37, 3), (kt_norm.ROW_CHUNK + 37, 1), (48, 17)):
        packed = sane_rows(QType.Q8_0, n_out, 64, seed=n_out).to(DEVICE)
        x, h, w = rows_of(rows, 64, torch.bfloat16, 1), rows_of(rows, n_out, torch.bfloat16, 2), norm_weight(n_out, 3)
        del launched[:]
        got = kt.quant_matmul_add_rms_norm(x, packed, QType.Q8_0, n_out, 64, h, w, EPS)
        assert launched[-1] == "norm_kernel" and ("fused_rows_kernel" in launched) == (rows <= 16), launched
        assert same(got, two_launches(x, packed, QType.Q8_0, n_out, 64, h, w)), n_out


def stored(qtype: QType, n_out: int, n_in: int, seed: int) -> StoredWeight:
    return StoredWeight(sane_rows(qtype, n_out, n_in, seed=seed).to(DEVICE), qtype, (n_out, n_in), torch.bfloat16,
                        DEVICE)


def test_the_backend_seam(monkeypatch):
    """CudaBackend.linear_add_rms_norm: its own linear (linear_glu) then add_rms_norm bit for bit, one
    product launch; 20 rows in batch-invariant mode in pieces of 16, each row its one-row bits; 20
    rows otherwise the two launches. TorchBackend's (and the CPU backend's): exactly linear then
    add_rms_norm."""
    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    n_in, n_out = 352, 48
    w, nw = stored(QType.Q8_0, n_out, n_in, 1), norm_weight(n_out, 2)
    x, h = rows_of(20, n_in, torch.bfloat16, 3), rows_of(20, n_out, torch.bfloat16, 4, scale=4.0)
    gate, up = rows_of(20, n_in, torch.bfloat16, 5, scale=3.0), rows_of(20, n_in, torch.bfloat16, 6)
    for rows in (1, 4):
        del launched[:]
        got = cuda.linear_add_rms_norm(x[:rows], w, h[:rows], nw, EPS)
        assert launched == ["fused_rows_kernel"], launched
        assert same(got, cuda.add_rms_norm(h[:rows], cuda.linear(x[:rows], w), nw, EPS))
        got = cuda.linear_add_rms_norm(gate[:rows], w, h[:rows], nw, EPS, up[:rows], "silu")
        assert same(got, cuda.add_rms_norm(h[:rows], cuda.linear_glu(gate[:rows], up[:rows], w, "silu"), nw, EPS))
    with batch_invariant(True):
        del launched[:]
        wide = cuda.linear_add_rms_norm(x, w, h, nw, EPS)
        assert launched.count("fused_rows_kernel") == 2 and "norm_kernel" not in launched, launched
    for m in (0, 17, 19):
        assert same(tuple(t[m:m + 1] for t in wide), cuda.linear_add_rms_norm(x[m:m + 1], w, h[m:m + 1], nw, EPS)), m
    assert same(cuda.linear_add_rms_norm(x, w, h, nw, EPS), cuda.add_rms_norm(h, cuda.linear(x, w), nw, EPS))
    cpu = backend_module.for_device("cpu")  # the CPU's backend (native where built)
    xc, hc, wc, nc = x.cpu()[:3], h.cpu()[:3], w.dense(torch.float32).cpu(), nw.cpu()
    for backend in (REF, cpu):
        assert same(backend.linear_add_rms_norm(xc, wc, hc, nc, EPS),
                    backend.add_rms_norm(hc, backend.linear(xc, wc), nc, EPS))
        g, u = gate.cpu()[:3], up.cpu()[:3]
        assert same(backend.linear_add_rms_norm(g, wc, hc, nc, EPS, u, "silu"),
                    backend.add_rms_norm(hc, backend.linear_glu(g, u, wc, "silu"), nc, EPS))


def test_a_deferred_product_through_ops(monkeypatch):
    """ops.add_rms_norm of a Deferred product: the backend's linear_add_rms_norm (on the CUDA backend
    one product launch); ops.made of it: the product itself; an activation observer sees the
    product's input rows (the GLU's values for a SwiGLU) and gets the same bits."""
    from specconv.runtime.graphs import ops

    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    monkeypatch.setattr(backend_module, "_backend", lambda kind: cuda)
    n_in, ff, n_out = 256, 256, 48
    gate_w, up_w, down_w = stored(QType.Q8_0, ff, n_in, 1), stored(QType.Q8_0, ff, n_in, 2), stored(QType.Q4_K, n_out,
                                                                                                   ff, 3)
    x, h, nw = rows_of(3, n_in, torch.bfloat16, 4), rows_of(3, n_out, torch.bfloat16, 5, scale=4.0), norm_weight(n_out, 6)
    deferred = ops.deferred_swiglu(x, gate_w, up_w, down_w)
    del launched[:]
    got = ops.add_rms_norm(h, deferred, nw, EPS)
    assert launched == ["fused_rows_kernel"], launched
    assert same(got, cuda.add_rms_norm(h, ops.made(deferred), nw, EPS))
    assert torch.equal(ops.made(deferred), ops.swiglu(x, gate_w, up_w, down_w))
    seen = []

    class Observer:
        def product(self, rows, weight):
            seen.append((rows, weight))

    with observing(Observer()):
        observed = ops.add_rms_norm(h, deferred, nw, EPS)
    assert len(seen) == 1 and seen[0][1] is down_w
    assert torch.equal(seen[0][0], cuda.glu(deferred.x, deferred.up, "silu"))
    assert same(observed, got)


def test_bad_input_one_line_errors():
    packed = sane_rows(QType.Q8_0, 37, 352, seed=1).to(DEVICE)
    x, w = rows_of(2, 352, torch.bfloat16, 2), norm_weight(37, 3)
    for h, wt, needle in ((rows_of(2, 37, torch.float32, 4), w, "h must be"),
                          (rows_of(2, 36, torch.bfloat16, 4), w, "h has shape"),
                          (rows_of(2, 37, torch.bfloat16, 4), w[:5], "weight has shape")):
        with pytest.raises(SpecconvError, match=needle) as e:
            kt.quant_matmul_add_rms_norm(x, packed, QType.Q8_0, 37, 352, h, wt, EPS)
        assert "\n" not in str(e.value)


# linear_add_rms_norm counted, as the CUDA backend runs it or as the separate operations it replaces
CountedTail = fused_or_separate("linear_add_rms_norm")


@pytest.mark.parametrize("name", ["qwen35", "qwen35-wide", "llama-release"])
def test_each_block_launches_two_fewer(name, tmp_path_factory):
    """A bf16 decode step and 4-row verification on meta with the CUDA backend's choices: each
    add_rms_norm after a product (each block's two, the last block's FFN with the output norm) is
    in the product's launch, one launch where the separate forms take two, nothing else in the step
    changed: two launches fewer per block; in a model wider than a norm block too (qwen35-wide).
    The Qwen3.5 files keep one norm_kernel launch, the first block's input norm."""
    from benchmarks import cuda_op_count
    from tests.fixtures.runtime_common import tiny_gguf

    root = tmp_path_factory.mktemp(name)
    if name == "qwen35":
        path = tiny_gguf(tmp_path_factory, outtype="q8_0")[1]
    else:
        path = cuda_op_count.wide_fixture(root) if name == "qwen35-wide" else family_q8_0(root, name)
    blocks, results = fused_against_separate(path, CountedTail)
    for what, calls, inside, new, old in results:
        print(f"\n[meta, bf16] {name} {what}: {old.total} launches with the norms apart -> {new.total} with the tails "
              f"({blocks} blocks, {calls} products with a norm tail)")
        assert calls == 2 * blocks and inside == 2 * calls
        assert old.total - new.total == 2 * blocks
        if name.startswith("qwen35"):
            assert new.by_op["triton.norm_kernel"] == 1


def test_the_tails_sum_compiles_to_the_norm_kernels_reduction():
    """sm_90, Triton's compiler on the CPU (tools/triton_aot.py): for rows of one norm block
    (ROW_CHUNK values), of a width not a power of two, and wider than a block (WIDE_ROW: 3 blocks),
    bfloat16 and float32, the product kernel with its tail (1 and 3 rows) holds, once per block of
    each row, the very reduction norm_kernel's residual form compiles to (the same float operations
    feeding it and the same layout: their bits on a GPU are the same). Rows of a width not a
    multiple of 16 (1000: norm_kernel's loads of 4 values, the tail's of 8) sum in another layout:
    those take no tail."""
    from specconv.runtime.kernels_triton import matmul as qm, norm
    from tests.fixtures.compiled_launches import compiled_launches

    assert norm.WARPS == qm.FUSED_WARPS

    def make(recorder):
        for width, dtype, rows in itertools.product((norm.ROW_CHUNK, 896, WIDE_ROW), (torch.bfloat16, torch.float32),
                                                    (1, 3)):
            recorder.key = ("tail", f"{width} {dtype}", str(rows))
            x = torch.empty(rows, 256, dtype=dtype, device="meta")
            h = torch.empty(rows, width, dtype=dtype, device="meta")
            w = torch.empty(width, dtype=torch.float32, device="meta")
            packed = torch.empty(width, 8 * 34, dtype=torch.uint8, device="meta")
            kt.quant_matmul_add_rms_norm(x, packed, QType.Q8_0, width, 256, h, w, EPS)
            recorder.key = ("norm", f"{width} {dtype}", str(rows))
            kt.rms_norm(h, w, EPS, residual=torch.empty_like(h))

    compiled = compiled_launches(make)
    for (kind, width, rows), tail in compiled.items():
        if kind != "tail":
            continue
        alone = compiled[("norm", width, rows)]
        (form, count), = alone.reduce_forms.items()
        blocks = norm.row_block(int(width.split()[0]))[1]  # a row's blocks: one reduction each
        assert count == blocks and tail.reduce_forms.get(form) == blocks * int(rows), (width, rows, tail.reduce_forms)
        assert set(alone.reduce_layouts) <= set(tail.reduce_layouts), (width, alone.reduce_layouts)
        print(f"\nsm_90, width and dtype {width}, {rows} row(s): the tail's sum is norm_kernel's reduction {form} "
              f"({alone.reduce_layouts[0].split(',')[0]}...), once per block of a row")
