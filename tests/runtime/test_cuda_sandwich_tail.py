"""Gemma's sandwich norms made by the product they follow: the one-pass product kernel's sandwich
tail (runtime/kernels_triton/matmul.py `quant_matmul_add_normed`, _tail_jit._sandwich_tail), the
backend seam (`linear_add_normed`) and the graph's deferred products (ops.add_normed of an
ops.Deferred, ops.add_normed_rms_norm):

* bit for bit the product, then the norm kernel's add_to (out_scale) form, then its plain norm of
  the sum (what the tail replaces): Q8_0, Q4_K and BF16 weights, products cut along their inner
  dimension and not, bfloat16 and float32 rows, 1 to 16 rows, a row wider than a norm block, with
  and without the layer output scale and the norm after; the GeGLU input (Gemma's down product)
  too; one launch, counters back at zero, h untouched;
* a row alone gives the bits it has in a batch of 16; without counters the separate launches,
  the same bits; rows the tail does not take (a width not a multiple of 16, 17 rows) likewise;
* the seam: CudaBackend.linear_add_normed is its own linear, add_normed and rms_norm bit for bit
  (in batch-invariant mode 17+ rows in 16-row pieces); TorchBackend's and the CPU backend's are
  exactly those operations; ops.add_normed of a Deferred product is that, and under an activation
  observer the observer still sees the product's rows;
* compiled for sm_90: the tail's sums of squares are norm_kernel's reductions (its plain form's
  operations for y, its layout for the sum);
* launches (benchmarks/cuda_op_count.py, meta): in Gemma 4's step each sandwich is in the product's
  launch (tests/fixtures/launch_ceilings.py holds the counts).

Without a GPU the kernels run in Triton's interpreter (one program after another).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE, WHERE, record_launches  # first: the interpreter without a GPU
from tests.runtime.test_cuda_split_products import counters_at_rest, pieces  # skips where Triton is missing
from tests.runtime.test_cuda_norm_tail import (WIDE_ROW, norm_weight, reference_gaps, rows_of, same, stored,
                                               without_counters)
from specconv.archs.errors import SpecconvError
from specconv.runtime import backend as backend_module, kernels_triton as kt
from specconv.runtime.backend import batch_invariant, observing
from specconv.runtime.backend_cuda import CudaBackend
from specconv.runtime.backend_torch import TorchBackend
from specconv.runtime.dequant import dequantize_rows as torch_dequantize
from tests.fixtures.counted_calls import fused_against_separate, fused_or_separate
from tests.fixtures.quant_rows import sane_rows

torch.set_num_threads(1)

REF = TorchBackend()
EPS = 1e-6
SHAPES = [(QType.Q8_0, 48, 352), (QType.Q8_0, 144, 352), (QType.Q4_K, 48, 1024), (QType.BF16, 48, 520),
          (QType.Q8_0, WIDE_ROW, 64)]
# (layer output scale, norm after): each form the graph makes
FORMS = [(False, True), (True, False), (True, True)]


def separate(x, packed, qtype, n_out, n_in, h, w, scale, then, up=None, act=None):
    """The product, then norm_kernel's add_to (out_scale) form, then its plain norm of the sum."""
    y = kt.quant_matmul(x, packed, qtype, n_out, n_in, up=up, act=act)
    s = kt.rms_norm(y, w, EPS, add_to=h, out_scale=scale)
    return s, None if then is None else kt.rms_norm(s, then, EPS)


