"""Gemma's sandwich norm joining the residual stream, h + rms_norm(x) (times Gemma 4's one-value layer
output scale), as one launch of the norm kernel (runtime/kernels_triton/norm.py `add_to`,
`out_scale`; the seam's `add_normed`):

* float32: the kernel's sum and scaled sum are the bits of torch adding the kernel's own norm to h
  and scaling it (the norm itself is tested against the reference in test_cuda_fused_kernels.py);
* bfloat16: within the three roundings of the torch formula (norm, sum, scaled sum), measured
  against the reference backend;
* a row alone gets the bits it gets in a batch of 16;
* through the seam: one launch, the torch formula for float64; the decode step of Gemma 4's MoE
  sibling on `meta` makes one launch per such call where the separate operations made two (five
  with the scale), and nothing else in the step changes (where a product comes before the norm,
  its launch makes the norm instead: tests/runtime/test_cuda_sandwich_tail.py).

Without a GPU the kernel runs in Triton's interpreter (tests/fixtures/triton_mode.py).
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
from tests.fixtures.counted_calls import family_q8_0, fused_against_separate, fused_or_separate  # noqa: E402

REF = TorchBackend()
EPS = 1e-6


def rand(*shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def test_float32_sum_and_scale_are_torch_adding_the_kernels_norm():
    x, h, w = rand(5, 200, seed=1), rand(5, 200, seed=2, scale=3), rand(200, seed=3)
    s = rand(1, seed=4).abs() + 0.5
    normed = kt.rms_norm(x, w, EPS)
    added = kt.rms_norm(x, w, EPS, add_to=h)
    scaled = kt.rms_norm(x, w, EPS, add_to=h, out_scale=s)
    print(f"\n[{WHERE}] float32: h + norm, (h + norm) · s: the bits of torch's add and product")
    assert torch.equal(added.cpu(), (h + normed).cpu())
    assert torch.equal(scaled.cpu(), ((h + normed) * s).cpu())


def test_bfloat16_within_the_formulas_three_roundings():
    bf = torch.bfloat16
    x, h, w = rand(4, 256, seed=5, dtype=bf), rand(4, 256, seed=6, dtype=bf, scale=2), rand(256, seed=7)
    s = torch.tensor([0.75], device=DEVICE)
    y, ref = kt.rms_norm(x, w, EPS, add_to=h, out_scale=s), REF.add_normed(h, x, w, EPS, s)
    # each rounding into bfloat16 moves a value v by ≤ 2^-8 |v| (to nearest) or 2^-7 |v| (the
    # interpreter truncates): the norm n, the sum t = h + n, the scaled sum t · s, on either side
    n = REF.rms_norm(x, w, EPS).float()
    t = h.float() + n
    bound = 1.5 * 2.0 ** -7 * (n.abs() * s + t.abs() * s + ref.float().abs()) + 1e-6
    excess = float(((y.float() - ref.float()).abs() / bound).max())
    print(f"\n[{WHERE}] bf16: max |Δ| {float((y.float() - ref.float()).abs().max()):.2e}, "
          f"{excess:.2f} of the three roundings' bound")
    assert y.dtype == bf and excess <= 1.0


def test_a_row_alone_gets_the_bits_of_a_batch_of_16():
    x, h, w = rand(16, 96, seed=8, dtype=torch.bfloat16), rand(16, 96, seed=9, dtype=torch.bfloat16), rand(96, seed=10)
    s = torch.tensor([1.5], device=DEVICE)
    together = kt.rms_norm(x, w, EPS, add_to=h, out_scale=s)
    for i in (0, 7, 15):
        assert torch.equal(kt.rms_norm(x[i:i + 1], w, EPS, add_to=h[i:i + 1], out_scale=s), together[i:i + 1]), i
    print(f"\n[{WHERE}] rows 0, 7, 15 alone = in a batch of 16, bit for bit")


def test_bad_input_is_a_one_line_error():
    x = rand(2, 8, seed=11)
    with pytest.raises(SpecconvError, match="add_to must be"):
        kt.rms_norm(x, None, EPS, add_to=x.double())
    with pytest.raises(SpecconvError, match="out_scale is one float32 value"):
        kt.rms_norm(x, None, EPS, add_to=x, out_scale=rand(2, seed=12))
    with pytest.raises(SpecconvError, match="add_to goes with neither"):
        kt.rms_norm(x, None, EPS, residual=x, add_to=x)


def test_the_seam_launches_once_and_keeps_the_torch_formula_for_float64(monkeypatch):
    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    x, h, w, s = rand(3, 64, seed=13), rand(3, 64, seed=14), rand(64, seed=15), torch.tensor([0.5], device=DEVICE)
    y = cuda.add_normed(h, x, w, EPS, s)
    assert launched == ["norm_kernel"]
    assert torch.equal(y.cpu(), ((h + kt.rms_norm(x, w, EPS)) * s).cpu())
    launched.clear()
    x64, h64 = x.double(), h.double()
    assert torch.equal(cuda.add_normed(h64, x64, w, EPS, s), REF.add_normed(h64, x64, w, EPS, s)) and launched == []


# add_normed counted, as the CUDA backend runs it or as the separate operations it replaces
CountedSandwich = fused_or_separate("add_normed")


# gemma4-release makes every sandwich norm in the launch of the product before it (linear_add_normed,
# tests/runtime/test_cuda_sandwich_tail.py); the MoE sibling's FFN output is a sum of two branches,
# so its post-FFN norm, add and scale are this launch
@pytest.mark.parametrize("name", ["gemma4-moe-shapes"])
def test_gemma4_sandwich_norms_are_one_launch_each(tmp_path, name):
    blocks, counts = fused_against_separate(family_q8_0(tmp_path, name), CountedSandwich)
    for what, calls, inside, new, old in counts:
        print(f"\n[{name}, meta, bf16] {what}: {old.total} -> {new.total} launches; {calls} sandwich norms, "
              f"{inside} launches as separate operations")
        assert calls >= blocks  # at least one per block
        assert inside >= 2 * calls + 3 * blocks  # add + norm each; the scale's casts and product per block
