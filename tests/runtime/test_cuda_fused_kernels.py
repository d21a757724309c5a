"""The one-launch kernels around the products (runtime/kernels_triton: norm.py, rope.py, activation.py)
against the torch reference formulas of runtime/backend_torch.py, which the CPU runs:

* float32: every output within a few ulps of the reference (rope and the residual sum: the same bits);
* bfloat16 in and out: within one bfloat16 rounding of the reference (the interpreter truncates
  where a GPU rounds to nearest);
* batch invariance: a row computed alone gives the bits it gets in a batch of 16;
* the CUDA backend reaches each kernel through the seam (runtime/graphs/ops.py, gdn.gates) and
  keeps the torch formula where a kernel does not apply (float64).

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
tests/fixtures/triton_mode.py before Triton compiles a kernel); with one (and TRITON_INTERPRET unset) the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, WHERE, record_launches  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import kernels_triton as kt  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402

REF = TorchBackend()
EPS = 1e-6
# float32 outputs: within ULPS units in the last place of the reference value. An RMSNorm output
# rounds four times on each side (the sum of squares, its mean, the reciprocal square root, two
# products) and the kernel sums the squares in another order (a tree over the row); silu and the
# gates take exp and log from another library. Two correct evaluations may so differ by up to about
# 2 x 4 ulps; measured worst (printed): 4. A wrong formula or a lost term is off by thousands.
ULPS = 8


def ulps(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| in units of the spacing of float32 numbers at |ref|."""
    y, ref = y.detach().cpu().float(), ref.detach().cpu().float()
    mag = ref.abs()
    spacing = torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag
    return float(((y - ref).abs() / spacing).max())