def same_or_none(a: tuple, b: tuple) -> bool:
    return all((p is None and q is None) or (p is not None and q is not None and torch.equal(p, q))
               for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("qtype, n_out, n_in", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_the_tail_is_the_product_then_the_sandwich_norms(qtype, n_out, n_in, dtype, monkeypatch):
    """1..16 rows (1, 3, 16 in float32), each form in turn: (s, o) the bits of the separate launches,
    in ONE launch, h unchanged, counters zero after; without counters the separate launches, the
    same bits; a row alone the bits of its row in the batch of 16; float32 within the float32 noise
    of the torch reference on the dequantized weight."""
    launched = record_launches(monkeypatch)
    packed = sane_rows(qtype, n_out, n_in, seed=n_out + 7 * n_in).to(DEVICE)
    cut = pieces(qtype, n_out, n_in) > 1
    x16, h16 = rows_of(16, n_in, dtype, seed=n_in + 1), rows_of(16, n_out, dtype, seed=n_out + 1, scale=4.0)
    w, then = norm_weight(n_out, seed=11), norm_weight(n_out, seed=12)
    scale = torch.tensor([0.625], device=DEVICE)
    kept = h16.clone()
    for rows, (scaled, normed_after) in zip(range(1, 17) if dtype == torch.bfloat16 else (1, 3, 16),
                                            itertools.cycle(FORMS)):
        x, h = x16[:rows], h16[:rows]
        args = (x, packed, qtype, n_out, n_in, h, w)
        s, t = (scale if scaled else None), (then if normed_after else None)
        del launched[:]
        got = kt.quant_matmul_add_normed(*args, EPS, scale=s, then=t)
        assert launched == ["fused_rows_kernel"], launched
        assert counters_at_rest()
        assert same_or_none(got, separate(*args, s, t)), (rows, scaled, normed_after)
        del launched[:]
        fallback = without_counters(monkeypatch, lambda: kt.quant_matmul_add_normed(*args, EPS, scale=s, then=t))
        assert launched == ["fused_rows_kernel", *(["sum_parts_kernel"] if cut else []), "norm_kernel",
                            *(["norm_kernel"] if normed_after else [])], launched
        assert same_or_none(fallback, got), rows
    assert torch.equal(h16, kept)
    full = kt.quant_matmul_add_normed(x16, packed, qtype, n_out, n_in, h16, w, EPS, scale=scale, then=then)
    for m in (0, 7, 15):
        alone = kt.quant_matmul_add_normed(x16[m:m + 1], packed, qtype, n_out, n_in, h16[m:m + 1], w, EPS,
                                           scale=scale, then=then)
        assert same(alone, tuple(t[m:m + 1] for t in full)), m
    y_ref = x16.cpu().float() @ torch_dequantize(packed.cpu(), qtype).float().t()
    s_ref = REF.add_normed(h16.cpu().float(), y_ref, w.cpu(), EPS, scale.cpu())
    ds, do = reference_gaps(full, (s_ref, REF.rms_norm(s_ref, then.cpu(), EPS)), dtype)
    counts = "1..16" if dtype == torch.bfloat16 else "1, 3, 16"
    print(f"\n[{WHERE}] {qtype.name} [{n_out}, {n_in}] {dtype}, {pieces(qtype, n_out, n_in)} piece(s): sandwich tail = "
          f"the separate launches bit for bit, {counts} rows, one launch; max |Δ| from the torch reference "
          f"s {ds:.2e}, o {do:.2e}")


def test_the_geglu_down_product_with_its_tail(monkeypatch):
    """Gemma's GeGLU down product (the GLU read by the product kernel) with the scaled sandwich tail:
    the bits of the GLU product then the norm launches, 1..16 rows, one launch; a row alone its
    row's bits."""
    launched = record_launches(monkeypatch)
    qtype, n_out, n_in = QType.Q8_0, 48, 352
    packed = sane_rows(qtype, n_out, n_in, seed=21).to(DEVICE)
    gate, up = rows_of(16, n_in, torch.bfloat16, 22, scale=3.0), rows_of(16, n_in, torch.bfloat16, 23)
    h, w, then = rows_of(16, n_out, torch.bfloat16, 24, scale=4.0), norm_weight(n_out, 25), norm_weight(n_out, 26)
    scale = torch.tensor([1.5], device=DEVICE)
    for rows in range(1, 17):
        del launched[:]
        got = kt.quant_matmul_add_normed(gate[:rows], packed, qtype, n_out, n_in, h[:rows], w, EPS, scale=scale,
                                         then=then, up=up[:rows], act="gelu_tanh")
        assert launched == ["fused_rows_kernel"], launched
        assert same(got, separate(gate[:rows], packed, qtype, n_out, n_in, h[:rows], w, scale, then, up=up[:rows],
                                  act="gelu_tanh")), rows
    for m in (0, 15):
        alone = kt.quant_matmul_add_normed(gate[m:m + 1], packed, qtype, n_out, n_in, h[m:m + 1], w, EPS,
                                           scale=scale, then=then, up=up[m:m + 1], act="gelu_tanh")
        assert same(alone, tuple(t[m:m + 1] for t in got)), m
    print(f"\n[{WHERE}] GeGLU down product + sandwich tail: the separate launches' bits, 1..16 rows")


def test_rows_the_tail_does_not_take(monkeypatch):
    """A width not a multiple of 16 (37, and 2085: wider than a norm block too) and 17 rows: the
    product, then the norm launches, their bits."""
    launched = record_launches(monkeypatch)
    scale = torch.tensor([0.5], device=DEVICE)
    for n_out, rows in ((37, 3), (kt.norm.ROW_CHUNK + 37, 1), (48, 17)):
        packed = sane_rows(QType.Q8_0, n_out, 64, seed=n_out).to(DEVICE)
        x, h = rows_of(rows, 64, torch.bfloat16, 31), rows_of(rows, n_out, torch.bfloat16, 32)
        w, then = norm_weight(n_out, 33), norm_weight(n_out, 34)
        del launched[:]
        got = kt.quant_matmul_add_normed(x, packed, QType.Q8_0, n_out, 64, h, w, EPS, scale=scale, then=then)
        assert launched[-2:] == ["norm_kernel"] * 2 and ("fused_rows_kernel" in launched) == (rows <= 16), launched
        assert same(got, separate(x, packed, QType.Q8_0, n_out, 64, h, w, scale, then)), n_out


def test_the_backend_seam(monkeypatch):
    """CudaBackend.linear_add_normed: its own linear (linear_glu), add_normed and rms_norm bit for bit,
    one product launch; 20 rows in batch-invariant mode in pieces of 16, each row its one-row bits.
    TorchBackend's (and the CPU backend's): exactly those operations."""
    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    n_in, n_out = 352, 48
    w, nw, then = stored(QType.Q8_0, n_out, n_in, 41), norm_weight(n_out, 42), norm_weight(n_out, 43)
    scale = torch.tensor([0.75], device=DEVICE)
    x, h = rows_of(20, n_in, torch.bfloat16, 44), rows_of(20, n_out, torch.bfloat16, 45, scale=4.0)
    gate, up = rows_of(20, n_in, torch.bfloat16, 46, scale=3.0), rows_of(20, n_in, torch.bfloat16, 47)

    def apart(backend, x, h, up=None):
        y = backend.linear(x, w) if up is None else backend.linear_glu(x, up, w, "gelu_tanh")
        s = backend.add_normed(h, y, nw, EPS, scale)
        return s, backend.rms_norm(s, then, EPS)

    for rows in (1, 4):
        del launched[:]
        got = cuda.linear_add_normed(x[:rows], w, h[:rows], nw, EPS, scale, then)
        assert launched == ["fused_rows_kernel"], launched
        assert same(got, apart(cuda, x[:rows], h[:rows]))
        got = cuda.linear_add_normed(gate[:rows], w, h[:rows], nw, EPS, scale, then, up[:rows], "gelu_tanh")
        assert same(got, apart(cuda, gate[:rows], h[:rows], up[:rows]))
        s_only = cuda.linear_add_normed(x[:rows], w, h[:rows], nw, EPS)
        assert s_only[1] is None and torch.equal(s_only[0], cuda.add_normed(h[:rows], cuda.linear(x[:rows], w), nw,
                                                                             EPS))
    with batch_invariant(True):
        del launched[:]
        wide = cuda.linear_add_normed(x, w, h, nw, EPS, scale, then)
        assert launched.count("fused_rows_kernel") == 2 and "norm_kernel" not in launched, launched
    for m in (0, 17, 19):
        assert same(tuple(t[m:m + 1] for t in wide), cuda.linear_add_normed(x[m:m + 1], w, h[m:m + 1], nw, EPS,
                                                                            scale, then)), m
    cpu = backend_module.for_device("cpu")
    wc = w.dense(torch.float32).cpu()
    xc, hc, nc, tc, sc = x.cpu()[:3], h.cpu()[:3], nw.cpu(), then.cpu(), scale.cpu()
    for backend in (REF, cpu):
        s = backend.add_normed(hc, backend.linear(xc, wc), nc, EPS, sc)
        assert same(backend.linear_add_normed(xc, wc, hc, nc, EPS, sc, tc), (s, backend.rms_norm(s, tc, EPS)))
        g, u = gate.cpu()[:3], up.cpu()[:3]
        s = backend.add_normed(hc, backend.linear_glu(g, u, wc, "gelu_tanh"), nc, EPS)
        assert same_or_none(backend.linear_add_normed(g, wc, hc, nc, EPS, None, None, u, "gelu_tanh"), (s, None))


def test_a_deferred_product_through_ops(monkeypatch):
    """ops.add_normed and ops.add_normed_rms_norm of a Deferred product: the backend's
    linear_add_normed (one product launch on the CUDA backend), the bits of the product made first;
    of a tensor, the norm launches; an activation observer sees the product's input rows (the
    GeGLU's values) and gets the same bits."""
    from specconv.runtime.graphs import ops

    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    monkeypatch.setattr(backend_module, "_backend", lambda kind: cuda)
    n_in, ff, n_out = 256, 256, 48
    gate_w, up_w, down_w = (stored(QType.Q8_0, ff, n_in, 51), stored(QType.Q8_0, ff, n_in, 52),
                            stored(QType.Q4_K, n_out, ff, 53))
    x, h = rows_of(3, n_in, torch.bfloat16, 54), rows_of(3, n_out, torch.bfloat16, 55, scale=4.0)
    nw, then, scale = norm_weight(n_out, 56), norm_weight(n_out, 57), torch.tensor([0.875], device=DEVICE)
    deferred = ops.deferred_glu(x, gate_w, up_w, down_w, "gelu_tanh")
    made = ops.made(deferred)
    del launched[:]
    got = ops.add_normed(h, deferred, nw, EPS, scale)
    assert launched == ["fused_rows_kernel"], launched
    assert torch.equal(got, cuda.add_normed(h, made, nw, EPS, scale))
    del launched[:]
    pair = ops.add_normed_rms_norm(h, deferred, nw, EPS, then)
    assert launched == ["fused_rows_kernel"], launched
    s = cuda.add_normed(h, made, nw, EPS)
    assert same(pair, (s, cuda.rms_norm(s, then, EPS)))
    del launched[:]
    assert same(ops.add_normed_rms_norm(h, made, nw, EPS, then), pair)
    assert launched == ["norm_kernel", "norm_kernel"], launched
    seen = []

    class Observer:
        def product(self, rows, weight):
            seen.append((rows, weight))

    with observing(Observer()):
        observed = ops.add_normed_rms_norm(h, deferred, nw, EPS, then)
    assert len(seen) == 1 and seen[0][1] is down_w
    assert torch.equal(seen[0][0], cuda.glu(deferred.x, deferred.up, "gelu_tanh"))
    assert same(observed, pair)
    print(f"\n[{WHERE}] ops.add_normed(_rms_norm) of a Deferred GeGLU: one launch, the made product's bits")


def test_bad_input_one_line_errors():
    packed = sane_rows(QType.Q8_0, 48, 352, seed=61).to(DEVICE)
    x, h, w = rows_of(2, 352, torch.bfloat16, 62), rows_of(2, 48, torch.bfloat16, 63), norm_weight(48, 64)
    for kwargs, needle in (({"scale": torch.tensor([1.0, 2.0], device=DEVICE)}, "scale is one float32 value"),
                           ({"scale": torch.tensor([1.0], dtype=torch.float64, device=DEVICE)},
                            "scale is one float32 value"),
                           ({"then": w[:5]}, "then has shape")):
        with pytest.raises(SpecconvError, match=needle) as e:
            kt.quant_matmul_add_normed(x, packed, QType.Q8_0, 48, 352, h, w, EPS, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(SpecconvError, match="h must be"):
        kt.quant_matmul_add_normed(x, packed, QType.Q8_0, 48, 352, h.float(), w, EPS)


# linear_add_normed counted, as the CUDA backend runs it or as the separate operations it replaces
CountedSandwich = fused_or_separate("linear_add_normed")


@pytest.mark.parametrize("name, per_block, apart", [("gemma4-release", 3, 8), ("gemma4-moe-shapes", 1, 3)])
def test_each_sandwich_is_in_its_products_launch(name, per_block, apart, tmp_path_factory):
    """A bf16 decode step and 4-row verification of Gemma 4 on meta with the CUDA backend's choices:
    each linear_add_normed is one launch where the separate forms take two or three, nothing else
    changed. Per block (`apart`: their launches as separate operations): the attention side (three
    launches → one), and where the FFN output is one product (no MoE branch: gemma4-release), its
    down product (two → one) and the per-layer input's projection with the next block's input norm
    (the output norm after the last; three → one)."""
    from tests.fixtures.counted_calls import family_q8_0

    path = family_q8_0(tmp_path_factory.mktemp(name), name)
    blocks, results = fused_against_separate(path, CountedSandwich)
    for what, calls, inside, new, old in results:
        print(f"\n[meta, bf16] {name} {what}: {old.total} launches with the norms apart -> {new.total} with the "
              f"sandwich tails ({calls} products with a tail)")
        blocks = new.by_op["triton.attention_kernel"]  # one attention launch per block
        assert calls == per_block * blocks and inside == apart * blocks
        assert old.total - new.total == inside - calls


def test_the_sandwich_tails_sums_compile_to_norm_kernels_reductions():
    """Compiled for sm_90 (tools/triton_aot.py, no GPU needed): at widths of one block and of three
    (WIDE_ROW), bfloat16 and float32, 1 and 3 rows, the product kernel with the sandwich tail holds,
    once per block of each row, the very reduction norm_kernel's plain form compiles to (y's sum of
    squares: the same float operations, the same layout), and with the norm after, as many more in
    that layout (the sum's: its values are the bits norm_kernel reads): no reduction or layout
    beyond the product's own and norm_kernel's."""
    from specconv.runtime.kernels_triton import norm
    from tests.fixtures.compiled_launches import compiled_launches

    def make(recorder):
        for width, dtype, rows, after in itertools.product((896, WIDE_ROW), (torch.bfloat16, torch.float32), (1, 3),
                                                           (False, True)):
            recorder.key = ("tail", f"{width} {dtype} {after}", str(rows))
            x = torch.empty(rows, 256, dtype=dtype, device="meta")
            h = torch.empty(rows, width, dtype=dtype, device="meta")
            w = torch.empty(width, dtype=torch.float32, device="meta")
            packed = torch.empty(width, 8 * 34, dtype=torch.uint8, device="meta")
            kt.quant_matmul_add_normed(x, packed, QType.Q8_0, width, 256, h, w, EPS,
                                       scale=torch.empty(1, device="meta"), then=w if after else None)
            recorder.key = ("norm", f"{width} {dtype} {after}", str(rows))
            kt.rms_norm(h, w, EPS)
            recorder.key = ("product", f"{width} {dtype} {after}", str(rows))
            kt.quant_matmul(x, packed, QType.Q8_0, width, 256)

    compiled = compiled_launches(make)
    for (kind, what, rows), tail in compiled.items():
        if kind != "tail":
            continue
        alone, product = compiled[("norm", what, rows)], compiled[("product", what, rows)]
        (form, count), = alone.reduce_forms.items()
        blocks = norm.row_block(int(what.split()[0]))[1]
        after = what.endswith("True")
        assert count == blocks and tail.reduce_forms.get(form) == blocks * int(rows), (what, rows, tail.reduce_forms)
        added = sum(tail.reduce_forms.values()) - sum(product.reduce_forms.values())  # the product's own sums
        assert added == blocks * int(rows) * (2 if after else 1), (what, rows, tail.reduce_forms)
        assert set(tail.reduce_layouts) == set(product.reduce_layouts) | set(alone.reduce_layouts), what
        print(f"\nsm_90, {what}, {rows} row(s): y's sum of squares is norm_kernel's reduction {form}, "
              f"{'the sum normed after in its layout, ' if after else ''}once per block of a row")
