"""gdn_step with the Gated DeltaNet's gated output norm folded in (runtime/kernels_triton/gdn.py
`gated_norm=`; runtime/backend_cuda_recurrent.py `conv_delta_rule_slots` / `delta_rule_from_conv_slots`):

* one launch = the two launches it replaces (gdn_step, then kernels_triton.rms_norm with the gate
  and out_dtype), y and every kept state bit for bit under Triton's interpreter: bf16 and float32,
  1, 4 and 16 tokens, tiled and grouped key heads, the conv folded in or not, head widths dv of one
  column block, of several, and not a multiple of the block (the last one partial); the gate a
  strided view of a wider projection. On a GPU within float32 noise (the norm's sum of squares
  reduced in the step kernel's layout);
* the heads' arrival counters (_common.tile_counters) are zero after every launch, and two launches
  of the same inputs give the same bits;
* without counters (a CUDA graph capture before any were made: none is made there) gdn_step runs
  the two launches, with the same bits;
* a token alone (one launch from the previous token's slot) = the same token in a batch of 16, bf16,
  bit for bit (batch invariance of the verification batch);
* the backend seam: the CUDA backend's mixer call with the norm launches gdn_step only, the bits of
  its three separate launches (interpreter), within float32 noise of the torch reference (TorchBackend: the conv, the rule, then gated_rms_norm, what
  the CPU runs); a 20-token batch in batch-invariant mode folds the norm into each piece's launch;
  a gate the norm kernel cannot read in place takes gated_rms_norm's launch after the rule;
* bad input: a gate or weight of the wrong shape, an out_dtype without a kernel: one-line errors;
* the compiled code (sm_90 PTX, on the CPU): the head's arrival is an acq_rel atomic at gpu scope
  behind barriers, o read back through L2, y rounded to nearest, the counter reset.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, ON_GPU, WHERE, record_launches  # noqa: E402 (the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import backend as backend_module, kernels_triton as kt  # noqa: E402
from specconv.runtime.backend import batch_invariant  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_cuda_base import CudaKernelBase  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.graphs import gdn  # noqa: E402
from specconv.runtime.kernels_triton import _common  # noqa: E402
from specconv.runtime.kernels_triton.gdn import BLOCK_V  # noqa: E402
from tests.runtime.test_cuda_gdn_step_fused import EPS, conv_inputs, recorded  # noqa: E402

BF16 = torch.bfloat16
CUDA = CudaBackend(kt, device_types=(DEVICE.type,))
REF = TorchBackend()
KEY = DEVICE if DEVICE.type == "cpu" else torch.device("cuda", torch.cuda.current_device())  # _counters' key


def counters_at_rest() -> bool:
    return not bool(_common.tile_counters(DEVICE, 1).any())


def norm_inputs(n: int, nv: int, dv: int, dtype: torch.dtype, seed: int):
    """The norm's weight [dv] (float32, as the backend reads ssm_norm) and the gate z [n, nv, dv] in the
    compute dtype: a view of the second half of a [n, 2 · nv · dv] projection (strided rows)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (1 + 0.5 * torch.randn(dv, generator=gen)).to(DEVICE)
    joined = (3 * torch.randn(n, 2 * nv * dv, generator=gen)).to(dtype).to(DEVICE)
    return weight, joined[:, nv * dv:].view(n, nv, dv)


def step(inputs, windows, weight, ring, src, dst, group, conv: bool, gated_norm=None):
    """gdn_step on copies of the rings, with the q, k norms and the gates folded in (and the conv where
    `conv`): (its result, the state ring, the windows ring)."""
    q, k, v, b, alpha, a, dt_bias = inputs
    ring, windows = ring.clone(), windows.clone()
    out = kt.gdn_step(q, k, v, alpha, b, ring, src, dst, group=group, eps=EPS, scale=q.shape[-1] ** -0.5,
                      gate_weights=(a, dt_bias), conv=(windows, weight) if conv else None, gated_norm=gated_norm)
    return out, ring, windows


def two_launches(inputs, windows, weight, ring, src, dst, group, conv, norm):
    """gdn_step, then the gated norm's own launch: what the fold replaces."""
    o, ring, windows = step(inputs, windows, weight, ring, src, dst, group, conv)
    w, z, eps, out_dtype = norm
    return kt.rms_norm(o, w, eps, gate=z, out_dtype=out_dtype), ring, windows


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


