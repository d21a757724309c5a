"""The native gated delta rule for decode and verification (runtime/gdn_step.c via runtime/gdn_native.py).

Reference: the token-by-token recurrence of runtime/graphs/gdn.py in float64 (docs/reference/model-math.md
§2.2), computed from the same float32 inputs. The native form must give its outputs, the δ vectors
that PendingStates rebuilds earlier states from, and the state after the batch within float32
rounding of it, leave the state before the batch intact (a rollback starts from it), and work in
place. In a float32 model, speculative rounds through it must roll back to exactly what a plain
token-by-token context computes (within float32 noise; a wrong slot or state is an O(1) error).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specconv.runtime import Context, GraphType, gdn_native, load_model
from specconv.runtime.graphs import gdn
from tests.fixtures.runtime_common import max_abs, prompt_ids, tiny_gguf

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(not gdn_native.available(), reason="native extension not built")

TOL = 5e-6  # float32 rounding of O(1) values over a few hundred products per output (measured ≤ 5e-7)


def _inputs(n, nv, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, nv, dk, generator=gen) * dk ** -0.5
    k = F.normalize(torch.randn(n, nv, dk, generator=gen), dim=-1)
    v = torch.randn(n, nv, dv, generator=gen)
    g = -torch.rand(n, nv, generator=gen) * 2  # log-decay ≤ 0
    beta = torch.rand(n, nv, generator=gen)
    state = torch.randn(nv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state):
    """float64 recurrence: outputs, every state, and δ_t = β (v − (e^g S)ᵀ k)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    deltas = []
    for t in range(q.shape[0]):
        decayed = s * g[t].exp()[:, None, None]
        deltas.append(beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", decayed, k[t])))
        s = decayed + k[t][:, :, None] * deltas[-1][:, None, :]
    o, states = gdn.recurrent_delta_rule(q, k, v, g, beta, state.double(), keep=q.shape[0])
    return o, states, torch.stack(deltas, dim=1)  # δ [nv, n, dv]


@pytest.mark.parametrize("nv,dk,dv", [(4, 16, 32), (16, 128, 128), (3, 24, 40), (2, 16, 80)])
def test_outputs_deltas_and_state_equal_the_recurrence(nv, dk, dv):
    worst = 0.0
    for n in range(1, gdn_native.MAX_TOKENS + 1):
        q, k, v, g, beta, state = _inputs(n, nv, dk, dv, seed=n)
        before = state.clone()
        o, delta, last = gdn_native.delta_rule_tokens(q, k, v, g, beta, state)
        o_ref, states_ref, delta_ref = _reference(q, k, v, g, beta, state)
        assert torch.equal(state, before)  # the state before the batch stays for rollbacks
        errors = (max_abs(o, o_ref), max_abs(delta, delta_ref), max_abs(last, states_ref[-1]))
        worst = max(worst, *errors)
        assert max(errors) <= TOL, (n, errors)
    print(f"\n[native gated delta rule nv={nv} dk={dk} dv={dv}] n = 1..{gdn_native.MAX_TOKENS}: "
          f"max|Δ| vs float64 recurrence {worst:.2e}")


def test_in_place_and_thread_splits_give_the_same_bits():
    q, k, v, g, beta, state = _inputs(5, 8, 64, 64, seed=7)
    o1, d1, last1 = gdn_native.delta_rule_tokens(q, k, v, g, beta, state, threads=1)
    for threads in (2, 3):
        o, d, last = gdn_native.delta_rule_tokens(q, k, v, g, beta, state, threads=threads)
        assert torch.equal(o, o1) and torch.equal(d, d1) and torch.equal(last, last1)
    in_place = state.clone()
    o, d, last = gdn_native.delta_rule_tokens(q, k, v, g, beta, in_place, out=in_place)
    assert last.data_ptr() == in_place.data_ptr()
    assert torch.equal(in_place, last1) and torch.equal(o, o1) and torch.equal(d, d1)


def test_pending_states_rebuild_every_token_state():
    """delta_rule's native path returns PendingStates whose earlier states (built on a rollback
    from the δ vectors) are the recurrence's, and whose last state is the one written to `out`."""
    n, keep = 6, 4
    q, k, v, g, beta, state = _inputs(n, 4, 32, 32, seed=3)
    out = torch.empty_like(state)
    o, pending = gdn.delta_rule(q, k, v, g, beta, state, keep=keep, lazy=True, out=out)
    assert isinstance(pending, gdn.PendingStates) and pending.last is not None
    assert pending.state(keep - 1).data_ptr() == out.data_ptr()
    _, states_ref, _ = _reference(q, k, v, g, beta, state)
    worst = max(max_abs(pending.state(i), states_ref[n - keep + i]) for i in range(keep))
    print(f"\n[native pending states] {keep} kept of {n}: max|Δ| {worst:.2e}")
    assert worst <= TOL


def test_shapes_that_disagree_are_refused():
    q, k, v, g, beta, state = _inputs(2, 4, 8, 8, seed=1)
    with pytest.raises(ValueError, match="do not agree"):
        gdn_native.delta_rule_tokens(q, k, v, g[:, :3], beta, state)


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return load_model(tiny_gguf(tmp_path_factory)[1], device="cpu", dtype="f32")


def test_speculative_rounds_in_float32_roll_back_to_the_plain_run(model32, monkeypatch):
    """Verification batches of k+1 tokens, rejected at every position, against a plain context
    that decoded only the accepted tokens one at a time (both through the native form), and the
    same rounds with the native form off (the torch batched form)."""
    calls = []
    real = gdn_native.delta_rule_tokens
    monkeypatch.setattr(gdn_native, "delta_rule_tokens", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    k = 4
    ids = [int(t) for t in prompt_ids(80, seed=11)]

    def rounds():
        spec = Context(model32, GraphType.MAIN, n_ctx=96, n_rs_seq=k)
        plain = Context(model32, GraphType.MAIN, n_ctx=96, n_rs_seq=0)
        spec.decode(ids[:5])
        plain.decode(ids[:5])
        cursor, worst, logits = 5, 0.0, []
        for j in [2, 0, 4, 1, 3, 0, 2]:
            pos0 = spec.n_past()
            logits.append(spec.decode(ids[cursor:cursor + k + 1]).logits[:j + 1].clone())
            if j < k:
                assert spec.seq_rm(0, pos0 + j + 1)
            for t in ids[cursor:cursor + j + 1]:
                plain.decode([t])
            cursor += j + 1
            for layer in spec.memory.layout.rec_layers:
                for x, y in zip(spec.recurrent_state(0, layer), plain.recurrent_state(0, layer)):
                    worst = max(worst, max_abs(x, y))
        nxt = [ids[cursor]]
        worst = max(worst, max_abs(spec.decode(nxt).logits, plain.decode(nxt).logits))
        return worst, torch.cat(logits)

    worst_native, logits_native = rounds()
    assert calls and max(calls) == k + 1 and 1 in calls  # verification batches and single steps took it
    calls.clear()
    monkeypatch.setenv("SPECCONV_NO_NATIVE_GDN", "1")
    worst_torch, logits_torch = rounds()
    assert not calls
    between = max_abs(logits_native, logits_torch)
    print(f"\n[native gated delta rule, float32 model] rollback vs plain: max|Δ| {worst_native:.2e} "
          f"(torch form {worst_torch:.2e}); native vs torch verification logits {between:.2e}")
    assert worst_native <= 1e-3 and between <= 1e-3


@pytest.mark.parametrize("channels,taps", [(4096, 4), (37, 4), (40, 2)])
def test_causal_conv_equals_the_torch_form(channels, taps, monkeypatch):
    """The native conv sums and the kept windows [keep, K-1, C] against the torch form in float64,
    every n and keep; thread splits give the same bits."""
    gen = torch.Generator().manual_seed(channels)
    weight, state = torch.randn(channels, taps, generator=gen), torch.randn(taps - 1, channels, generator=gen)
    worst = 0.0
    for n in range(1, gdn_native.MAX_TOKENS + 1):
        m = torch.randn(n, channels, generator=gen)
        for keep in sorted({1, n // 2 + 1, n}):
            out, states = gdn.causal_conv(m, state, weight, keep)
            with monkeypatch.context() as off:
                off.setenv("SPECCONV_NO_NATIVE_GDN", "1")
                ref_out, ref_states = gdn.causal_conv(m.double(), state.double(), weight.double(), keep)
            assert states.shape == (keep, taps - 1, channels) and torch.equal(states.double(), ref_states)
            worst = max(worst, max_abs(out, ref_out))
        sums1, states1 = gdn_native.conv_tokens(m, state, weight, n, threads=1)
        sums2, states2 = gdn_native.conv_tokens(m, state, weight, n, threads=2)
        assert torch.equal(sums1, sums2) and torch.equal(states1, states2)
    print(f"\n[native causal conv C={channels} K={taps}] n = 1..{gdn_native.MAX_TOKENS}: max|Δ| vs float64 {worst:.2e}")
    assert worst <= TOL
