"""gdn_step with the Gated DeltaNet's L2 norms of q, k and its gates folded in (runtime/kernels_triton/
gdn.py `eps=`, `scale=`, `gate_weights=`; runtime/backend_cuda.py `delta_rule_from_conv_slots`):

* the fused kernel = the separate kernels (l2_norm of q with scale and of k, gdn_gates, then
  gdn_step on their float32 results): outputs and every kept state bit for bit under Triton's
  interpreter, with each fold alone and both, tiled heads with 2-D b, alpha and grouped heads with
  Qwen3-Next's [n, nk, r] views, bf16 conv outputs, Qwen3.5's head width 128 included. On a GPU
  the gates fold keeps the bits (the same scalar operations) and the norms fold is within float32
  noise (its sum is reduced in the step kernel's layout);
* a token alone (one launch from the previous token's slot) = the same token in a batch of 16, bit
  for bit (batch invariance in bf16 verification);
* the backend seam: the CUDA backend's one launch = its separate kernels (interpreter: bits) and
  within float32 noise of the torch reference (TorchBackend.delta_rule_from_conv_slots, the norms,
  gates and rule the CPU runs); float64 rings and long batches outside batch-invariant mode take
  the reference;
* bad input: a scale without eps, gate projections of the wrong shape: one-line errors.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, ON_GPU, WHERE  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import backend as backend_module, kernels_triton as kt  # noqa: E402
from specconv.runtime.backend import batch_invariant  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.graphs import gdn  # noqa: E402

EPS = 1e-6
BF16 = torch.bfloat16
CUDA = CudaBackend(kt, device_types=(DEVICE.type,))
REF = TorchBackend()


def mixer_inputs(n: int, nk: int, nv: int, dk: int, dv: int, key_heads: str, seed: int, dtype=BF16):
    """What the conv and the products leave (as runtime/graphs/qwen35.py and qwen3next.py slice
    them): q, k [n, nk, dk] and v [n, nv, dv] views of one conv output, b, alpha [n, nv] (tiled) or
    [n, nk, nv / nk] views of one projection (grouped), and the per-head a < 0, dt_bias [nv]."""
    gen = torch.Generator().manual_seed(seed)
    conv = (2 * torch.randn(n, 2 * nk * dk + nv * dv, generator=gen)).to(dtype).to(DEVICE)
    q, k = conv[:, :nk * dk].view(n, nk, dk), conv[:, nk * dk:2 * nk * dk].view(n, nk, dk)
    v = conv[:, 2 * nk * dk:].view(n, nv, dv)
    if key_heads == gdn.GROUPED:
        r = nv // nk
        ba = (4 * torch.randn(n, nk, 2 * r, generator=gen)).to(dtype).to(DEVICE)
        b, alpha = ba[..., :r], ba[..., r:]
    else:
        b, alpha = ((4 * torch.randn(n, nv, generator=gen)).to(dtype).to(DEVICE) for _ in range(2))
    a = (-3 * torch.rand(nv, generator=gen) - 0.1).to(DEVICE)
    dt_bias = torch.randn(nv, generator=gen).to(DEVICE)
    ring = torch.randn(n + 2, nv, dk, dv, generator=gen).to(DEVICE)
    return (q, k, v, b, alpha, a, dt_bias), ring


def separate(inputs, ring, src, dst, group, norms: bool, gates: bool):
    """gdn_step after the separate kernels for what it does not fold: (o, the ring after it)."""
    q, k, v, b, alpha, a, dt_bias = inputs
    if not norms:
        q, k = kt.l2_norm(q, EPS, scale=q.shape[-1] ** -0.5), kt.l2_norm(k, EPS)
    g, beta = (alpha, b) if gates else kt.gdn_gates(b, alpha, a, dt_bias)
    ring = ring.clone()
    o = kt.gdn_step(q, k, v, g, beta, ring, src, dst, group=group,
                    eps=EPS if norms else None, scale=q.shape[-1] ** -0.5 if norms else None,
                    gate_weights=(a, dt_bias) if gates else None)
    return o, ring


@pytest.mark.parametrize("folds", [(True, True), (True, False), (False, True)], ids=["norms+gates", "norms", "gates"])
@pytest.mark.parametrize("shape", [(4, gdn.TILED, 2, 6, 16, 40), (4, gdn.GROUPED, 2, 6, 16, 40),
                                   (16, gdn.TILED, 2, 4, 128, 128), (1, gdn.GROUPED, 2, 4, 128, 128)],
                         ids=["tiled", "grouped", "tiled-dk128", "grouped-dk128-one-token"])
def test_the_folds_give_the_bits_of_the_separate_kernels(shape, folds):
    n, key_heads, nk, nv, dk, dv = shape
    norms, gates = folds
    inputs, ring = mixer_inputs(n, nk, nv, dk, dv, key_heads, seed=n + dk)
    group = nv // nk if key_heads == gdn.GROUPED else 1
    dst = list(range(1, n + 1))
    o, states = separate(inputs, ring, 0, dst, group, norms, gates)
    o_ref, states_ref = separate(inputs, ring, 0, dst, group, False, False)
    diff = max(float((o - o_ref).abs().max()), float((states - states_ref).abs().max()))
    print(f"\n[{WHERE}] gdn_step {key_heads} n={n} dk={dk} folding norms={norms} gates={gates}: "
          f"max |Δ| vs the separate kernels {diff:.1e}")
    if ON_GPU and norms:  # the step kernel's sum of squares runs in its own layout's order
        assert diff <= 1e-5 * float(o_ref.abs().max() + states_ref.abs().max())
    else:
        assert torch.equal(o, o_ref) and torch.equal(states, states_ref)


@pytest.mark.parametrize("key_heads", [gdn.TILED, gdn.GROUPED])
def test_a_token_alone_gets_its_bits_in_a_batch_of_16(key_heads):
    """The fused kernel over 16 tokens (each kept state in its slot) = 16 one-token launches, each
    reading the slot the previous one wrote."""
    n, nk, nv, dk, dv = 16, 2, 4, 32, 32
    inputs, ring = mixer_inputs(n, nk, nv, dk, dv, key_heads, seed=3)
    group = nv // nk if key_heads == gdn.GROUPED else 1
    o, states = separate(inputs, ring, 0, list(range(1, n + 1)), group, True, True)
    alone = ring.clone()
    for t in range(n):
        one = tuple(x[t:t + 1] for x in inputs[:5]) + inputs[5:]
        o_t = kt.gdn_step(*one[:3], one[4], one[3], alone, t, [t + 1], group=group, eps=EPS, scale=dk ** -0.5,
                          gate_weights=one[5:])
        assert torch.equal(o_t, o[t:t + 1]), t
    assert torch.equal(alone, states)
    print(f"\n[{WHERE}] fused gdn_step {key_heads}: 16 one-token launches = one launch of 16 tokens, bit for bit")


def backend_call(backend, inputs, ring, key_heads, n):
    ring = ring.clone()
    src = torch.tensor([0], device=ring.device)
    dst = torch.arange(1, n + 1, device=ring.device)
    o = backend.delta_rule_from_conv_slots(*inputs, EPS, inputs[0].shape[-1] ** -0.5, ring, src, dst,
                                           key_heads=key_heads)
    return o, ring


@pytest.mark.parametrize("key_heads", [gdn.TILED, gdn.GROUPED])
def test_the_cuda_backend_launches_once_and_keeps_the_reference(key_heads, monkeypatch):
    n, nk, nv, dk, dv = 4, 2, 4, 32, 32
    inputs, ring = mixer_inputs(n, nk, nv, dk, dv, key_heads, seed=9)
    group = nv // nk if key_heads == gdn.GROUPED else 1
    o_ref, states_ref = backend_call(REF, tuple(t.cpu() for t in inputs), ring.cpu(), key_heads, n)  # the CPU's
    monkeypatch.setattr(backend_module, "_backend", lambda kind: CUDA)  # ops and gdn.gates reach CUDA too
    launched = []
    for name in ("gdn_step", "l2_norm", "gdn_gates"):
        real = getattr(kt, name)
        monkeypatch.setattr(kt, name, lambda *a, _real=real, _name=name, **kw: (launched.append(_name), _real(*a, **kw))[1])
    o, states = backend_call(CUDA, inputs, ring, key_heads, n)
    assert launched == ["gdn_step"]
    o_sep, states_sep = separate(inputs, ring, 0, list(range(1, n + 1)), group, False, False)
    if not ON_GPU:
        assert torch.equal(o, o_sep) and torch.equal(states, states_sep)
    diff = max(float((o.cpu() - o_ref).abs().max()), float((states.cpu() - states_ref).abs().max()))
    print(f"\n[{WHERE}] delta_rule_from_conv_slots {key_heads}: one launch; max |Δ| vs the torch reference {diff:.1e}")
    assert diff <= 1e-4
    launched.clear()
    with batch_invariant(False):  # more tokens than a launch takes, outside batch-invariant mode: the reference
        long_inputs, long_ring = mixer_inputs(20, nk, nv, dk, dv, key_heads, seed=10)
        backend_call(CUDA, long_inputs, long_ring, key_heads, 20)
    assert launched == ["l2_norm", "l2_norm", "gdn_gates"]  # the separate kernels, then the torch rule
    launched.clear()
    backend_call(CUDA, inputs, ring.double(), key_heads, n)  # float64 states: the torch forms
    assert launched == ["l2_norm", "l2_norm", "gdn_gates"]


def test_bad_input_is_a_one_line_error():
    inputs, ring = mixer_inputs(2, 2, 4, 16, 16, gdn.TILED, seed=1)
    q, k, v, b, alpha, a, dt_bias = inputs
    with pytest.raises(SpecconvError, match="gdn_step: scale multiplies the in-kernel norm of q: give eps"):
        kt.gdn_step(q, k, v, alpha, b, ring, 0, [1], scale=0.25, gate_weights=(a, dt_bias))
    with pytest.raises(SpecconvError, match=r"gdn_step: alpha has shape \(2, 3\), expected \(2, 4\)"):
        kt.gdn_step(q, k, v, alpha[:, :3], b, ring, 0, [1], eps=EPS, gate_weights=(a, dt_bias))
    with pytest.raises(SpecconvError, match=r"gdn_step: a has shape \(3,\), expected \(4,\)"):
        kt.gdn_step(q, k, v, alpha, b, ring, 0, [1], eps=EPS, gate_weights=(a[:3], dt_bias))
    with pytest.raises(SpecconvError, match=r"gdn_step: alpha has shape \(2, 3, 2\), expected \[2, groups, 4"):
        kt.gdn_step(q, k, v, torch.zeros(2, 3, 2), torch.zeros(2, 3, 2), ring, 0, [1], gate_weights=(a, dt_bias))