SHAPES = [  # n, key heads, nk, nv, dk, dv, compute dtype, conv folded in
    (1, gdn.TILED, 2, 4, 16, 40, BF16, True),
    (4, gdn.GROUPED, 2, 6, 16, 40, BF16, True),
    (16, gdn.TILED, 2, 4, 16, 72, torch.float32, True),
    (4, gdn.TILED, 2, 4, 128, 128, BF16, True),
    (16, gdn.GROUPED, 2, 4, 16, 16, torch.float32, False),
    (4, gdn.GROUPED, 1, 2, 32, 96, BF16, False),
]
IDS = ["tiled-one-token", "grouped", "tiled-dv72-f32", "tiled-dk128-dv128", "grouped-dv16-f32", "grouped-dv96"]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_one_launch_gives_the_bits_of_the_rule_then_the_norm(shape, monkeypatch):
    n, key_heads, nk, nv, dk, dv, dtype, conv = shape
    inputs, windows, weight, ring = conv_inputs(n, nk, nv, dk, dv, key_heads, seed=n + dv, slots=n + 2)
    inputs = tuple(t.to(dtype) for t in inputs[:5]) + inputs[5:]  # conv_inputs' views, kept views
    if dtype == torch.float32:  # float32 pre-conv rows: q, k, v views of them again
        m = torch.cat([t.reshape(n, -1) for t in inputs[:3]], dim=1)
        inputs = gdn.qkv_heads(m, (nk, dk, nv, dv)) + inputs[3:]
    group = nv // nk if key_heads == gdn.GROUPED else 1
    norm = norm_inputs(n, nv, dv, dtype, seed=dv) + (EPS, dtype)
    src, dst = n + 1, list(range(n))
    launched = record_launches(monkeypatch)
    two = two_launches(inputs, windows, weight, ring, src, dst, group, conv, norm)
    assert launched == ["gdn_step_kernel", "norm_kernel"]
    del launched[:]
    one = step(inputs, windows, weight, ring, src, dst, group, conv, gated_norm=norm)
    assert launched == ["gdn_step_kernel"] and counters_at_rest()
    again = step(inputs, windows, weight, ring, src, dst, group, conv, gated_norm=norm)
    assert counters_at_rest() and same(again, one)  # the counters left as found: the next launch alike
    y, y_two = one[0], two[0]
    assert y.dtype == dtype and y.shape == (n, nv, dv)
    diff = float((y.float() - y_two.float()).abs().max())
    print(f"\n[{WHERE}] gdn_step + gated norm, {key_heads} n={n} dk={dk} dv={dv} ({-(-dv // BLOCK_V)} "
          f"programs a head) {str(dtype)[6:]}{' conv' if conv else ''}: one launch, max |Δ| {diff:.1e} "
          f"from the two launches")
    assert same(one[1:], two[1:])  # states and windows: the rule's own bits, untouched by the fold
    if ON_GPU:  # the norm's sum of squares in the step kernel's layout
        assert diff <= 1e-2 * float(y_two.float().abs().max()) if dtype == BF16 else diff <= 1e-5 * float(
            y_two.abs().max())
    else:
        assert torch.equal(y, y_two)


def test_without_counters_the_norm_is_its_own_launch(monkeypatch):
    """During a capture with no counters made yet (tile_counters: None, nothing allocated) gdn_step
    runs the rule, then the norm's kernel: the bits of the one-launch path."""
    n, nk, nv, dk, dv = 4, 2, 4, 16, 40
    inputs, windows, weight, ring = conv_inputs(n, nk, nv, dk, dv, gdn.TILED, seed=2, slots=n + 2)
    norm = norm_inputs(n, nv, dv, BF16, seed=3) + (EPS, BF16)
    one = step(inputs, windows, weight, ring, n + 1, list(range(n)), 1, True, gated_norm=norm)
    launched = record_launches(monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(_common, "_counters", {})
        m.setattr(_common, "capturing", lambda device: True)
        two = step(inputs, windows, weight, ring, n + 1, list(range(n)), 1, True, gated_norm=norm)
        assert _common._counters.get(KEY, []) == []  # nothing was made
    assert launched == ["gdn_step_kernel", "norm_kernel"]
    if not ON_GPU:
        assert same(one, two)
    print(f"\n[{WHERE}] gdn_step + gated norm without counters: two launches, the bits of one")


@pytest.mark.parametrize("key_heads", [gdn.TILED, gdn.GROUPED])
def test_a_token_alone_gets_its_bits_in_a_batch_of_16(key_heads):
    n, nk, nv, dk, dv = 16, 2, 4, 32, 40
    inputs, windows, weight, ring = conv_inputs(n, nk, nv, dk, dv, key_heads, seed=5, slots=n + 1)
    group = nv // nk if key_heads == gdn.GROUPED else 1
    w, z = norm_inputs(n, nv, dv, BF16, seed=6)
    y, ring_all, windows_all = step(inputs, windows, weight, ring, 0, list(range(1, n + 1)), group, True,
                                    gated_norm=(w, z, EPS, BF16))
    ring_one, windows_one = ring.clone(), windows.clone()
    q, k, v, b, alpha, a, dt_bias = inputs
    for t in range(n):
        y_t = kt.gdn_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], alpha[t:t + 1], b[t:t + 1], ring_one, t, [t + 1],
                          group=group, eps=EPS, scale=dk ** -0.5, gate_weights=(a, dt_bias),
                          conv=(windows_one, weight), gated_norm=(w, z[t:t + 1], EPS, BF16))
        assert torch.equal(y_t, y[t:t + 1]), t
    assert torch.equal(ring_one, ring_all) and torch.equal(windows_one, windows_all) and counters_at_rest()
    print(f"\n[{WHERE}] gdn_step + gated norm {key_heads}, bf16: 16 one-token launches = one of 16, bit for bit")


