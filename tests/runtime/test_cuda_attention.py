"""The one-launch attention kernel and K/V write (runtime/kernels_triton/attention.py) against the torch
formulas: runtime/graphs/ops.py `causal_attention` (what TorchBackend.attention and the CPU run) and
TorchBackend.write_kv's index_copy_:

* float32: every output within an error bound derived from float32 rounding (`rounding_bound`),
  for GQA ratios 1/2/4/8, head dimensions 64 to 512, unwritten cells, partly filled buffers and
  1 to 16 query rows; the output gate fused (per value, Qwen3.5; per head, Step-3.5); sliding
  windows (1, inside a block, across blocks, wider than the context) and attention sinks against
  ops.windowed_attention, the formula of the graphs with windows and sinks;
* bfloat16: within the roundings into bfloat16 of each side's float32 result;
* batch invariance: a row alone gives the bits it gets in a batch of 16;
* write_kv: the caches afterwards equal index_copy_'s bit for bit;
* the seam: ops.cached_attention reaches the kernels through CudaBackend.attention and .write_kv
  (one launch each per layer instead of the formulas' operations, with the K/V store apart from
  the rope: counted on the `meta` device by benchmarks/cuda_op_count.py), falls back to the formula where the kernel does not apply, and
  greedy speculative decoding in bfloat16 equals plain decoding with the kernel.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
tests/fixtures/triton_mode.py before Triton compiles a kernel); with one (and TRITON_INTERPRET unset) the same tests run the compiled kernel on CUDA.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, WHERE  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from benchmarks import cuda_op_count  # noqa: E402
from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import backend as backend_module, kernels_triton as kt  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.graphs import ops  # noqa: E402
from specconv.runtime.kernels_triton.attention import block_cells  # noqa: E402
from specconv.runtime.memory import UNWRITTEN  # noqa: E402
from tests.fixtures.counted_calls import CountedCalls  # noqa: E402
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf  # noqa: E402

EPS32 = 2.0 ** -24  # float32's unit roundoff
BF16_STEP = 2.0 ** -7  # a rounding into bfloat16 moves x by at most this · |x| (truncation: the interpreter)


def rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g)


def case(n: int, heads: int, kv_heads: int, head_dim: int, cells: int, written: int, seed: int,
         scattered: bool = False, dv: int | None = None):
    """q [n, heads, hd], the K/V buffers [cells, kv_heads, hd] with `written` cells at positions
    0..written-1 (the others UNWRITTEN and holding large junk that must not leak in), and the query
    rows at the last n positions. `scattered`: the written cells spread over the buffer in a random
    order (a buffer after rollbacks and rewrites), else its first cells."""
    dv = head_dim if dv is None else dv
    q = rand(n, heads, head_dim, seed=seed)
    k = rand(cells, kv_heads, head_dim, seed=seed + 1)
    v = rand(cells, kv_heads, dv, seed=seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    slots = torch.randperm(cells, generator=g)[:written] if scattered else torch.arange(written)
    k_pos = torch.full((cells,), UNWRITTEN, dtype=torch.long)
    k_pos[slots] = torch.arange(written)
    junk = torch.ones(cells, dtype=torch.bool)
    junk[slots] = False
    k[junk], v[junk] = 1e4, -1e4
    q_pos = torch.arange(written - n, written)
    return q, k, v, q_pos, k_pos


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def rounding_bound(q, k, v, q_pos, k_pos, scale: float, head_dim: int, window: int = 0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A bound on |kernel - reference| per output [n, heads, dv] for float32 inputs (first order in ε).

    Both sides compute o = Σ_t p_t v_t with p = softmax(s), s_t = (q·k_t)·scale over the visible
    cells; against the exact result each errs by at most E·ε·Σ_t p_t |v_t|, with E the sum of:
    * the scores: a dot product of hd float32 products, then the scale, shifts s_t by up to
      ε·(hd·scale·Σ_d |q_d k_td| + |s_t|); exp turns a shift into a relative error of p_t, and the
      normalisation by Σ p adds the largest one: 2·S, S the largest shift / ε;
    * exp: at most 2 ulps, plus the argument's rounding when exp goes through 2^x (a GPU): ·|s_t − m|,
      so X = 2 + 2·max |s_t − m|; the reference's one exp per cell: 2·X; the kernel's, with the
      rescaling factors of its online softmax (exp(m_old − m_new), at most one per block, applied to
      the running sum and output alike, so only their product over the blocks counts; with several
      pieces one per later block of the cell's piece and the combine's one: still at most one per
      block): 2·(1 + blocks)·X;
    * the sums of T visible terms (Σ p, Σ p·v: (T − 1)·ε each, in any order) and the final division
      or the softmax's: 2·T + 2 per side.
    The two sides' bounds add (triangle inequality). A `window` hides the cells it hides on both
    sides; `sinks` [heads] (one more logit per head, exact, with no value) count as one more score
    in m, the spread and T, and shrink every p_t by the sink's share."""
    qd, kd, vd = q.double(), k.double(), v.double()
    n, heads, _ = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    kh = kd.repeat_interleave(group, dim=1)  # [cells, heads, hd]
    vh = vd.repeat_interleave(group, dim=1)
    dist = q_pos[:, None] - k_pos[None, :]
    visible = (dist >= 0) & (dist < window) if window > 0 else dist >= 0  # [n, cells]
    s = torch.einsum("nhd,thd->nht", qd, kh) * scale
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    sink = None if sinks is None else sinks.double()[None, :, None].expand(n, heads, 1)
    p = torch.softmax(s if sink is None else torch.cat([s, sink], -1), dim=-1)[..., :s.shape[-1]]
    mag = torch.einsum("nhd,thd->nht", qd.abs(), kh.abs()) * scale
    shift = (head_dim * mag + s.abs()).masked_fill(~visible[:, None, :], 0).amax(-1)  # S per row, head
    m = s.amax(-1, keepdim=True) if sink is None else torch.maximum(s.amax(-1, keepdim=True), sink)
    spread = (m - s).masked_fill(~visible[:, None, :], 0).amax(-1)
    if sink is not None:
        spread = torch.maximum(spread, (m - sink)[..., 0])
    x = 2 + 2 * spread
    cells_seen = visible.sum(-1).double()[:, None] + (sinks is not None)  # T per row
    blocks = math.ceil(k.shape[0] / block_cells(max(k.shape[-1], v.shape[-1])))
    e = 2 * (2 * shift) + 2 * x + 2 * (1 + blocks) * x + 2 * (2 * cells_seen + 2)
    weight = torch.einsum("nht,thd->nhd", p, vh.abs())  # Σ_t p_t |v_t|
    return e[..., None] * EPS32 * weight


