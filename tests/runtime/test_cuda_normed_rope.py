"""A per-head q or k RMS norm and the rotary embedding after it in one launch of the rope kernel
(runtime/kernels_triton/rope.py `norm_weight`; the seam's `normed_rope`, ops.normed_rope_neox):

* float32: within a few ulps of the torch formula (rms_norm, then rope), for partial and whole
  rotation, NEOX and NORM pairs, heads read through their strides;
* bfloat16: within the formula's two roundings (the norm, the rotation);
* a row alone gets the bits it gets in a batch of 16;
* through the seam: one launch; without a weight the rotation alone (the families whose q or k has no
  norm); float64 keeps the torch formula;
* every family with q / k norms (Qwen3, Qwen3.5, GLM-4.5's optional ones, Gemma 4, Step-3.5, Hy3)
  makes one launch per such call where the norm and the rope made two, and nothing else in its
  step changes.

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
from tests.fixtures.counted_calls import CountedCalls, family_q8_0, fused_against_separate  # noqa: E402

REF = TorchBackend()
EPS = 1e-6
# float32: the norm rounds five times on each side and sums its squares in another order, the
# rotation twice more: two correct evaluations differ by a few ulps of the result's magnitude
# (measured worst printed); a wrong formula or a lost term is off by thousands
ULPS = 16


def rand(*shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def spacing_units(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> float:
    """max |y - ref| in float32 ulps of `magnitude` (a rotated value can cancel to near 0, so the
    error is measured against the size of the terms, not of the result)."""
    mag = magnitude.detach().cpu().float().abs()
    spacing = torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag
    return float(((y.detach().cpu().float() - ref.detach().cpu().float()).abs() / spacing).max())


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("rotated", [8, 32])
def test_float32_within_a_few_ulps_of_norm_then_rope(style, rotated):
    """Heads of 32 (all or a quarter rotated), q a strided view of an interleaved q|gate projection."""
    x = rand(3, 4, 64, seed=1, scale=2)[..., :32]
    w = rand(32, seed=2, scale=0.5) + 1
    cos, sin = rand(3, rotated // 2, seed=3), rand(3, rotated // 2, seed=4)
    y = kt.rope(x, cos, sin, style, norm_weight=w, eps=EPS)
    ref = REF.normed_rope(x, w, EPS, cos, sin, style)
    # the size of the terms: |normed values| (≥ the rotated pair's largest)
    normed = REF.rms_norm(x, w, EPS)
    scale = normed.abs().amax(-1, keepdim=True).expand_as(normed)
    units = spacing_units(y, ref, scale)
    print(f"\n[{WHERE}] normed rope {style}, {rotated} of 32 rotated: max |Δ| "
          f"{float((y - ref).abs().max()):.2e} ({units:.1f} ulps of the head's largest value)")
    assert y.dtype == torch.float32 and units <= ULPS


def test_bfloat16_within_the_formulas_two_roundings():
    bf = torch.bfloat16
    x, w = rand(5, 3, 64, seed=5, dtype=bf), rand(64, seed=6) + 1
    cos, sin = rand(5, 16, seed=7), rand(5, 16, seed=8)
    y, ref = kt.rope(x, cos, sin, "neox", norm_weight=w, eps=EPS), REF.normed_rope(x, w, EPS, cos, sin, "neox")
    # each rounding into bfloat16 moves a value v by ≤ 2^-8 |v| (to nearest) or 2^-7 |v| (the
    # interpreter truncates): the normed values (the rotation's inputs, |cos|, |sin| ≤ their
    # magnitude's factor), then the result, on either side
    normed = REF.rms_norm(x, w, EPS).float()
    c, s = cos.abs().max(), sin.abs().max()
    bound = 1.5 * 2.0 ** -7 * (normed.abs().amax(-1, keepdim=True) * (c + s) + ref.float().abs()) + 1e-6
    excess = float(((y.float() - ref.float()).abs() / bound).max())
    print(f"\n[{WHERE}] normed rope bf16: max |Δ| {float((y.float() - ref.float()).abs().max()):.2e}, "
          f"{excess:.2f} of the two roundings' bound")
    assert y.dtype == bf and excess <= 1.0


def test_a_row_alone_gets_the_bits_of_a_batch_of_16():
    x, w = rand(16, 4, 64, seed=9, dtype=torch.bfloat16), rand(64, seed=10)
    cos, sin = rand(16, 16, seed=11), rand(16, 16, seed=12)
    together = kt.rope(x, cos, sin, "neox", norm_weight=w, eps=EPS)
    for i in (0, 5, 15):
        alone = kt.rope(x[i:i + 1], cos[i:i + 1], sin[i:i + 1], "neox", norm_weight=w, eps=EPS)
        assert torch.equal(alone, together[i:i + 1]), i
    print(f"\n[{WHERE}] rows 0, 5, 15 alone = in a batch of 16, bit for bit")


def test_bad_input_is_a_one_line_error():
    x, cos = rand(2, 1, 8, seed=13), rand(2, 2, seed=14)
    with pytest.raises(SpecconvError, match="rope: norm_weight has shape"):
        kt.rope(x, cos, cos, "neox", norm_weight=rand(7, seed=15))
    with pytest.raises(SpecconvError, match="rope: norm_weight must be float"):
        kt.rope(x, cos, cos, "neox", norm_weight=torch.ones(8, dtype=torch.int32, device=DEVICE))


def test_the_seam_launches_once_rotates_alone_without_a_weight_and_keeps_float64(monkeypatch):
    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    x, w = rand(2, 3, 16, seed=16), rand(16, seed=17)
    cos, sin = rand(2, 4, seed=18), rand(2, 4, seed=19)
    y = cuda.normed_rope(x, w, EPS, cos, sin, "neox")
    assert launched == ["rope_kernel"]
    assert torch.equal(y, kt.rope(x, cos, sin, "neox", norm_weight=w, eps=EPS))
    launched.clear()
    assert torch.equal(cuda.normed_rope(x, None, EPS, cos, sin, "norm"), kt.rope(x, cos, sin, "norm"))
    assert launched == ["rope_kernel", "rope_kernel"]
    assert not torch.equal(y, kt.rope(x, cos, sin, "neox"))  # the norm is not skipped when given
    launched.clear()
    x64 = x.double()
    assert torch.equal(cuda.normed_rope(x64, w, EPS, cos, sin, "neox"), REF.normed_rope(x64, w, EPS, cos, sin, "neox"))
    assert launched == []


class CountedNormedRope(CudaBackend, CountedCalls):
    """The CUDA backend (launches recorded on `meta`) counting the calls of normed_rope that norm
    (with a weight) and the launches inside them; with `separate`, running them as the torch formula
    (the norm kernel, then the rope kernel) the graphs ran before."""

    def __init__(self, separate: bool):
        super().__init__(kt, device_types=("meta",))
        self.separate = separate
        self.init_counts()

    def normed_rope(self, x, weight, eps, cos, sin, style):
        form = TorchBackend.normed_rope if self.separate else CudaBackend.normed_rope
        if weight is None:
            return form(self, x, weight, eps, cos, sin, style)
        return self.counted(lambda: form(self, x, weight, eps, cos, sin, style))


@pytest.mark.parametrize("name", ["qwen3-release", "glm4moe-release", "gemma4-release", "chained-step35",
                                  "chained-hy_v3"])
def test_families_norm_and_rotate_q_and_k_in_one_launch_each(tmp_path, name):
    blocks, counts = fused_against_separate(family_q8_0(tmp_path, name), CountedNormedRope)
    for what, calls, inside, new, old in counts:
        print(f"\n[{name}, meta, bf16] {what}: {old.total} -> {new.total} launches; {calls} normed ropes, "
              f"{inside} launches as separate operations")
        assert calls >= 1 and inside == 2 * calls