@pytest.mark.parametrize("key_heads", [gdn.TILED, gdn.GROUPED])
def test_the_backend_folds_the_norm_and_keeps_the_reference(key_heads, monkeypatch):
    n, nk, nv, dk, dv = 4, 2, 4, 32, 32
    heads = (nk, dk, nv, dv)
    inputs, windows, weight, ring = conv_inputs(20, nk, nv, dk, dv, key_heads, seed=7, slots=22)
    # float32 rows, so that the reference's conv output (rounded into m's dtype) is float32 noise apart
    m = inputs[0].as_strided((20, 2 * nk * dk + nv * dv), (inputs[0].stride(0), 1)).float()
    b, alpha, a, dt_bias = (t.float() for t in inputs[3:])
    w, z = norm_inputs(20, nv, dv, BF16, seed=8)

    def call(backend, tokens, gate, on=DEVICE):
        rings = windows.clone().to(on), ring.clone().to(on)
        src, dst = torch.tensor([21], device=on), torch.arange(tokens, device=on)
        cut = (m[:tokens], b[:tokens], alpha[:tokens])
        y = backend.conv_delta_rule_slots(cut[0].to(on), rings[0], weight.to(on), heads, *(t.to(on) for t in cut[1:]),
                                          a.to(on), dt_bias.to(on), EPS, dk ** -0.5, rings[1], src, dst,
                                          key_heads=key_heads,
                                          gated_norm=None if gate is None else (w.to(on), gate.to(on), EPS, BF16))
        return y, rings

    y_ref, rings_ref = call(REF, n, z[:n], on=torch.device("cpu"))  # the CPU's: conv, rule, gated_rms_norm
    monkeypatch.setattr(backend_module, "_backend", lambda kind: CUDA)
    launched = recorded(monkeypatch, kt, ("gdn_step", "causal_conv", "rms_norm"))
    y, rings = call(CUDA, n, z[:n])
    assert launched == ["gdn_step"] and counters_at_rest()
    launched.clear()
    o_sep, rings_sep = call(super(CudaKernelBase, CUDA), n, None)  # TorchBackend's method: the conv, the step
    y_sep = CUDA.gated_rms_norm(o_sep, w, z[:n], EPS, BF16)  # then the norm
    assert launched == ["causal_conv", "gdn_step", "rms_norm"]
    if not ON_GPU:
        assert torch.equal(y, y_sep) and same(rings, rings_sep)
    diff = float((y.cpu().float() - y_ref.float()).abs().max())
    state_diff = float((rings[1].cpu() - rings_ref[1]).abs().max())
    print(f"\n[{WHERE}] conv_delta_rule_slots + gated norm {key_heads}: one launch; max |Δ| vs the torch "
          f"reference: y (bf16) {diff:.1e}, states {state_diff:.1e}")
    assert y.dtype == BF16 and state_diff <= 1e-4
    assert diff <= 2 ** -6 * float(y_ref.float().abs().max())  # a bf16 rounding of float32-noise apart
    launched.clear()
    with batch_invariant(True):  # 20 tokens: the separate conv, two launches through ring_pieces' scratch slot
        y20, _ = call(CUDA, 20, z)
    assert launched == ["causal_conv", "causal_conv", "gdn_step", "gdn_step"] and counters_at_rest()
    if not ON_GPU:  # the first piece: the bits of a 16-token launch (the conv folded in or not)
        assert torch.equal(y20[:16], call(CUDA, 16, z[:16])[0])
    launched.clear()
    wide = torch.empty(20, nv, 2 * dv, dtype=BF16, device=DEVICE)
    wide[..., ::2] = z  # a gate with strided values: the norm's own launch after the rule (its kernel copies)
    y_apart, _ = call(CUDA, n, wide[:n, :, ::2])
    assert launched == ["gdn_step", "rms_norm"]
    if not ON_GPU:
        assert torch.equal(y_apart, y)