def check_float32(q, k, v, q_pos, k_pos, scale, label: str, gate=None, window: int = 0, sinks=None):
    """The kernel against the torch formula the CPU runs: ops.causal_attention, or with a window or
    sinks ops.windowed_attention (the sliding-window graphs')."""
    got = kt.attention(*on_device(q, k, v, q_pos, k_pos), scale, gate=None if gate is None else gate.to(DEVICE),
                       window=window, sinks=None if sinks is None else sinks.to(DEVICE))
    if window or sinks is not None:
        ref = ops.windowed_attention(q, k, v, q_pos, k_pos, scale, window, sinks)
    else:
        ref = ops.causal_attention(q, k, v, q_pos, k_pos, scale)
    bound = rounding_bound(q, k, v, q_pos, k_pos, scale, q.shape[-1], window, sinks)
    if gate is not None:  # o · σ(g): the reference's σ and product round once more each (σ ≤ 1)
        sig = torch.sigmoid(gate) if gate.dim() == 3 else torch.sigmoid(gate)[..., None]  # per value / head
        ref = ops.sigmoid_gated(ref, gate)
        bound = bound * sig.double() + 4 * EPS32 * ref.abs().double()
    diff = (got.cpu().double() - ref.double()).abs()
    print(f"\n[{WHERE}, f32] {label}: max |Δ| {float(diff.max()):.2e}, at most "
          f"{float((diff / bound).max()):.3f} of the derived bound")
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert bool((diff <= bound).all()), label
    return got


# ---- float32 against the torch formula -----------------------------------------------------------

@pytest.mark.parametrize("kv_heads, heads", [(4, 4), (2, 4), (2, 8), (1, 8)], ids=["mha", "gqa2", "gqa4", "gqa8"])
def test_float32_within_the_rounding_bound_for_every_gqa_ratio(heads, kv_heads):
    q, k, v, q_pos, k_pos = case(3, heads, kv_heads, 64, cells=150, written=120, seed=heads * 10 + kv_heads)
    check_float32(q, k, v, q_pos, k_pos, 64 ** -0.5, f"heads {heads} / {kv_heads} KV")