def rand(*shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def within_bf16_rounding(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / (2^-7 |ref|). Each rounding into bfloat16 moves a value by at most 2^-8 of it
    (to nearest: the reference, a GPU) or 2^-7 (truncation: the interpreter), so outputs that round
    r times on each side differ by at most 1.5 r in these units (plus float32 noise)."""
    y, ref = y.cpu().float(), ref.cpu().float()
    return float(((y - ref).abs() / (2.0 ** -7 * ref.abs()).clamp_min(1e-30)).max())


# ---- float32 against the reference formulas ------------------------------------------------------

@pytest.mark.parametrize("width", [16, 64, 200, 2048, 2 * kt.norm.ROW_CHUNK + 200])
def test_rms_norm_and_l2_norm_float32(width):
    x = rand(3, 5, width, seed=width)
    w = rand(width, seed=width + 1, scale=0.5) + 1
    got = {"rms_norm": kt.rms_norm(x, w, EPS), "rms_norm, no weight": kt.rms_norm(x, None, EPS),
           "l2_norm": kt.l2_norm(x, EPS)}
    ref = {"rms_norm": REF.rms_norm(x, w, EPS), "rms_norm, no weight": REF.rms_norm(x, None, EPS),
           "l2_norm": REF.l2_norm(x, EPS)}
    for name in got:
        diff, units = float((got[name] - ref[name]).abs().max()), ulps(got[name], ref[name])
        print(f"\n[{WHERE}] {name} width {width}: max |Δ| {diff:.2e} ({units:.1f} ulps)")
        assert got[name].dtype == torch.float32 and units <= ULPS, name


def test_residual_add_then_rms_norm_float32():
    h, delta = rand(4, 96, seed=1), rand(4, 96, seed=2)
    w = rand(96, seed=3)
    total, y = kt.rms_norm(h, w, EPS, residual=delta)
    ref_total, ref_y = REF.add_rms_norm(h, delta, w, EPS)
    units = ulps(y, ref_y)
    print(f"\n[{WHERE}] residual add + rms_norm: sum max |Δ| {float((total - ref_total).abs().max()):.1e}, "
          f"norm max |Δ| {float((y - ref_y).abs().max()):.2e} ({units:.1f} ulps)")
    assert torch.equal(total.cpu(), ref_total.cpu()) and units <= ULPS


def test_rows_wider_than_a_block_go_in_chunks():
    """A row wider than norm.ROW_CHUNK (Gemma's and 9B+ models' hidden sizes) in chunks of it, every
    form, float32: the residual add + norm and the gated norm within ULPS of the reference (the
    residual sum bit for bit); the sandwich norm (h + norm(x)) · scale exactly as the norm kernel's
    own rows added and scaled (its add within an ulp of h or of the norm would hide under a
    relative bound where they cancel; the plain norm of a wide row is held to the reference in
    test_rms_norm_and_l2_norm_float32). A row alone: the bits of its row in a batch of 5."""
    width = 2 * kt.norm.ROW_CHUNK + 200
    x, delta, z, h = (rand(5, width, seed=60 + i, scale=2.0) for i in range(4))
    w, scale = rand(width, seed=64, scale=0.5) + 1, rand(1, seed=65).abs() + 0.5
    forms = {
        "residual + rms_norm": (lambda s: kt.rms_norm(x[s], w, EPS, residual=delta[s]),
                                lambda: REF.add_rms_norm(x, delta, w, EPS)),
        "gated rms_norm": (lambda s: kt.rms_norm(x[s], w, EPS, gate=z[s]), lambda: REF.gated_rms_norm(x, w, z, EPS)),
    }
    for name, (kernel, reference) in forms.items():
        got, ref = kernel(slice(None)), reference()
        got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
        units = ulps(got[-1], ref[-1])
        print(f"\n[{WHERE}] {name}, width {width}: max |Δ| {float((got[-1] - ref[-1]).abs().max()):.2e} "
              f"({units:.1f} ulps)")
        assert units <= ULPS, name
        if len(got) == 2:
            assert torch.equal(got[0].cpu(), ref[0].cpu()), name
    sandwich = kt.rms_norm(x, w, EPS, add_to=h, out_scale=scale)
    assert torch.equal(sandwich.cpu(), ((h + kt.rms_norm(x, w, EPS)) * scale).cpu())
    forms["sandwich norm, scaled"] = (lambda s: kt.rms_norm(x[s], w, EPS, add_to=h[s], out_scale=scale), None)
    for name, (kernel, _) in forms.items():
        together = kernel(slice(None))
        together = together if isinstance(together, tuple) else (together,)
        for i in (0, 4):
            alone = kernel(slice(i, i + 1))
            alone = alone if isinstance(alone, tuple) else (alone,)
            assert all(torch.equal(a, t[i:i + 1]) for a, t in zip(alone, together, strict=True)), (name, i)


def test_gated_rms_norm_float32():
    """Gated DeltaNet's output norm: rms_norm(o) · silu(z), o and z [n, heads, dv] (z a strided view)."""
    o = rand(3, 4, 32, seed=4)
    z = rand(3, 4, 64, seed=5)[..., :32]
    w = rand(32, seed=6)
    y, ref = kt.rms_norm(o, w, EPS, gate=z), REF.gated_rms_norm(o, w, z, EPS)
    units = ulps(y, ref)
    print(f"\n[{WHERE}] gated rms_norm: max |Δ| {float((y - ref).abs().max()):.2e} ({units:.1f} ulps)")
    assert y.dtype == torch.float32 and units <= ULPS


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("rotated", [4, 16])
def test_rope_float32_is_the_reference_bit_for_bit(style, rotated):
    """q of an interleaved q|gate projection (a strided view), part or all of each head rotated: the
    reference's products and sums in its order, no FMA: the same bits."""
    n, heads, head_dim = 5, 4, 16
    q = rand(n, heads, 2 * head_dim, seed=7)[..., :head_dim]
    cos, sin = rand(n, rotated // 2, seed=8), rand(n, rotated // 2, seed=9)
    y, ref = kt.rope(q, cos, sin, style), REF.rope(q, cos, sin, style)
    print(f"\n[{WHERE}] rope {style}, {rotated} of {head_dim} rotated: max |Δ| {float((y - ref).abs().max()):.1e}")
    assert torch.equal(y.cpu(), ref.cpu())


def test_silu_mul_float32():
    gate, up = rand(3, 1500, seed=10, scale=4), rand(3, 1500, seed=11)
    y, ref = kt.silu_mul(gate, up), REF.silu_mul(gate, up)
    units = ulps(y, ref)
    print(f"\n[{WHERE}] silu(gate) · up: max |Δ| {float((y - ref).abs().max()):.2e} ({units:.1f} ulps)")
    assert units <= ULPS


def test_gdn_gates_float32():
    """Decay inputs across softplus' range (deep negative: log1p of a tiny e; above 20: x itself)."""
    n, heads = 6, 24
    b = rand(n, heads, seed=12, scale=8)
    alpha = torch.linspace(-60, 40, n * heads).reshape(n, heads).to(DEVICE)
    a, dt_bias = -rand(heads, seed=13).abs() - 0.1, rand(heads, seed=14)
    (g, beta), (ref_g, ref_beta) = kt.gdn_gates(b, alpha, a, dt_bias), REF.gdn_gates(b, alpha, a, dt_bias)
    units = max(ulps(g, ref_g), ulps(beta, ref_beta))
    print(f"\n[{WHERE}] gdn gates: g max |Δ| {float((g - ref_g).abs().max()):.2e}, "
          f"β max |Δ| {float((beta - ref_beta).abs().max()):.2e} ({units:.1f} ulps)")
    assert units <= ULPS


# ---- bfloat16 in and out -------------------------------------------------------------------------

def test_bfloat16_in_and_out_within_one_rounding():
    bf = torch.bfloat16
    x, w = rand(4, 128, seed=15, dtype=bf), rand(128, seed=16)
    q, cos, sin = rand(3, 4, 16, seed=17, dtype=bf), rand(3, 4, seed=18), rand(3, 4, seed=19)
    gate, up = rand(4, 256, seed=20, dtype=bf, scale=3), rand(4, 256, seed=21, dtype=bf)
    # (kernel, reference, roundings into bfloat16 on each side: silu(gate) is rounded before the product)
    cases = {"rms_norm": (kt.rms_norm(x, w, EPS), REF.rms_norm(x, w, EPS), 1),
             "rope": (kt.rope(q, cos, sin), REF.rope(q, cos, sin, "neox"), 1),
             "silu_mul": (kt.silu_mul(gate, up), REF.silu_mul(gate, up), 2)}
    for name, (y, ref, roundings) in cases.items():
        worst = within_bf16_rounding(y, ref)
        print(f"\n[{WHERE}] {name} bf16: max |Δ| {float((y.float() - ref.float()).abs().max()):.2e} "
              f"({worst:.2f} × 2^-7 |ref|, bound {1.5 * roundings})")
        assert y.dtype == bf and worst <= 1.5 * roundings


# ---- batch invariance ----------------------------------------------------------------------------

def test_a_row_alone_gets_the_bits_of_a_batch_of_16():
    batch = 16
    x, r, z = rand(batch, 96, seed=22), rand(batch, 96, seed=23), rand(batch, 96, seed=24)
    w = rand(96, seed=25)
    q, cos, sin = rand(batch, 4, 16, seed=26), rand(batch, 4, seed=27), rand(batch, 4, seed=28)
    b, alpha = rand(batch, 8, seed=29), rand(batch, 8, seed=30)
    a, dt_bias = -rand(8, seed=31).abs(), rand(8, seed=32)
    ops = {
        "rms_norm": lambda s: kt.rms_norm(x[s], w, EPS),
        "residual + rms_norm": lambda s: torch.cat(kt.rms_norm(x[s], w, EPS, residual=r[s]), -1),
        "gated rms_norm": lambda s: kt.rms_norm(x[s], w, EPS, gate=z[s]),
        "l2_norm": lambda s: kt.l2_norm(x[s], EPS),
        "rope": lambda s: kt.rope(q[s], cos[s], sin[s]),
        "silu_mul": lambda s: kt.silu_mul(x[s], z[s]),
        "gdn_gates": lambda s: torch.cat(kt.gdn_gates(b[s], alpha[s], a, dt_bias), -1),
    }
    for name, f in ops.items():
        together = f(slice(None))
        for i in (0, 9, 15):
            assert torch.equal(f(slice(i, i + 1)), together[i:i + 1]), (name, i)
    print(f"\n[{WHERE}] {len(ops)} kernels: rows 0, 9, 15 alone = in a batch of {batch}, bit for bit")


# ---- through the backend seam --------------------------------------------------------------------

def test_the_cuda_backend_reaches_the_kernels_through_the_seam(monkeypatch):
    """ops.rms_norm / l2_norm / rope_neox_partial / rope_pairs / swiglu's product and gdn.gates on the
    CUDA backend launch the kernels (counted), and compute what the torch backend computes; float64
    keeps the torch formula (no launch)."""
    from specconv.runtime import backend as backend_module
    from specconv.runtime.graphs import gdn, ops

    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    monkeypatch.setattr(backend_module, "_backend", lambda kind: cuda)
    launched = record_launches(monkeypatch)
    x, w = rand(2, 3, 32, seed=33), rand(32, seed=34)
    cos, sin = rand(2, 4, seed=35), rand(2, 4, seed=36)
    b, alpha, a, dt_bias = rand(2, 3, seed=37), rand(2, 3, seed=38), -rand(3, seed=39).abs(), rand(3, seed=40)
    calls = [
        (ops.rms_norm(x, w, EPS), REF.rms_norm(x, w, EPS)),
        (ops.add_rms_norm(x, x, w, EPS)[1], REF.add_rms_norm(x, x, w, EPS)[1]),
        (ops.gated_rms_norm(x, w, x, EPS), REF.gated_rms_norm(x, w, x, EPS)),
        (ops.l2_norm(x, EPS), REF.l2_norm(x, EPS)),
        (ops.rope_neox_partial(x, cos, sin), REF.rope(x, cos, sin, "neox")),
        (ops.rope_pairs(x, cos, sin), REF.rope(x, cos, sin, "norm")),
        (cuda.silu_mul(x, x), REF.silu_mul(x, x)),
        (gdn.gates(b, alpha, a, dt_bias)[0], REF.gdn_gates(b, alpha, a, dt_bias)[0]),
    ]
    assert launched == ["norm_kernel"] * 4 + ["rope_kernel"] * 2 + ["glu_kernel", "gdn_gates_kernel"]
    worst = max(ulps(y, ref) for y, ref in calls)
    print(f"\n[{WHERE}] through the seam: {len(launched)} launches, worst {worst:.1f} ulps from the torch backend")
    assert worst <= ULPS
    launched.clear()
    x64 = x.double()
    assert torch.equal(ops.rms_norm(x64, w, EPS), REF.rms_norm(x64, w, EPS)) and launched == []


def test_bad_input_is_a_one_line_error():
    x = rand(2, 8, seed=41)
    with pytest.raises(SpecconvError, match="rms_norm: weight has shape"):
        kt.rms_norm(x, rand(7, seed=42), EPS)
    with pytest.raises(SpecconvError, match="rope: style"):
        kt.rope(x.view(2, 1, 8), rand(2, 2, seed=43), rand(2, 2, seed=44), "gptj")
    with pytest.raises(SpecconvError, match="silu_mul: gate and up"):
        kt.silu_mul(x, x.double())
    with pytest.raises(SpecconvError, match="gdn_gates: a has shape"):
        kt.gdn_gates(x, x, rand(3, seed=45), rand(8, seed=46))
