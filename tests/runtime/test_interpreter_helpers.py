"""tests/fixtures/interpreter_helpers.py: in Triton's interpreter a kernel's jitted helpers (ours and
Triton's own tl.sum / tl.zeros) run without re-patching the language on every call, and the kernel's
output has the bits of Triton's own path, which re-patches."""

from tests.fixtures import triton_mode  # noqa: F401  (before Triton: the interpreter where there is no GPU)

import pytest
import torch

from tests.fixtures import interpreter_helpers

pytestmark = pytest.mark.skipif(triton_mode.ON_GPU, reason="a property of Triton's CPU interpreter")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CALLS = 4


@triton.jit
def _weighted_sum(x, weight):
    return tl.sum(x * weight, axis=0)


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    i = tl.arange(0, N)
    acc = tl.zeros([N], dtype=tl.float32)
    for r in tl.static_range(CALLS):
        x = tl.load(x_ptr + r * N + i)
        acc += x * _weighted_sum(x, r + 1.0)
    tl.store(out_ptr + i, acc)


def _run(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    out = torch.empty(x.shape[1], dtype=torch.float32)
    before = interpreter_helpers.patches
    _helpers_kernel[(1,)](x, out, N=x.shape[1], CALLS=CALLS)
    return out, interpreter_helpers.patches - before


def test_helpers_skip_the_repatch_and_keep_tritons_bits(monkeypatch):
    x = torch.randn(CALLS, 32, generator=torch.Generator().manual_seed(7))
    fast, fast_patches = _run(x)
    monkeypatch.setattr(interpreter_helpers, "enabled", False)
    slow, slow_patches = _run(x)
    expected = sum(x[r] * (x[r] * (r + 1.0)).sum() for r in range(CALLS))
    print(f"\nlanguage patched {fast_patches} times a launch (Triton's own path: {slow_patches}); "
          f"max |Δ| against torch {(fast - expected).abs().max().item():.1e}")
    assert torch.equal(fast, slow)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)
    # the launch, and tl.sum's first call (its module holds tl.core, which the kernel's does not)
    assert fast_patches <= 2 < 1 + 2 * CALLS <= slow_patches