@pytest.mark.parametrize("head_dim", [80, 128, 256, 512])
def test_float32_head_dims(head_dim):
    q, k, v, q_pos, k_pos = case(2, 4, 2, head_dim, cells=70, written=50, seed=head_dim, scattered=True)
    check_float32(q, k, v, q_pos, k_pos, head_dim ** -0.5, f"head_dim {head_dim}, scattered cells")


def test_float32_value_heads_narrower_than_key_heads_and_large_scores():
    q, k, v, q_pos, k_pos = case(2, 4, 1, 96, cells=90, written=90, seed=7, dv=64)
    check_float32(3 * q, k, v, q_pos, k_pos, 96 ** -0.5, "dk 96, dv 64, scores up to ~30")


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_float32_partly_filled_buffer_with_n_rows_and_the_gate(n):
    """The last n of `written` positions attend to a buffer whose tail was never written: each row
    sees a different number of cells (causal within the batch), the unwritten junk never."""
    q, k, v, q_pos, k_pos = case(n, 4, 2, 64, cells=100, written=40, seed=n)
    gate = rand(n, 4, 64, seed=n + 50)
    check_float32(q, k, v, q_pos, k_pos, 0.125, f"n = {n}, 40 of 100 cells written")
    check_float32(q, k, v, q_pos, k_pos, 0.125, f"n = {n}, gated", gate=gate)


# ---- sliding windows and attention sinks --------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 7, 64, 1000], ids=["w1", "w7", "w64", "w-over-context"])
def test_float32_sliding_window(window):
    """Keys with 0 ≤ q_pos − k_pos < window, in scattered cells: window 1 (each row its own cell), a
    window inside a block, one over several blocks, and one wider than the context (= no window)."""
    q, k, v, q_pos, k_pos = case(5, 4, 2, 64, cells=150, written=120, seed=80 + window, scattered=True)
    got = check_float32(q, k, v, q_pos, k_pos, 0.125, f"window {window}", window=window)
    if window == 1:  # one visible cell: softmax 1, the output that cell's value
        mine = k_pos[None, :] == q_pos[:, None]
        own = torch.stack([v[mine[r].nonzero()[0, 0]].repeat_interleave(2, dim=0) for r in range(5)])
        assert torch.equal(got.cpu(), own)
    if window == 1000:
        assert torch.equal(got, kt.attention(*on_device(q, k, v, q_pos, k_pos), 0.125))


@pytest.mark.parametrize("sink_scale", [0.5, 4.0], ids=["small-sinks", "dominant-sinks"])
def test_float32_attention_sinks(sink_scale):
    """One more logit per head (MiMo-V2's attn_sinks) in the softmax's max and denominator, its mass
    dropped; large sinks take most of the mass."""
    q, k, v, q_pos, k_pos = case(4, 8, 2, 128, cells=100, written=70, seed=90)
    sinks = rand(8, seed=91, scale=sink_scale) + sink_scale
    check_float32(q, k, v, q_pos, k_pos, 128 ** -0.5, f"sinks ~{sink_scale}", sinks=sinks)


@pytest.mark.parametrize("window", [1, 16], ids=["w1", "w16"])
def test_float32_window_sinks_and_gate_together(window):
    q, k, v, q_pos, k_pos = case(6, 4, 1, 96, cells=120, written=90, seed=95 + window, scattered=True, dv=64)
    sinks = rand(4, seed=96)
    gate = rand(6, 4, 64, seed=97)
    check_float32(q, k, v, q_pos, k_pos, 96 ** -0.5, f"window {window} + sinks + gate", gate=gate, window=window,
                  sinks=sinks)


def test_float32_per_head_gate_with_a_window():
    """Step-3.5's head-wise gate: one sigmoid per head, the product in float32, one rounding."""
    q, k, v, q_pos, k_pos = case(5, 6, 2, 128, cells=64, written=50, seed=99)
    check_float32(q, k, v, q_pos, k_pos, 128 ** -0.5, "window 8 + a gate per head", gate=rand(5, 6, seed=100),
                  window=8)


