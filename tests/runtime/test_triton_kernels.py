"""The Triton kernels of runtime/kernels_triton/ against independent references: the packed products
and the dequantizer against runtime/dequant.py and gguf.quants.dequantize on bytes from gguf.quants'
encoders (Q8_0, BF16, F16), the K-quant encoder of convert/kquants.py (gguf-py has none) and random
blocks with finite scales (every bit pattern of the codes, scales and mins); the Gated DeltaNet step
and the causal conv against runtime/graphs/gdn.py's recurrence and conv (evaluated in float64 as the
exact reference, in float32 for comparison), per-token state slots included.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
tests/fixtures/triton_mode.py before Triton compiles a kernel); with one (and TRITON_INTERPRET
unset) the same tests run the compiled kernels on CUDA.
Skipped, with the reason, where Triton is not installed. Shapes are small: the interpreter executes
each kernel operation in numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from tests.fixtures.triton_mode import DEVICE, ON_GPU  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.convert import kquants  # noqa: E402
from specconv.runtime import kernels_triton as kt  # noqa: E402
from specconv.runtime.dequant import dequantize_rows as torch_dequantize  # noqa: E402
from specconv.runtime.graphs import gdn  # noqa: E402
from specconv.runtime.kernels_triton import matmul as qm  # noqa: E402
from tests.fixtures.quant_rows import sane_rows  # noqa: E402

EPS = float(torch.finfo(torch.float32).eps)
TYPES = [QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16, QType.F16]
# row lengths: whole blocks, not a power of two; 16-bit floats end part-way through a 32-value step;
# Q4_K / Q5_K an odd number of blocks (the product kernel takes them two a step: a last partial step)
N_IN = {QType.Q8_0: 352, QType.Q4_K: 1280, QType.Q5_K: 768, QType.Q6_K: 512, QType.BF16: 100, QType.F16: 77}
N_OUT = 37  # not a multiple of the kernels' 32-row tile


def encoded(qtype: QType, rows: int, n_in: int, seed: int) -> torch.Tensor:
    """Normal values through a real encoder: gguf.quants.quantize, or convert/kquants.py for the
    K-quants (the bytes llama.cpp's quantize writes)."""
    values = np.random.default_rng(seed).standard_normal((rows, n_in)).astype(np.float32)
    if qtype in kquants.K_TYPES:
        packed = np.empty((rows, n_in // 256 * kquants.BLOCK_BYTES[qtype]), np.uint8)
        assert kquants.encode(values, qtype, packed)
    else:
        packed = np.ascontiguousarray(gguf_quants.quantize(values, qtype)).view(np.uint8)
    return torch.from_numpy(packed.reshape(rows, -1).copy())


def weights(qtype: QType, seed: int) -> torch.Tensor:
    """Packed [N_OUT, row bytes]: encoded rows, then random blocks with finite scales."""
    n_in = N_IN[qtype]
    half = N_OUT // 2
    return torch.cat([encoded(qtype, half, n_in, seed), sane_rows(qtype, N_OUT - half, n_in, seed)])


def exact_product(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ wᵀ in float64 (exact for these sizes up to float64 rounding) and Σ_k |x_k w_k| per output."""
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    return x64 @ w64.t(), x64.abs() @ w64.abs().t()


def noise(y: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> float:
    """max |y - exact| in units of eps · Σ|x·w| (per output)."""
    diff = (y.double().reshape(exact.shape) - exact).abs()
    assert bool(((diff == 0) | (scale > 0)).all())
    return float((diff / (EPS * scale).clamp_min(1e-300)).max())


# ---- dequantize_rows ------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_bit_identical(qtype):
    """float32 values bit-identical to runtime/dequant.py and gguf.quants.dequantize, from rows that
    are a strided view (every other row of a buffer); float16 as torch rounds them; bfloat16 one of
    the two neighbours of the float32 value (the interpreter truncates where a GPU rounds to
    nearest; on a GPU: exactly torch's rounding)."""
    n_in = N_IN[qtype]
    packed = weights(qtype, seed=1)
    spaced = torch.zeros(2 * N_OUT, packed.shape[1], dtype=torch.uint8)
    spaced[::2] = packed
    rows = spaced[::2].to(DEVICE)
    reference = torch_dequantize(packed, qtype)
    independent = torch.from_numpy(gguf_quants.dequantize(packed.numpy(), qtype).astype(np.float32))
    assert torch.equal(reference.view(torch.int32), independent.reshape(N_OUT, n_in).view(torch.int32))
    values = kt.dequantize_rows(rows, qtype, N_OUT, n_in, torch.float32).cpu()
    assert values.shape == (N_OUT, n_in)
    assert torch.equal(values.view(torch.int32), reference.view(torch.int32))
    assert torch.equal(kt.dequantize_rows(rows, qtype, N_OUT, n_in, torch.float16).cpu(), reference.half())
    bf16 = kt.dequantize_rows(rows, qtype, N_OUT, n_in, torch.bfloat16).cpu()
    truncated = (reference.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    above = (truncated.view(torch.int16) + 1).view(torch.bfloat16)  # next away from zero
    nearest = reference.bfloat16()
    assert bool(((bf16 == truncated) | (bf16 == above)).all())
    if ON_GPU:
        assert torch.equal(bf16, nearest)


# ---- quant_matmul: the fused product of 1-16 rows --------------------------------------------------

# |y - x Wᵀ| <= FUSED_BOUND * eps * Σ_k |x_k w_k| for every output, against the exact (float64)
# product. The kernel sums 32 products per step (a tree of depth 5) and adds the steps in order, so
# its worst case grows as eps * (5 + steps) * Σ|x w| (steps = n_in / 32 ≤ 16 here); random signs
# keep it near the square root of that. Measured worst (printed): under 0.5; 4 (the bound of the
# CPU's fused kernels, tests/runtime/test_dequant_native.py) leaves room for a GPU's own reduction
# order while a wrong or lost value (an error of order Σ|x w|, millions of eps) fails.
FUSED_BOUND = 4.0
# bfloat16 / float16 output: the float32 sum rounded once more (less than 1 ulp: 2^-7 and 2^-10 of
# the value in the worst case: the interpreter truncates to bfloat16)
OUTPUT_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fused_product_within_summation_noise(qtype):
    """1, 3, 8 and 16 activation rows in float32 against the exact product of the dequantized W."""
    n_in = N_IN[qtype]
    packed = weights(qtype, seed=2)
    w = torch_dequantize(packed, qtype)
    packed = packed.to(DEVICE)
    worst = 0.0
    for rows in (1, 3, 8, 16):
        x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
        y = kt.quant_matmul(x.to(DEVICE), packed, qtype, N_OUT, n_in)
        assert y.shape == (rows, N_OUT) and y.dtype == torch.float32
        worst = max(worst, noise(y.cpu(), *exact_product(x, w)))
    where = "CUDA" if ON_GPU else "interpreter"
    print(f"\n[triton fused {qtype.name}, {where}] worst |Δ| = {worst:.3f} eps·Σ|x·w|")
    assert worst <= FUSED_BOUND


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.BF16], ids=lambda t: t.name)
def test_fused_product_16bit_activations(qtype, dtype):
    """x in bfloat16 / float16: float32 sums of the same products, one rounding into x's dtype."""
    n_in = N_IN[qtype]
    packed = weights(qtype, seed=3)
    w = torch_dequantize(packed, qtype)
    x = torch.randn(5, n_in, generator=torch.Generator().manual_seed(5)).to(dtype)
    y = kt.quant_matmul(x.to(DEVICE), packed.to(DEVICE), qtype, N_OUT, n_in).cpu()
    assert y.dtype == dtype
    exact, scale = exact_product(x, w)
    diff = (y.double() - exact).abs()
    bound = FUSED_BOUND * EPS * scale + OUTPUT_ULP[dtype] * (exact.abs() + FUSED_BOUND * EPS * scale)
    print(f"\n[triton fused {qtype.name}, x {dtype}] worst |Δ| / bound = {float((diff / bound).max()):.3f}")
    assert bool((diff <= bound).all())


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q5_K, QType.F16], ids=lambda t: t.name)
def test_fused_rows_independent_of_batch(qtype):
    """A row's output is the same bits alone, in a batch of 3 and in a batch of 16 (at any place): a
    verification batch reproduces the decode step's values."""
    n_in = N_IN[qtype]
    packed = weights(qtype, seed=4).to(DEVICE)
    x = torch.randn(16, n_in, generator=torch.Generator().manual_seed(16)).to(DEVICE)
    full = kt.quant_matmul(x, packed, qtype, N_OUT, n_in)
    assert torch.equal(kt.quant_matmul(x[5:8], packed, qtype, N_OUT, n_in), full[5:8])
    for m in (0, 7, 15):
        assert torch.equal(kt.quant_matmul(x[m:m + 1], packed, qtype, N_OUT, n_in), full[m:m + 1])


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K], ids=lambda t: t.name)
def test_fused_product_cut_along_the_inner_dimension(qtype, monkeypatch):
    """A matrix with few rows of tiles is cut into pieces along its inner dimension (more programs on
    the GPU), the float32 sums of the pieces added in order: within the same summation noise as one
    piece, the cut a function of W's shape and the device only (never of the number of rows)."""
    n_in = N_IN[qtype]
    packed = weights(qtype, seed=8)
    w = torch_dequantize(packed, qtype)
    n_blocks = -(-n_in // qm.GEOMETRY[qtype][0])
    assert qm.split_plan(qtype, N_OUT, n_blocks, DEVICE)[0] > 1  # the tests' shapes take the cut path
    x = torch.randn(4, n_in, generator=torch.Generator().manual_seed(8))
    cut = kt.quant_matmul(x.to(DEVICE), packed.to(DEVICE), qtype, N_OUT, n_in).cpu()
    assert {qm.split_plan(qtype, N_OUT, n_blocks, DEVICE)} == {qm.split_plan(qtype, N_OUT, n_blocks, DEVICE)
                                                            for _ in range(3)}
    monkeypatch.setattr(qm, "PROGRAMS_PER_SM", 0)  # one piece per tile of rows
    assert qm.split_plan(qtype, N_OUT, n_blocks, DEVICE)[0] == 1
    whole = kt.quant_matmul(x.to(DEVICE), packed.to(DEVICE), qtype, N_OUT, n_in).cpu()
    exact = exact_product(x, w)
    worst = max(noise(cut, *exact), noise(whole, *exact))
    print(f"\n[triton fused {qtype.name}: cut / whole] worst |Δ| = {worst:.3f} eps·Σ|x·w|")
    assert worst <= FUSED_BOUND


def test_fused_product_views_and_static_output():
    """x [2, 3, n_in] whose rows are a view of a wider buffer, W rows that are a view (one expert of a
    3-D expert tensor), and a given output buffer written in place."""
    qtype, n_in = QType.Q4_K, 256
    experts = torch.stack([encoded(qtype, N_OUT, n_in, seed=s) for s in (5, 6)]).to(DEVICE)
    wide = torch.randn(2, 3, n_in + 40, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    x = wide[..., :n_in]
    out = torch.full((2, 3, N_OUT), float("nan"), device=DEVICE)
    y = kt.quant_matmul(x, experts[1], qtype, N_OUT, n_in, out=out)
    assert y is out and y.shape == (2, 3, N_OUT)
    w = torch_dequantize(experts[1].cpu(), qtype)
    assert noise(y.cpu(), *exact_product(x.cpu(), w)) <= FUSED_BOUND


# ---- quant_matmul: more rows (prompts) -------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q6_K, QType.BF16], ids=lambda t: t.name)
def test_prompt_rows_dequantize_then_multiply(qtype, monkeypatch):
    """17 and 40 rows: W dequantized a few rows at a time (pieces of 8 rows here), each piece
    multiplied by torch's product; a 16-bit float W in x's dtype multiplied as stored."""
    n_in = N_IN[qtype]
    packed = weights(qtype, seed=7)
    w = torch_dequantize(packed, qtype)
    monkeypatch.setattr(qm, "TILE_VALUES", 8 * n_in)
    for rows in (17, 40):
        x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
        y = kt.quant_matmul(x.to(DEVICE), packed.to(DEVICE), qtype, N_OUT, n_in).cpu()
        assert noise(y, *exact_product(x, w)) <= FUSED_BOUND
    if qtype == QType.BF16:
        x = torch.randn(20, n_in, generator=torch.Generator().manual_seed(20)).bfloat16()
        y = kt.quant_matmul(x.to(DEVICE), packed.to(DEVICE), qtype, N_OUT, n_in).cpu()
        assert torch.equal(y, (x.to(DEVICE) @ packed.to(DEVICE).view(torch.bfloat16).t()).cpu())


# ---- gated delta rule -------------------------------------------------------------------------------

def gdn_inputs(n: int, nk: int, nv: int, dk: int, dv: int, slots: int, seed: int):
    """Inputs as the runtime makes them: q, k L2-normed (q scaled), log-decays ≤ 0, β in (0, 1), and
    a ring of random states."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, nk, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(n, nk, dk, generator=gen), dim=-1)
    v = torch.randn(n, nv, dv, generator=gen)
    g = -F.softplus(torch.randn(n, nv, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(n, nv, generator=gen))
    states = torch.randn(slots, nv, dk, dv, generator=gen)
    return q, k, v, g, beta, states


# max |Δ| of outputs and states against the float64 recurrence, in units of eps · (1 + max |S|): each
# token adds a dk-term sum (Sᵀk, Sᵀq: a few eps of |S| each), an update and a decay to the state,
# and the decay shrinks earlier errors. Measured (printed): under 0.7 up to 16 tokens, the torch
# float32 recurrence's own error about the same; 4 leaves room for a GPU's exp (a few ulp where
# numpy's is correctly rounded) while a wrong term (of order |S|) fails.
GDN_BOUND = 4.0


@pytest.mark.parametrize("n", [1, 3, 8, 16])
@pytest.mark.parametrize("heads", [(2, 2, 16, 40), (1, 3, 24, 32)], ids=["nk=nv", "tiled,dk=24"])
def test_gdn_step_matches_recurrence(n, heads):
    """Outputs and the state after every token against runtime/graphs/gdn.py's recurrent form (in
    float64 and float32), each state in its slot of a ring that wraps; the source slot and every slot
    not written left as they were."""
    nk, nv, dk, dv = heads
    slots = 18
    q, k, v, g, beta, ring = gdn_inputs(n, nk, nv, dk, dv, slots, seed=n)
    src = 9
    dst = [(src + 1 + i) % slots for i in range(n)]  # wraps for n ≥ 9
    before = ring.clone()
    ring_dev = ring.to(DEVICE)
    o = kt.gdn_step(*(t.to(DEVICE) for t in (q, k, v, g, beta)), ring_dev, src, dst).cpu()
    ring = ring_dev.cpu()
    qe, ke = q.repeat(1, nv // nk, 1), k.repeat(1, nv // nk, 1)
    o64, s64 = gdn.recurrent_delta_rule(*(t.double() for t in (qe, ke, v, g, beta, before[src])), keep=n)
    o32, s32 = gdn.recurrent_delta_rule(qe, ke, v, g, beta, before[src], keep=n)
    scale = EPS * (1.0 + float(s64.abs().max()))
    err = max(float((o.double() - o64).abs().max()), float((ring[dst].double() - s64).abs().max())) / scale
    torch_err = max(float((o32.double() - o64).abs().max()), float((s32.double() - s64).abs().max())) / scale
    print(f"\n[triton gdn n={n} {heads}] max |Δ| = {err:.2f} (torch float32 form {torch_err:.2f}) eps·(1+max|S|)")
    assert err <= GDN_BOUND
    untouched = [s for s in range(slots) if s not in dst]
    assert src in untouched and torch.equal(ring[untouched], before[untouched])


def test_gdn_step_keeps_last_tokens_and_ring_of_one():
    """keep < n: only the last `keep` states are written; a ring of one slot (source = destination)
    holds the state after the batch; slots given as device tensors (a captured graph's index
    buffers) give the same bits as ints."""
    n, nk, nv, dk, dv = 5, 2, 2, 16, 24
    q, k, v, g, beta, ring = gdn_inputs(n, nk, nv, dk, dv, 6, seed=11)
    inputs = [t.to(DEVICE) for t in (q, k, v, g, beta)]
    o64, s64 = gdn.recurrent_delta_rule(*(t.double() for t in (q, k, v, g, beta, ring[0])), keep=2)
    scale = EPS * (1.0 + float(s64.abs().max()))
    kept = ring.clone().to(DEVICE)
    o = kt.gdn_step(*inputs, kept, 0, [4, 5])
    assert float((kept.cpu()[[4, 5]].double() - s64).abs().max()) <= GDN_BOUND * scale
    assert torch.equal(kept.cpu()[:4], ring[:4])
    as_tensors = ring.clone().to(DEVICE)
    o_t = kt.gdn_step(*inputs, as_tensors, torch.tensor([0], device=DEVICE), torch.tensor([4, 5], device=DEVICE))
    assert torch.equal(o_t, o) and torch.equal(as_tensors, kept)
    one = ring[:1].clone().to(DEVICE)
    o_one = kt.gdn_step(*inputs, one, 0, [0])
    assert torch.equal(o_one, o) and torch.equal(one[0], kept[5])
    assert float((o.cpu().double() - o64).abs().max()) <= GDN_BOUND * scale


# ---- causal conv --------------------------------------------------------------------------------------

# |Δ| of the activations against the exact (float64) conv and SiLU, in units of eps · (1 + Σ_j |x w|):
# K float32 products and sums, then SiLU (an exp and a division, each a few ulp on a GPU) whose slope
# is at most 1.1. Measured (printed, the torch float32 form's error beside it): under 1.2.
CONV_BOUND = 4.0


@pytest.mark.parametrize("n", [1, 3, 8, 16])
@pytest.mark.parametrize("taps", [4, 2])
def test_causal_conv_matches_torch_form(n, taps):
    """Activations against runtime/graphs/gdn.py's causal_conv in float64; the window after every
    token in its slot (a ring that wraps) equal to its float32 windows bit for bit (they are copies
    of input rows); other slots untouched."""
    channels, slots = 200, 18  # channels: not a multiple of the 128-channel tile
    gen = torch.Generator().manual_seed(100 * n + taps)
    m = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    ring = torch.randn(slots, taps - 1, channels, generator=gen)
    src, dst = 12, [(13 + i) % slots for i in range(n)]
    before = ring.clone()
    ring_dev = ring.to(DEVICE)
    out = kt.causal_conv(m.to(DEVICE), ring_dev, weight.to(DEVICE), src, dst).cpu()
    ring = ring_dev.cpu()
    reference, windows = gdn.causal_conv(m, before[src], weight, keep=n)
    exact, _ = gdn.causal_conv(m.double(), before[src].double(), weight.double(), keep=n)
    x = torch.cat([before[src], m]).double()
    unit = EPS * (1.0 + (x.unfold(0, taps, 1).abs() * weight.double().abs()).sum(-1))  # per output
    err = float(((out.double() - exact).abs() / unit).max())
    torch_err = float(((reference.double() - exact).abs() / unit).max())
    print(f"\n[triton conv n={n} K={taps}] max |Δ| = {err:.2f} (torch float32 form {torch_err:.2f}) eps·(1+Σ|x·w|)")
    assert err <= CONV_BOUND
    assert torch.equal(ring[dst], windows)
    untouched = [s for s in range(slots) if s not in dst]
    assert torch.equal(ring[untouched], before[untouched])


def test_causal_conv_keep_ring_of_one_and_16bit_inputs():
    """keep < n writes the last windows only; a ring of one slot (source = the last destination);
    bfloat16 inputs give bfloat16 activations from float32 sums."""
    n, channels, taps = 6, 130, 4
    gen = torch.Generator().manual_seed(7)
    m = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    state = torch.randn(taps - 1, channels, generator=gen)
    reference, windows = gdn.causal_conv(m, state, weight, keep=2)
    ring = torch.zeros(4, taps - 1, channels)
    ring[3] = state
    ring = ring.to(DEVICE)
    out = kt.causal_conv(m.to(DEVICE), ring, weight.to(DEVICE), 3, [0, 1])
    assert torch.equal(ring.cpu()[[0, 1]], windows) and torch.equal(ring.cpu()[3], state)
    one = state[None].clone().to(DEVICE)
    assert torch.equal(kt.causal_conv(m.to(DEVICE), one, weight.to(DEVICE), 0, [0]), out)
    assert torch.equal(one.cpu()[0], windows[-1])
    m16 = m.bfloat16()
    ref16, _ = gdn.causal_conv(m16, state.bfloat16(), weight, keep=1)
    out16 = kt.causal_conv(m16.to(DEVICE), state[None].clone().to(DEVICE), weight.to(DEVICE), 0, [0]).cpu()
    assert out16.dtype == torch.bfloat16
    assert float((out16.float() - ref16.float()).abs().max()) <= 2.0 ** -7 * (1.0 + float(ref16.float().abs().max()))
    with pytest.raises(SpecconvError, match="only be the last destination"):
        kt.causal_conv(m.to(DEVICE), ring, weight.to(DEVICE), 1, [1, 2])


# ---- bad input and a missing Triton -----------------------------------------------------------------

def test_bad_input_one_line_errors():
    packed = encoded(QType.Q4_K, N_OUT, 512, seed=8).to(DEVICE)
    x = torch.randn(2, 512, device=DEVICE)

    def gdn_on_device(n: int, ring: torch.Tensor) -> list[torch.Tensor]:
        """q, k, v, g, β of n tokens and a ring, where the kernels run: each check below must be the
        one that fires, not the device check."""
        return [t.to(DEVICE) for t in gdn_inputs(n, 1, 1, 8, 8, 2, 0)[:5]] + [ring.to(DEVICE)]

    cases = [
        (lambda: kt.quant_matmul(x, packed, QType.Q4_0, N_OUT, 512), "no Triton kernel for Q4_0"),
        (lambda: kt.quant_matmul(x[:, :300], packed, QType.Q4_K, N_OUT, 300), "not a whole number"),
        (lambda: kt.quant_matmul(x, packed, QType.Q4_K, N_OUT + 1, 512), "packed has shape"),
        (lambda: kt.quant_matmul(x.long(), packed, QType.Q4_K, N_OUT, 512), "float32, bfloat16 or float16"),
        (lambda: kt.quant_matmul(x[:, :256], packed, QType.Q4_K, N_OUT, 512), r"expected \[..., 512\]"),
        (lambda: kt.dequantize_rows(packed.float(), QType.Q4_K, N_OUT, 512), "uint8"),
        (lambda: kt.gdn_step(*gdn_on_device(17, torch.zeros(2, 1, 8, 8)), 0, [1]), "17 tokens"),
        (lambda: kt.gdn_step(*gdn_on_device(2, torch.zeros(2, 1, 8, 8)), 0, [2]), "outside the ring"),
        (lambda: kt.gdn_step(*gdn_on_device(2, torch.zeros(2, 1, 8, 8).double()), 0, [1]), "must be float32"),
        (lambda: kt.causal_conv(torch.randn(2, 8, device=DEVICE), torch.zeros(2, 3, 8, device=DEVICE),
                                torch.randn(8, 3, device=DEVICE), 0, [1]), "states has shape"),
    ]
    for call, message in cases:
        with pytest.raises(SpecconvError, match=message):
            call()


def test_package_imports_without_triton():
    """The package imports where Triton is missing, and a call says what is missing in one line."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from gguf import GGMLQuantizationType as Q\n"
            "from specconv.archs.errors import SpecconvError\n"
            "from specconv.runtime import kernels_triton as kt\n"
            "assert not kt.available()\n"
            "try:\n"
            "    kt.quant_matmul(torch.zeros(1, 32), torch.zeros(3, 34, dtype=torch.uint8), Q.Q8_0, 3, 32)\n"
            "except SpecconvError as e:\n"
            "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    assert "need the `triton` package" in done.stdout


@pytest.mark.parametrize("version, usable", [("3.1.0", False), ("3.5.1", False), ("2.3.1", False), ("3.6.0", True),
                                             ("3.10.1", True), ("3.7.0+git1a2b3c", True), ("4.0.0", True)])
def test_a_triton_older_than_the_tested_floor_is_not_used(monkeypatch, version, usable):
    """Versions compare as numbers (3.10 is newer than 3.6); an older one is named in the reason."""
    from specconv.runtime.kernels_triton import _common

    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    why = _common.why_unavailable()
    assert _common.available() == usable and (why is None) == usable
    if not usable:
        assert version in why and "3.6" in why


def test_a_gpu_machine_with_an_old_triton_is_told_and_runs_the_torch_reference(monkeypatch, capsys):
    from specconv.runtime import backend_cuda

    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.2.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend = backend_cuda.CudaBackend()
    assert backend.kernels is None
    assert "CUDA kernels are off: Triton 3.2.0 is older than 3.6" in capsys.readouterr().err
