"""gdn_step with the Gated DeltaNet's L2 norms of q, k and its gates folded in (runtime/kernels_triton/
gdn.py `eps=`, `scale=`, `gate_weights=`; runtime/backend_cuda_recurrent.py `delta_rule_from_conv_slots`):

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
* the conv folded in too (`conv=`, `conv_delta_rule_slots`): outputs, states and the conv windows
  after every kept token = causal_conv then the fused step, bit for bit under the interpreter (the
  conv's operations, each window channel written by one program; on a GPU the windows bit for
  bit, the rest within float32 noise), slots outside the batch's untouched; a token alone = in a
  batch of 16; the backend launches gdn_step only, and takes the separate conv for a longer batch
  (ring_pieces' scratch slot) and for a memory without a spare slot (a ring of one: gdn.Recurrence);
* bad input: a scale without eps, gate projections of the wrong shape, a folded conv whose source
  slot is a destination or whose q, k, v are not views of one row block: one-line errors.
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
from specconv.runtime.backend_cuda_base import CudaKernelBase  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.graphs import gdn  # noqa: E402

EPS = 1e-6
BF16 = torch.bfloat16
CUDA = CudaBackend(kt, device_types=(DEVICE.type,))
REF = TorchBackend()


def recorded(monkeypatch, owner, names) -> list[str]:
    """The names of owner's functions `names` in the order they are called from now on."""
    calls = []
    for name in names:
        def counted(*args, _real=getattr(owner, name), _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls


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
    launched = recorded(monkeypatch, kt, ("gdn_step", "l2_norm", "gdn_gates"))
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


TAPS = 4


def conv_inputs(n: int, nk: int, nv: int, dk: int, dv: int, key_heads: str, seed: int, slots: int):
    """mixer_inputs with q, k, v the views of pre-conv rows m, a windows ring [slots, K-1, C] and a
    conv weight [C, K]."""
    (q, k, v, b, alpha, a, dt_bias), _ = mixer_inputs(n, nk, nv, dk, dv, key_heads, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    channels = 2 * nk * dk + nv * dv
    windows = torch.randn(slots, TAPS - 1, channels, generator=gen).to(DEVICE)
    weight = torch.randn(channels, TAPS, generator=gen).to(DEVICE)
    ring = torch.randn(slots, nv, dk, dv, generator=gen).to(DEVICE)
    return (q, k, v, b, alpha, a, dt_bias), windows, weight, ring


def heads_of(x: torch.Tensor, nk: int, dk: int, nv: int, dv: int):
    n = x.shape[0]
    return x[:, :nk * dk].view(n, nk, dk), x[:, nk * dk:2 * nk * dk].view(n, nk, dk), x[:, 2 * nk * dk:].view(n, nv, dv)


@pytest.mark.parametrize("shape", [(4, 2, gdn.TILED, 2, 6, 16, 40), (4, 4, gdn.GROUPED, 2, 6, 16, 40),
                                   (16, 16, gdn.TILED, 2, 4, 128, 128), (1, 1, gdn.GROUPED, 2, 4, 128, 128)],
                         ids=["tiled-keep2", "grouped", "tiled-dk128", "grouped-dk128-one-token"])
def test_the_folded_conv_gives_the_bits_of_the_conv_kernel(shape):
    n, keep, key_heads, nk, nv, dk, dv = shape
    inputs, windows, weight, ring = conv_inputs(n, nk, nv, dk, dv, key_heads, seed=n + keep, slots=keep + 2)
    q, k, v, b, alpha, a, dt_bias = inputs
    m = q.as_strided((n, 2 * nk * dk + nv * dv), (q.stride(0) if n > 1 else 1, 1))  # the rows they view
    group = nv // nk if key_heads == gdn.GROUPED else 1
    src, dst = keep + 1, list(range(keep))
    w_sep, ring_sep = windows.clone(), ring.clone()
    c = kt.causal_conv(m, w_sep, weight, src, dst)
    o_sep = kt.gdn_step(*heads_of(c, nk, dk, nv, dv), alpha, b, ring_sep, src, dst, group=group, eps=EPS,
                        scale=dk ** -0.5, gate_weights=(a, dt_bias))
    w_fold, ring_fold = windows.clone(), ring.clone()
    o = kt.gdn_step(q, k, v, alpha, b, ring_fold, src, dst, group=group, eps=EPS, scale=dk ** -0.5,
                    gate_weights=(a, dt_bias), conv=(w_fold, weight))
    diff = max(float((o - o_sep).abs().max()), float((ring_fold - ring_sep).abs().max()))
    print(f"\n[{WHERE}] gdn_step with the conv folded in, {key_heads} n={n} keep={keep} dk={dk}: windows = "
          f"causal_conv's, outputs and states max |Δ| {diff:.1e} from causal_conv then gdn_step")
    assert torch.equal(w_fold, w_sep)  # copies of the input rows, everywhere
    if ON_GPU:  # another specialisation of the step kernel: its norm's sum may run in another order
        assert diff <= 1e-5 * float(o_sep.abs().max() + ring_sep.abs().max())
    else:
        assert torch.equal(o, o_sep) and torch.equal(ring_fold, ring_sep)
    assert torch.equal(w_fold[keep:], windows[keep:]) and torch.equal(ring_fold[keep:], ring[keep:])  # untouched


@pytest.mark.parametrize("key_heads", [gdn.TILED, gdn.GROUPED])
def test_a_token_alone_gets_its_bits_in_a_batch_of_16_with_the_conv(key_heads):
    n, nk, nv, dk, dv = 16, 2, 4, 32, 32
    inputs, windows, weight, ring = conv_inputs(n, nk, nv, dk, dv, key_heads, seed=4, slots=n + 1)
    q, k, v, b, alpha, a, dt_bias = inputs
    group = nv // nk if key_heads == gdn.GROUPED else 1
    w_all, ring_all = windows.clone(), ring.clone()
    o = kt.gdn_step(q, k, v, alpha, b, ring_all, 0, list(range(1, n + 1)), group=group, eps=EPS, scale=dk ** -0.5,
                    gate_weights=(a, dt_bias), conv=(w_all, weight))
    w_one, ring_one = windows.clone(), ring.clone()
    for t in range(n):
        o_t = kt.gdn_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], alpha[t:t + 1], b[t:t + 1], ring_one, t, [t + 1],
                          group=group, eps=EPS, scale=dk ** -0.5, gate_weights=(a, dt_bias), conv=(w_one, weight))
        assert torch.equal(o_t, o[t:t + 1]), t
    assert torch.equal(ring_one, ring_all) and torch.equal(w_one, w_all)
    print(f"\n[{WHERE}] gdn_step with the conv, {key_heads}: 16 one-token launches = one of 16 tokens, bit for bit")