def test_the_bound_sees_a_window_one_cell_off():
    """The bound is tight enough to tell window w from w ± 1 (one cell more or less per row)."""
    q, k, v, q_pos, k_pos = case(3, 4, 2, 64, cells=150, written=120, seed=98)
    ref = ops.windowed_attention(q, k, v, q_pos, k_pos, 0.125, 20)
    bound = rounding_bound(q, k, v, q_pos, k_pos, 0.125, 64, window=20)
    for other in (19, 21):
        diff = (ops.windowed_attention(q, k, v, q_pos, k_pos, 0.125, other).double() - ref.double()).abs()
        print(f"\nwindow {other} for 20: max |Δ| {float(diff.max()):.2e}, "
              f"{float((diff / bound).max()):.0f}× the bound")
        assert bool((diff > bound).any()), other


def test_the_bound_catches_one_lost_cell():
    """The derived bound is tight enough to see a kernel that drops one visible cell of 120 (or
    reads one cell too many): the reference without it differs by more than the bound allows."""
    q, k, v, q_pos, k_pos = case(3, 4, 2, 64, cells=150, written=120, seed=42)
    ref = ops.causal_attention(q, k, v, q_pos, k_pos, 0.125)
    bound = rounding_bound(q, k, v, q_pos, k_pos, 0.125, 64)
    for cell in (0, 60, 117):
        lost = k_pos.clone()
        lost[cell] = UNWRITTEN
        diff = (ops.causal_attention(q, k, v, q_pos, lost, 0.125).double() - ref.double()).abs()
        print(f"\ncell {cell} lost: max |Δ| {float(diff.max()):.2e}, {float((diff / bound).max()):.0f}× the bound")
        assert bool((diff > bound).any()), cell


def test_unwritten_cells_are_masked_like_absent_ones():
    """The whole buffer with junk in its unwritten cells gives what the written cells alone give."""
    q, k, v, q_pos, k_pos = case(4, 8, 2, 64, cells=128, written=77, seed=11, scattered=True)
    whole = kt.attention(*on_device(q, k, v, q_pos, k_pos), 0.125).cpu()
    kept = k_pos != UNWRITTEN
    written = ops.causal_attention(q, k[kept], v[kept], q_pos, k_pos[kept], 0.125)
    bound = rounding_bound(q, k[kept], v[kept], q_pos, k_pos[kept], 0.125, 64)
    diff = (whole.double() - written.double()).abs()
    print(f"\n[{WHERE}, f32] 77 written of 128 cells (junk ±1e4 elsewhere) vs the 77 alone: "
          f"max |Δ| {float(diff.max()):.2e}")
    assert bool(torch.isfinite(whole).all()) and bool((diff <= 2 * bound).all())


# ---- bfloat16 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("gated, window, with_sinks", [(False, 0, False), (True, 0, False), (False, 20, True)],
                         ids=["plain", "gated", "window-sinks"])
def test_bfloat16_within_rounding_of_the_float32_results(gated, window, with_sinks):
    """Both sides compute in float32 from the same bfloat16 values and round the result (with the
    gate: o, σ and their product) into bfloat16: they differ by the float32 difference (bounded
    above) plus one rounding of each side per rounded value."""
    q, k, v, q_pos, k_pos = (t.bfloat16() if t.is_floating_point() else t
                             for t in case(6, 8, 2, 128, cells=80, written=60, seed=21))
    gate = rand(6, 8, 128, seed=22).bfloat16() if gated else None
    sinks = rand(8, seed=23) if with_sinks else None
    windowed = dict(window=window, sinks=sinks) if window or with_sinks else {}
    got = kt.attention(*on_device(q, k, v, q_pos, k_pos), 128 ** -0.5, gate=None if gate is None else gate.to(DEVICE),
                       window=window, sinks=None if sinks is None else sinks.to(DEVICE))
    ref = TorchBackend().attention(q, k, v, q_pos, k_pos, 128 ** -0.5, gate, **windowed)
    wide = [t.float() for t in (q, k, v)]
    o32 = ops.windowed_attention(*wide, q_pos, k_pos, 128 ** -0.5, window, sinks)
    f32 = rounding_bound(*wide, q_pos, k_pos, 128 ** -0.5, 128, window, sinks)
    size = o32.abs().double()
    if gated:
        sig = torch.sigmoid(gate.float()).double()
        size, f32 = size * sig, f32 * sig + 4 * EPS32 * size
    roundings = 3 if gated else 1
    bound = f32 + roundings * 2 * BF16_STEP * size * (1 + BF16_STEP) ** roundings
    diff = (got.cpu().double() - ref.double()).abs()
    changed = int((got.cpu() != ref).sum())
    label = ", gated" * gated + ", window + sinks" * bool(windowed)
    print(f"\n[{WHERE}, bf16{label}] max |Δ| {float(diff.max()):.2e} "
          f"({float((diff / bound).max()):.2f} of the bound); {changed} of {ref.numel()} values differ")
    assert got.dtype == torch.bfloat16 and bool((diff <= bound).all())


