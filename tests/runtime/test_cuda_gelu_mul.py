"""GeGLU's product in one launch (runtime/kernels_triton/activation.py `gelu_mul`) against the torch
reference TorchBackend.gelu_mul, F.gelu(gate, approximate="tanh") · up, which the CPU runs:

* float32: within a few ulps of the reference where its 1 + tanh(·) does not cancel (gate ≥ −1),
  and everywhere within the error that rounding the tanh argument in float32 allows, of the exact
  value x · σ(2·inner) computed in float64 (the same function without the cancellation);
* bfloat16 in and out: within the two roundings into bfloat16 of each side (gelu, then the product);
* batch invariance: a row alone gives the bits it gets in a batch of 16;
* the seam: CudaBackend.gelu_mul (and glu) reach the kernel (float64 keeps the torch formula);
  Gemma 4's GeGLU launches none, its down product computing gelu_tanh(gate) · up itself
  (tests/runtime/test_cuda_glu_product.py).

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before Triton is
imported by the module below); with one the same tests run the compiled kernel on CUDA.
"""

from __future__ import annotations

import torch

from tests.runtime.test_cuda_fused_kernels import DEVICE, ULPS, WHERE, rand, ulps, within_bf16_rounding

from specconv.runtime import kernels_triton as kt  # noqa: E402  (after the interpreter is chosen)
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402

REF = TorchBackend()
BETA, KAPPA = 0.7978845608028654, 0.044715  # √(2/π), the cubic term's coefficient


def exact(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu_tanh(gate) · up in float64, the tanh argument 'inner'): 0.5·x·(1 + tanh(inner)) written
    x · σ(2·inner), equal to it, without cancellation where x is negative."""
    x = gate.double().cpu()
    inner = BETA * (x + KAPPA * x ** 3)
    return x * torch.sigmoid(2 * inner) * up.double().cpu(), inner


def test_gelu_mul_float32():
    gate = torch.cat([torch.linspace(-12, 12, 3000, device=DEVICE), rand(1500, seed=40, scale=4)]).reshape(3, 1500)
    up = rand(3, 1500, seed=41)
    y, ref = kt.gelu_mul(gate, up), REF.gelu_mul(gate, up)
    calm = gate >= -1  # 1 + tanh(inner) ≥ 0.32: the reference's float32 formula is accurate there
    near_ref = ulps(y[calm], ref[calm])
    # rounding the argument of exp / tanh (x³, κ·, +, β·, 2·: ~3 ulps of |2·inner|) moves the value by
    # that many ulps times |2·inner|; 4 ulps for exp, the division and the product; results under
    # |gate| times float32's smallest normal number (gate ≲ −10: exp(−2·inner) overflows) are lost
    want, inner = exact(gate, up)
    mag = want.float().abs()
    spacing = (torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag).double()
    underflow = torch.finfo(torch.float32).tiny * (gate * up).double().abs().cpu()
    allowed = (4 + 3 * (2 * inner).abs()) * spacing + underflow
    diff = (y.double().cpu() - want).abs()
    torch_diff = (ref.double().cpu() - want).abs()
    print(f"\n[{WHERE}] gelu_tanh(gate) · up: {near_ref:.1f} ulps from the reference where gate ≥ -1; "
          f"everywhere {float((diff / allowed).max()):.2f} of the allowed error from the exact value "
          f"(the float32 reference: {float((torch_diff / allowed).max()):.0f})")
    assert near_ref <= ULPS
    assert bool((diff <= allowed).all())


def test_gelu_mul_bfloat16_within_two_roundings():
    bf = torch.bfloat16
    gate = rand(4, 256, seed=42, scale=3).clamp(min=-4).to(bf)  # where the reference keeps 1e-3 relative
    up = rand(4, 256, seed=43, dtype=bf)
    y, ref = kt.gelu_mul(gate, up), REF.gelu_mul(gate, up)
    worst = within_bf16_rounding(y, ref)
    changed = int((y != ref).sum())
    print(f"\n[{WHERE}] gelu_mul bf16: max |Δ| {float((y.float() - ref.float()).abs().max()):.2e} "
          f"({worst:.2f} × 2^-7 |ref|, bound 3); {changed} of {ref.numel()} values differ")
    assert y.dtype == bf and worst <= 1.5 * 2


def test_gelu_mul_rows_alone_equal_a_batch_of_16():
    gate, up = rand(16, 300, seed=44, scale=3), rand(16, 300, seed=45)
    for dtype in (torch.float32, torch.bfloat16):
        g, u = gate.to(dtype), up.to(dtype)
        together = kt.gelu_mul(g, u)
        for i in (0, 9, 15):
            assert torch.equal(kt.gelu_mul(g[i:i + 1], u[i:i + 1]), together[i:i + 1]), (dtype, i)
    print(f"\n[{WHERE}] gelu_mul: rows 0, 9, 15 alone = in a batch of 16, bit for bit (f32, bf16)")


def test_the_backend_reaches_the_kernel_and_gemma4s_geglu_its_product(monkeypatch):
    """CudaBackend.glu (the halves of a fused gate/up product: strided views) launches the kernel once,
    gemma4.geglu not at all (its down product reads the GLU); float64 keeps the
    torch formula, with its bits."""
    from specconv.runtime import backend as backend_module
    from specconv.runtime.graphs import gemma4

    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    monkeypatch.setattr(backend_module, "_backend", lambda kind: cuda)
    launches = []
    real = kt.gelu_mul
    monkeypatch.setattr(kt, "gelu_mul", lambda g, u: launches.append(g.shape) or real(g, u))
    both = rand(5, 2 * 96, seed=46, scale=2)
    y = cuda.glu(both[:, :96], both[:, 96:], "gelu_tanh")
    assert launches == [(5, 96)] and torch.equal(y, real(both[:, :96].contiguous(), both[:, 96:].contiguous()))
    x, gate, up, down = rand(3, 32, seed=47), rand(64, 32, seed=48), rand(64, 32, seed=49), rand(32, 64, seed=50)
    out = gemma4.geglu(x, gate, up, down)
    assert len(launches) == 1
    want = REF.linear(REF.gelu_mul(REF.linear(x, gate), REF.linear(x, up)), down)
    print(f"\n[{WHERE}] gemma4.geglu through the CUDA backend: max |Δ| {float((out - want).abs().max()):.2e}")
    assert float((out - want).abs().max()) < 1e-4
    wide = both.double()
    got = cuda.glu(wide[:, :96], wide[:, 96:], "gelu_tanh")
    assert len(launches) == 1 and torch.equal(got, REF.gelu_mul(wide[:, :96], wide[:, 96:]))
