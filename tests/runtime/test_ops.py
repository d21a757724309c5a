"""Building blocks of the graphs (runtime/graphs/ops.py) against their formulas written out in torch."""

from __future__ import annotations

import pytest
import torch

from specconv.runtime.graphs import ops

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rms_norm_is_the_formula_bit_for_bit(dtype):
    """x · (mean(x²) + ε)^(-1/2) ⊙ w in the accumulation dtype, the result in x's dtype."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 1024), (4, 1024), (7, 16, 128), (3, 8, 256), (5, 2049)]:
        x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
        w = torch.randn(shape[-1], generator=gen)
        xf = x.double() if dtype == torch.float64 else x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.equal(ops.rms_norm(x, w, 1e-6), (y * w.to(xf.dtype)).to(dtype))
        assert torch.equal(ops.rms_norm(x, None, 1e-6), y.to(dtype))


def test_grouped_query_attention_equals_repeated_heads():
    """Query head j reads KV head j // (nh / nkv): the grouped form against K and V repeated per
    query head, with the position mask (a key is visible iff its position ≤ the query's)."""
    gen = torch.Generator().manual_seed(1)
    n, t, nh, nkv, hd = 4, 23, 8, 2, 32
    q, k, v = (torch.randn(*s, generator=gen) for s in ((n, nh, hd), (t, nkv, hd), (t, nkv, hd)))
    q_pos, k_pos = torch.arange(t - n, t), torch.arange(t)
    kr, vr = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), kr.double()) * 0.17
    scores = scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None])[None], float("-inf"))
    ref = torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), vr.double())
    got = ops.causal_attention(q, k, v, q_pos, k_pos, 0.17)
    assert got.shape == (n, nh, hd)
    assert (got.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_tables_are_the_formula_bit_for_bit_with_the_frequencies_made_once(dtype):
    """cos/sin of positions · θ_i, θ_i = base^(-2i/d) rounded to float32, written out here; the
    frequencies are one tensor per (d, base, device, dtype), made outside inference mode so a forward
    inside torch.inference_mode and one outside it can both use it."""
    positions = torch.tensor([0, 1, 7, 4095, 131071])
    for d, base in [(64, 10000.0), (128, 1e6), (32, 500000)]:
        theta = (1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))).to(dtype)
        angles = positions.to(dtype)[:, None] * theta[None, :]
        with torch.inference_mode():
            cos, sin = ops.rope_cos_sin(positions, d, base, dtype)
        assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
        made = ops.rope_inv_freq(d, float(base), positions.device, dtype)
        assert made is ops.rope_inv_freq(d, float(base), positions.device, dtype)
        assert not made.is_inference()
        cos2, _ = ops.rope_cos_sin(positions, d, base, dtype)  # outside inference mode: the same tensor serves
        assert torch.equal(cos2, cos)
