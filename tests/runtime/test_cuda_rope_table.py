"""A batch's rope angles, cos and sin in one launch (runtime/kernels_triton/rope.py `rope_table`; the
seam's `rope_table`, ops.rope_table / rope_cos_sin / rope_cos_sin_scaled):

* the angles are the torch formula's float32 bits (position as float32, divided by a linear
  scaling's factor correctly rounded, times θ_i correctly rounded, no fused operation): each cos and
  sin is checked against the float64 cos / sin of those very float32 angles, within 2 ulps (the
  CUDA math library's bound for cosf / sinf) — at positions up to 10⁶, where an angle one ulp off
  moves its cos by far more;
* YaRN's attention factor multiplies both, int32 and int64 positions, odd half widths;
* through the seam: one launch for a rope table of every kind (none, linear, YaRN, DeepSeek's), the
  torch formula for float64 tables, and the frequencies made once per device (a second table
  launches nothing else);
* bad input is a one-line error.

Without a GPU the kernel runs in Triton's interpreter (tests/fixtures/triton_mode.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, WHERE, record_launches  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.archs.rope_scaling import RopeScaling  # noqa: E402
from specconv.runtime import kernels_triton as kt  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.graphs import ops  # noqa: E402

REF = TorchBackend()
ULPS = 2  # cosf / sinf: at most 2 ulps from the exact value (CUDA math library); numpy's are closer


def positions(n: int, seed: int, top: int, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, top, (n,), generator=g).sort().values.to(dtype).to(DEVICE)


def frequencies(half: int, base: float = 10000.0) -> torch.Tensor:
    return ops.rope_inv_freq(2 * half, base, DEVICE, torch.float32)


def ulps_off(y: torch.Tensor, exact: torch.Tensor) -> float:
    """max |y - exact| in float32 ulps of max(|exact|, 2⁻²⁴) (cos and sin near 0 are held to absolute ulps)."""
    mag = exact.abs().clamp_min(2.0 ** -24).float()
    spacing = torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag
    return float(((y.cpu().double() - exact) / spacing.double()).abs().max())


@pytest.mark.parametrize("half,top,divisor,scale", [(64, 1 << 20, None, None), (24, 4096, None, None),
                                                    (32, 1 << 17, 4.0, None), (33, 1 << 20, 3.0, None),
                                                    (16, 1 << 18, None, 1.2079441541679836)])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_table_is_the_float32_formula(half, top, divisor, scale, pos_dtype):
    pos = positions(37, seed=half + top, top=top, dtype=pos_dtype)
    inv = frequencies(half)
    cos, sin = kt.rope_table(pos, inv, divisor, scale)
    # the float32 angles of the torch formula (backend_torch.rope_table), then exact float64 cos / sin
    p = pos.cpu().float()
    angles = ((p / divisor) if divisor is not None else p)[:, None] * inv.cpu()[None, :]
    factor = 1.0 if scale is None else scale
    worst = max(ulps_off(cos, angles.double().cos() * factor), ulps_off(sin, angles.double().sin() * factor))
    print(f"\nrope_table ({WHERE}) half {half}, positions < {top}, divisor {divisor}, scale {scale}: "
          f"worst {worst:.2f} ulps of the exact cos/sin of the float32 angles (bound {ULPS + (scale is not None)})")
    assert cos.shape == sin.shape == (37, half) and cos.dtype == sin.dtype == torch.float32
    assert worst <= ULPS + (scale is not None)  # the factor's product rounds once more
    ref_cos, ref_sin = REF.rope_table(pos, inv, divisor, scale)
    assert torch.allclose(cos, ref_cos, rtol=0, atol=3e-7 * factor) and torch.allclose(sin, ref_sin, rtol=0,
                                                                                       atol=3e-7 * factor)


def test_a_wrong_angle_rounding_is_caught():
    """The check above can fail: angles rounded differently (the quotient taken as a product by the
    reciprocal) are many ulps off at large positions."""
    pos = positions(64, seed=3, top=1 << 20)
    inv = frequencies(64)
    p = pos.cpu().float()
    exact = ((p / 3.0)[:, None] * inv.cpu()[None, :]).double().cos()
    wrong = ((p * (1 / 3.0))[:, None] * inv.cpu()[None, :]).cos()
    assert ulps_off(wrong, exact) > 100


def test_seam_launches_once(cuda_backend, monkeypatch):
    pos = positions(5, seed=1, top=9000)
    yarn = RopeScaling("yarn", 4.0, original_context=4096)
    inv = ops.rope_inv_freq(64, 10000.0, pos.device, torch.float32)
    yarn_inv, attn = ops.yarn_inv_freq(64, 10000.0, yarn, pos.device)  # once per device, then kept
    cases = [(None, (inv, None, None)), (RopeScaling("linear", 2.0), (inv, 2.0, None)),
             (yarn, (yarn_inv, None, attn))]
    for scaling, (freq, divisor, scale) in cases:
        launched = record_launches(monkeypatch)
        cos, sin = ops.rope_cos_sin_scaled(pos, 64, 10000.0, scaling)
        assert launched == ["rope_table_kernel"], (scaling, launched)
        ref_cos, ref_sin = REF.rope_table(pos, freq, divisor, scale)
        assert torch.allclose(cos, ref_cos, rtol=0, atol=4e-7) and torch.allclose(sin, ref_sin, rtol=0, atol=4e-7)
    assert ops.yarn_inv_freq(64, 10000.0, yarn, pos.device)[0] is yarn_inv


def test_float64_tables_keep_the_torch_formula(cuda_backend, monkeypatch):
    pos = positions(6, seed=2, top=5000)
    launched = record_launches(monkeypatch)
    cos, sin = ops.rope_cos_sin(pos, 32, 500000.0, torch.float64)
    assert launched == [] and cos.dtype == torch.float64
    ref_cos, ref_sin = REF.rope_table(pos, ops.rope_inv_freq(32, 500000.0, pos.device, torch.float64))
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_deepseek_frequencies_made_once():
    from specconv.runtime.graphs import deepseek2

    yarn = RopeScaling("yarn", 40.0, original_context=4096, beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0)
    first = deepseek2._inv_freq(64, 10000.0, yarn, DEVICE)
    assert deepseek2._inv_freq(64, 10000.0, yarn, DEVICE) is first
    freq, attn = first
    assert freq.shape == (32,) and freq.dtype == torch.float32 and attn == 1.0
    # transformers' YaRN ramp: the first dimensions keep θ_i, the last are θ_i / factor
    theta = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert math.isclose(float(freq[0]), float(theta[0]), rel_tol=1e-6)
    assert math.isclose(float(freq[-1]), float(theta[-1]) / 40.0, rel_tol=1e-6)


@pytest.mark.parametrize("bad", ["float_positions", "matrix_positions", "f64_inv", "zero_divisor"])
def test_bad_input(bad):
    pos, inv, divisor = positions(4, seed=5, top=100), frequencies(8), None
    if bad == "float_positions":
        pos = pos.float()
    elif bad == "matrix_positions":
        pos = pos[None]
    elif bad == "f64_inv":
        inv = inv.double()
    else:
        divisor = 0.0
    with pytest.raises(SpecconvError, match="rope_table"):
        kt.rope_table(pos, inv, divisor)