def test_bad_input_is_a_one_line_error():
    inputs, windows, weight, ring = conv_inputs(2, 2, 4, 16, 16, gdn.TILED, seed=1, slots=4)
    w, z = norm_inputs(2, 4, 16, BF16, seed=1)
    with pytest.raises(SpecconvError, match=r"gdn_step: gate has shape \(2, 4, 8\), expected \(2, 4, 16\)"):
        step(inputs, windows, weight, ring, 3, [0, 1], 1, True, gated_norm=(w, z[..., :8], EPS, BF16))
    with pytest.raises(SpecconvError, match=r"gdn_step: norm weight has shape \(8,\), expected \(16,\)"):
        step(inputs, windows, weight, ring, 3, [0, 1], 1, True, gated_norm=(w[:8], z, EPS, BF16))
    with pytest.raises(SpecconvError, match="gdn_step: the gated norm's out_dtype must be float32, bfloat16 or"):
        step(inputs, windows, weight, ring, 3, [0, 1], 1, True, gated_norm=(w, z, EPS, torch.float64))


def test_the_compiled_arrival_is_a_release_acquire_behind_barriers():
    """sm_90 PTX of gdn_step_kernel with the norm folded in (Qwen3.5's 1.1 B heads: 16 key, 16 value
    heads of 128, bf16, one token, recorded on `meta` as the CUDA backend launches it): its one
    atomic is the head counter's acq_rel add at gpu scope after the o block's stores and a barrier;
    the last program then reads o through L2 (ld.global.cg), writes y rounded to nearest
    (cvt.rn.bf16) and zeroes the counter."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from benchmarks import cuda_op_count, triton_launches
    from tests.runtime.test_cuda_split_products import ARCH, instructions
    from tools import triton_aot

    specs = []

    def observe(module, kernel, grid, args, kwargs):
        specs.append(triton_launches.specialize(module, kernel, args, kwargs))

    nk = nv = 16
    dk = dv = 128
    meta = torch.device("meta")
    cuda_op_count.launch_observers.append(observe)
    try:
        with cuda_op_count.meta_launches(cuda_op_count.H200_SMS):
            m = torch.empty(1, 2 * nk * dk + nv * dv, dtype=BF16, device=meta)
            q, k, v = gdn.qkv_heads(m, (nk, dk, nv, dv))
            ba = torch.empty(1, 2 * nv, dtype=BF16, device=meta)
            weights = tuple(torch.empty(nv, device=meta) for _ in range(2))
            ring, windows = torch.empty(4, nv, dk, dv, device=meta), torch.empty(4, 3, m.shape[1], device=meta)
            z = torch.empty(1, 2 * nv * dv, dtype=BF16, device=meta)[:, nv * dv:].view(1, nv, dv)
            kt.gdn_step(q, k, v, ba[:, nv:], ba[:, :nv], ring, torch.zeros(1, dtype=torch.int64, device=meta),
                        torch.ones(1, dtype=torch.int64, device=meta), eps=EPS, scale=dk ** -0.5, gate_weights=weights,
                        conv=(windows, torch.empty(m.shape[1], 4, device=meta)),
                        gated_norm=(torch.empty(dv, device=meta), z, EPS, BF16))
    finally:
        cuda_op_count.launch_observers.remove(observe)
    assert [s.kernel for s in specs] == ["gdn_step_kernel"] and specs[0].constant("GATED_NORM")
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=triton_aot._worker_init) as pool:
        ptx = pool.submit(triton_aot.ptx, specs[0].to_json(), ARCH).result()
    ops = instructions(ptx)
    atomics = [i for i, op in enumerate(ops) if op.startswith("atom")]
    assert [ops[i] for i in atomics] == ["atom.global.gpu.acq_rel.add.u32"], [ops[i] for i in atomics]
    at = atomics[0]
    before = [op for op in ops[:at] if op.startswith(("st.global", "bar.sync"))]
    assert before[-1] == "bar.sync" and any(op.endswith("b32") for op in before), before[-4:]  # o, a barrier
    after = ops[at + 1:]
    first_read = next(i for i, op in enumerate(after) if op.startswith("ld.global.cg"))  # o, read through L2
    assert "bar.sync" in after[:first_read]  # the acquirer's count reaches the other threads
    reads = after[first_read:]
    assert any(op.startswith("cvt.rn.bf16") for op in reads)  # y rounded to nearest into bf16
    stores = [op for op in reads if op.startswith("st.global")]
    assert any(op.endswith("b16") for op in stores) and stores[-1] == "st.global.b32"  # y, then the counter
    print(f"\nsm_{ARCH} gdn_step_kernel GATED_NORM: ... {' '.join(before[-3:])} | {ops[at]} | bar.sync ... "
          f"ld.global.cg.b32 ... cvt.rn.bf16 ... st.global.b32 (counter)")