# ---- batch invariance -------------------------------------------------------------------------------

@pytest.mark.parametrize("window, with_sinks", [(0, False), (9, True)], ids=["causal", "window-sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_row_alone_gives_its_bits_in_a_batch_of_16(dtype, window, with_sinks):
    q, k, v, q_pos, k_pos = case(16, 8, 2, 128, cells=96, written=70, seed=31, scattered=True)
    gate = rand(16, 8, 128, seed=32) if not with_sinks else rand(16, 8, seed=32)  # per value / per head
    sinks = rand(8, seed=33).to(DEVICE) if with_sinks else None
    q, k, v, gate = (t.to(dtype).to(DEVICE) for t in (q, k, v, gate))
    q_pos, k_pos = q_pos.to(DEVICE), k_pos.to(DEVICE)
    batch = kt.attention(q, k, v, q_pos, k_pos, 0.09, gate=gate, window=window, sinks=sinks)
    for i in (0, 7, 15):
        alone = kt.attention(q[i:i + 1].clone(), k, v, q_pos[i:i + 1].clone(), k_pos, 0.09,
                             gate=gate[i:i + 1].clone(), window=window, sinks=sinks)
        assert torch.equal(alone, batch[i:i + 1]), f"row {i}"
    print(f"\n[{WHERE}, {dtype}, window {window}, sinks {with_sinks}, gate {tuple(gate.shape[1:])}] rows 0, 7, "
          f"15 alone: the bits of the batch of 16")


# ---- bad input --------------------------------------------------------------------------------------

def test_bad_input_is_a_one_line_error():
    q, k, v, q_pos, k_pos = on_device(*case(2, 6, 4, 64, cells=20, written=10, seed=1))
    with pytest.raises(SpecconvError, match="do not share"):
        kt.attention(q, k, v, q_pos, k_pos, 0.1)
    q, k, v, q_pos, k_pos = on_device(*case(2, 4, 2, 64, cells=20, written=10, seed=1))
    with pytest.raises(SpecconvError, match="k_pos"):
        kt.attention(q, k, v, q_pos, k_pos[:5], 0.1)
    with pytest.raises(SpecconvError, match="int32 or int64"):
        kt.attention(q, k, v, q_pos.float(), k_pos, 0.1)
    with pytest.raises(SpecconvError, match="gate"):
        kt.attention(q, k, v, q_pos, k_pos, 0.1, gate=q[:, :, :32])
    with pytest.raises(SpecconvError, match="window"):
        kt.attention(q, k, v, q_pos, k_pos, 0.1, window=-1)
    with pytest.raises(SpecconvError, match="sinks"):
        kt.attention(q, k, v, q_pos, k_pos, 0.1, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(SpecconvError, match="float32"):
        kt.attention(q, k, v, q_pos, k_pos, 0.1, sinks=torch.zeros(4, dtype=torch.bfloat16, device=DEVICE))
    wide = on_device(*case(1, 2, 1, 600, cells=4, written=2, seed=1))
    with pytest.raises(SpecconvError, match="head dimensions"):
        kt.attention(*wide, 0.1)


# ---- the K/V write ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_write_kv_gives_the_bits_of_index_copy(dtype):
    """A batch's K and V (views of one projection, as a fused qkv gives them) into scattered cells
    of the caches: the caches afterwards equal TorchBackend.write_kv's (two index_copy_) bit for bit,
    every other cell untouched."""
    n, kv_heads, dk, dv, cells = 5, 2, 96, 64, 40
    qkv = rand(n, kv_heads, dk + dv, seed=61).to(dtype)
    k, v = qkv[..., :dk], qkv[..., dk:]
    caches = [rand(cells, kv_heads, d, seed=62 + d).to(dtype) for d in (dk, dv)]
    where = torch.tensor([3, 17, 18, 39, 0])
    ref = [c.clone() for c in caches]
    TorchBackend().write_kv(*ref, where, k, v)
    got = [c.clone().to(DEVICE) for c in caches]
    kt.write_kv(*got, where.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    assert all(torch.equal(g.cpu(), r) for g, r in zip(got, ref))
    print(f"\n[{WHERE}, {dtype}] write_kv: the caches equal index_copy_'s, bit for bit")


def test_write_kv_refuses_what_it_would_change():
    caches = [torch.zeros(8, 2, 16, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    k = torch.ones(3, 2, 16, device=DEVICE)
    where = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(SpecconvError, match="its cache"):  # a cast the caller must make
        kt.write_kv(*caches, where, k, k)
    with pytest.raises(SpecconvError, match="int64"):
        kt.write_kv(*caches, where.int(), k.bfloat16(), k.bfloat16())
    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    backend.write_kv(*caches, where, k, 2 * k)  # float32 into bf16 caches: the torch form, rounded as it rounds
    assert bool((caches[0][:3] == 1).all() and (caches[1][:3] == 2).all() and (caches[0][3:] == 0).all())


def test_memory_writes_a_batch_through_the_backend(monkeypatch):
    """Batch.attend_kv(whole=True) under the CUDA backend: after a prompt, a rollback and a
    verification batch, the whole buffers and cell positions equal the torch backend's bit for bit."""
    from specconv.runtime.memory import Memory, MemoryLayout

    def run(backend):
        monkeypatch.setattr(backend_module, "_backend", lambda kind: backend)
        memory = Memory(MemoryLayout(attn_layers=[0], num_key_value_heads=2, head_dim=32, rec_layers=[]),
                        n_seq=1, n_ctx=24, n_rs_seq=3, device=DEVICE, dtype=torch.bfloat16)
        seen = []
        for seed, positions in enumerate(([0, 1, 2, 3, 4, 5], [6, 7, 8, 9], [8, 9, 10])):
            if positions[0] <= memory.last_pos[0]:
                memory.seq_rm(0, positions[0])
            batch = memory.begin(0, torch.tensor(positions, device=DEVICE), positions)
            k, v = (rand(len(positions), 2, 32, seed=70 + 2 * seed + j).bfloat16().to(DEVICE) for j in (0, 1))
            seen.append([t.clone().cpu() for t in batch.attend_kv(0, k, v, whole=True)])
            memory.commit(batch)
        return seen

    got, ref = run(CudaBackend(kt, device_types=(DEVICE.type,))), run(TorchBackend())
    assert all(torch.equal(g, r) for step_g, step_r in zip(got, ref) for g, r in zip(step_g, step_r))


# ---- the seam ---------------------------------------------------------------------------------------

SEAM = {"attention": "triton.attention_kernel", "write_kv": "triton.write_kv_kernel"}  # method: its launch


class StoreApart(CudaBackend):
    """The CUDA backend writing a layer's K/V by write_kv, apart from q's and k's rope (normed_rope_store's
    torch form; its one launch with the rope: tests/runtime/test_cuda_normed_rope.py)."""

    normed_rope_store = TorchBackend.normed_rope_store


class TorchAttention(StoreApart, CountedCalls):
    """The CUDA backend with the torch formulas for attention and the K/V write (what it computed
    before these kernels). Counts, per active op counter, the calls and the launches inside them."""

    def __init__(self, device_type: str):
        super().__init__(kt, device_types=(device_type,))
        self.init_counts()


def _formula(name: str):
    def method(self, *args):
        return self.counted(lambda: getattr(TorchBackend, name)(self, *args), label=name)
    return method


for _name in SEAM:
    setattr(TorchAttention, _name, _formula(_name))


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    return tiny_gguf(tmp_path_factory, outtype="q8_0")[1]


def test_each_attention_and_kv_write_becomes_one_launch(q8_file):
    """Counted on `meta` with the CUDA backend's choices (benchmarks/cuda_op_count.py): each
    attention layer's einsums, mask, softmax, casts, per-row loop and output gate become one launch,
    its two index_copy_ of K and V another, and nothing else in the step changes."""
    k = 3
    fused = cuda_op_count.count_steps(q8_file, "bf16", k, backend=StoreApart(kt, device_types=("meta",)))
    before = TorchAttention("meta")
    unfused = cuda_op_count.count_steps(q8_file, "bf16", k, backend=before)
    for name, new, old in (("step", fused.step, unfused.step), ("verification", fused.verify, unfused.verify)):
        calls = {method: before.calls[id(old), method] for method in SEAM}
        inside = before.inside[id(old)]
        launches = {method: new.by_op[launch] for method, launch in SEAM.items()}
        blocks = {kind: (cuda_op_count.block_summary(old, unfused.recurrent)[kind][1], each)
                  for kind, (_, each) in cuda_op_count.block_summary(new, fused.recurrent).items()}
        print(f"\n[meta, bf16] {name}: {old.total} -> {new.total} launches (attention block "
              f"{blocks['attention'][0]} -> {blocks['attention'][1]}): calls {calls}, {inside} launches of the "
              f"torch formulas -> {launches}")
        assert all(calls[m] > 0 and launches[m] == calls[m] for m in SEAM)  # one launch per call
        assert new.total == old.total - inside + sum(launches.values())  # and nothing else changed
        assert not any(new.by_op[op] for op in ("einsum", "softmax", "sigmoid", "bitwise_not"))
        assert blocks["attention"][1] < blocks["attention"][0]
        assert blocks["Gated DeltaNet"][1] == blocks["Gated DeltaNet"][0]


def test_the_backend_falls_back_to_the_formula_where_the_kernel_does_not_apply():
    """float64 and heads wider than the kernel's take TorchBackend.attention, with its bits (on the same
    device: a GPU's torch ops are not the CPU's)."""
    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    for dtype, hd in ((torch.float64, 64), (torch.float32, kt.MAX_ATTENTION_HEAD_DIM + 64)):
        q, k, v, q_pos, k_pos = on_device(*(t.to(dtype) if t.is_floating_point() else t
                                            for t in case(2, 2, 1, hd, cells=8, written=6, seed=hd)))
        got = backend.attention(q, k, v, q_pos, k_pos, 0.1)
        assert torch.equal(got, TorchBackend().attention(q, k, v, q_pos, k_pos, 0.1)), (dtype, hd)
        sinks, gate = rand(2, seed=hd).to(DEVICE), rand(2, 2, seed=hd + 1).to(dtype).to(DEVICE)  # a gate per head
        got = backend.attention(q, k, v, q_pos, k_pos, 0.1, gate, window=3, sinks=sinks)
        ref = TorchBackend().attention(q, k, v, q_pos, k_pos, 0.1, gate, window=3, sinks=sinks)
        assert torch.equal(got, ref), (dtype, hd, "window, sinks, gate per head")


def test_greedy_speculative_decoding_equals_plain_with_the_attention_kernel_in_bf16(q8_file, monkeypatch):
    """bf16 through the CUDA backend (its kernels, attention included): verification batches of
    k + 1 rows give each row the bits of a one-token step, so greedy speculative output is plain
    decoding's, with accepted and rejected drafts."""
    from specconv.runtime import load_model
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.generate import generate
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    launches = Counter()
    real = kt.attention

    def counted(*args, **kwargs):
        launches[args[0].shape[0]] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(backend_module, "_backend", lambda kind: backend)
    monkeypatch.setattr(kt, "attention", counted)
    model = load_model(q8_file, device=DEVICE.type, dtype="bf16")
    prompt, k = [int(t) for t in prompt_ids(6, seed=5)], 3
    plain = generate(model, prompt, 10).tokens
    spec = speculative_generate(model, SyntheticDrafter(prompt + plain, model.vocab_size, 0.6, seed=4), prompt, 10,
                                SpecConfig(draft_max=k))
    stats = spec.stats["speculative"]
    print(f"\n[{WHERE}, bf16, attention kernel] launches by rows {dict(sorted(launches.items()))}; "
          f"{stats['accepted']} of {stats['drafted']} drafts accepted; speculative = plain: {spec.tokens == plain}")
    assert launches[k + 1] > 0 and launches[1] > 0  # verification batches and decode steps took the kernel
    assert 0 < stats["accepted"] < stats["drafted"]
    assert spec.tokens == plain