@pytest.mark.parametrize("key_heads", [gdn.TILED, gdn.GROUPED])
def test_the_backend_folds_the_conv_into_one_launch_where_it_may(key_heads, monkeypatch):
    n, nk, nv, dk, dv = 4, 2, 4, 32, 32
    heads = (nk, dk, nv, dv)
    inputs, windows, weight, ring = conv_inputs(20, nk, nv, dk, dv, key_heads, seed=6, slots=22)
    m = inputs[0].as_strided((20, 2 * nk * dk + nv * dv), (inputs[0].stride(0), 1))
    b, alpha, a, dt_bias = inputs[3:]
    monkeypatch.setattr(backend_module, "_backend", lambda kind: CUDA)
    launched = recorded(monkeypatch, kt, ("gdn_step", "causal_conv", "l2_norm", "gdn_gates"))

    def call(backend, tokens, ring_kind=torch.float32):
        rings = windows.clone(), ring.clone().to(ring_kind)
        src, dst = torch.tensor([21], device=DEVICE), torch.arange(tokens, device=DEVICE)
        o = backend.conv_delta_rule_slots(m[:tokens], rings[0], weight, heads, b[:tokens], alpha[:tokens], a, dt_bias,
                                          EPS, dk ** -0.5, rings[1], src, dst, key_heads=key_heads)
        return o, rings

    o, rings = call(CUDA, n)
    assert launched == ["gdn_step"]
    launched.clear()
    o_sep, rings_sep = call(super(CudaKernelBase, CUDA), n)  # TorchBackend's method: the conv, then the step
    assert launched == ["causal_conv", "gdn_step"]
    diff = float((o - o_sep).abs().max())
    print(f"\n[{WHERE}] conv_delta_rule_slots {key_heads}: one launch; max |Δ| vs separate conv {diff:.1e}")
    if not ON_GPU:
        assert torch.equal(o, o_sep) and all(torch.equal(x, y) for x, y in zip(rings, rings_sep))
    assert diff <= 1e-5 * float(o_sep.abs().max())
    launched.clear()
    with batch_invariant(True):  # 20 tokens: two launches through ring_pieces' scratch slot
        call(CUDA, 20)
    assert launched == ["causal_conv", "causal_conv", "gdn_step", "gdn_step"]


def test_every_ring_keeps_a_spare_slot_and_folds_the_conv(tmp_path_factory, monkeypatch):
    """gdn.Recurrence folds the conv where the memory keeps a spare slot, so that a batch never writes
    the slot its programs read. Every ring keeps one, the checkpoint mode's ring of one state (plain
    decoding) too: both modes take the folded form."""
    from specconv.runtime import Context, GraphType, load_model
    from tests.fixtures.runtime_common import tiny_gguf

    model = load_model(tiny_gguf(tmp_path_factory, outtype="f32")[1], device=DEVICE, dtype="f32")
    monkeypatch.setattr(backend_module, "_backend", lambda kind: CUDA)
    calls = recorded(monkeypatch, CUDA, ("conv_delta_rule_slots", "causal_conv_slots"))
    for rollback in (3, 0):
        calls.clear()
        ctx = Context(model, GraphType.MAIN, n_ctx=8, n_rs_seq=rollback)
        assert ctx.memory.slots == ctx.memory.ring + 1 == rollback + 2
        ctx.decode([1, 2])
        assert calls and set(calls) == {"conv_delta_rule_slots"}, (rollback, calls)


def test_bad_conv_input_is_a_one_line_error():
    inputs, windows, weight, ring = conv_inputs(2, 2, 4, 16, 16, gdn.TILED, seed=1, slots=3)
    q, k, v, b, alpha, a, dt_bias = inputs
    fold = dict(eps=EPS, gate_weights=(a, dt_bias), conv=(windows, weight))
    with pytest.raises(SpecconvError, match="gdn_step: with the conv folded in, the source slot may not be a dest"):
        kt.gdn_step(q, k, v, alpha, b, ring, 1, [0, 1], **fold)
    with pytest.raises(SpecconvError, match=r"gdn_step: with conv=, q, k, v must be the \[q \| k \| v\] head views"):
        kt.gdn_step(q, k.clone(), v, alpha, b, ring, 2, [0, 1], **fold)
    with pytest.raises(SpecconvError, match=r"gdn_step: conv windows has shape \(3, 3, 128\), expected \(3, 2, 128\)"):
        kt.gdn_step(q, k, v, alpha, b, ring, 2, [0, 1], eps=EPS, gate_weights=(a, dt_bias),
                    conv=(windows, torch.zeros(128, 3, device=DEVICE)))
