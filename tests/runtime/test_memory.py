"""Memory: KV cells, the Gated DeltaNet snapshot ring, checkpoints, several sequences; and the two
Gated DeltaNet forms (docs/reference/speculative.md §5, docs/reference/model-math.md §2.2).

The reference for every rollback is a fresh context that evaluated only the kept tokens, with the
same batch boundaries: its recurrent states (conv window and SSM state of every layer), its
position count and its next logits must equal the rolled-back context's.

These run in float64 compute: in float32, matrix products over batches of different sizes differ
in the last bit, and the tiny random Gated DeltaNet layers amplify that to ~2e-5 (see
test_runtime_parity), which would hide nothing but also prove nothing at 1e-6. In float64 any
wrong slot, window or position shows up as an O(1) difference.
"""

from __future__ import annotations

import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.graphs import gdn
from tests.fixtures.runtime_common import DEVICES, max_abs, prompt_ids, skip_unless_device, tiny_gguf

STATE_TOL = 1e-6
DTYPE = "f64"
K = 6  # tokens evaluated in the "verification" batch


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def model_file(request, tmp_path_factory):
    return tiny_gguf(tmp_path_factory, moe=request.param)[1]


def _state_diff(a: Context, b: Context, seq_a: int = 0, seq_b: int = 0) -> float:
    worst = 0.0
    for layer in a.memory.layout.rec_layers:
        for x, y in zip(a.recurrent_state(seq_a, layer), b.recurrent_state(seq_b, layer)):
            worst = max(worst, max_abs(x, y))
    return worst


def _fresh(model, tokens_batches, **kw) -> Context:
    ctx = Context(model, GraphType.MAIN, n_ctx=128, **kw)
    for batch in tokens_batches:
        if len(batch):
            ctx.decode(batch)
    return ctx


@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_rollback_to_every_position_equals_fresh_evaluation(model_file, device):
    skip_unless_device(device)
    model = load_model(model_file, device=device, dtype=DTYPE)
    ids = prompt_ids(20 + K, seed=1)
    prompt, verify = ids[:20], ids[20:]
    worst_state = worst_logit = 0.0
    for j in range(K):
        ctx = _fresh(model, [prompt, verify], n_rs_seq=K)
        assert ctx.seq_rm(0, 20 + j + 1)  # keep prompt + the first j+1 verified tokens
        assert ctx.n_past(0) == 20 + j + 1
        ref = _fresh(model, [prompt, verify[:j + 1]], n_rs_seq=K)
        worst_state = max(worst_state, _state_diff(ctx, ref))
        nxt = [int(verify[(j + 1) % K])]  # the next evaluation reads the promoted slot
        worst_logit = max(worst_logit, max_abs(ctx.decode(nxt).logits, ref.decode(nxt).logits))
    # rolling back to the prompt alone (all K drafts rejected) is the ring's oldest slot
    ctx = _fresh(model, [prompt, verify], n_rs_seq=K)
    assert ctx.seq_rm(0, 20)
    ref = _fresh(model, [prompt], n_rs_seq=K)
    worst_state = max(worst_state, _state_diff(ctx, ref))
    print(f"\n[snapshot rollback {model.arch} {device}] every j<{K}: max|Δstate| {worst_state:.2e}, "
          f"next-token max|Δlogit| {worst_logit:.2e}")
    assert worst_state <= STATE_TOL and worst_logit <= STATE_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_ring_spans_single_token_steps_and_refuses_beyond(model_file, device):
    skip_unless_device(device)
    model = load_model(model_file, device=device, dtype=DTYPE)
    ids = prompt_ids(16, seed=2)
    ctx = _fresh(model, [ids[:10]] + [[t] for t in ids[10:]], n_rs_seq=4)
    before = [t.clone() for l in ctx.memory.layout.rec_layers for t in ctx.recurrent_state(0, l)]
    assert not ctx.seq_rm(0, 16 - 5)  # 5 back > n_rs_seq = 4: refused, nothing changed
    after = [t for l in ctx.memory.layout.rec_layers for t in ctx.recurrent_state(0, l)]
    assert ctx.n_past(0) == 16 and all(torch.equal(a, b) for a, b in zip(before, after))
    assert ctx.seq_rm(0, 16 - 4)
    ref = _fresh(model, [ids[:10]] + [[t] for t in ids[10:12]], n_rs_seq=4)
    diff = _state_diff(ctx, ref)
    print(f"\n[ring across single-token steps {device}] max|Δstate| {diff:.2e}")
    assert diff <= STATE_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_restore_redecode_equals_fresh_evaluation(model_file, device):
    skip_unless_device(device)
    model = load_model(model_file, device=device, dtype=DTYPE)
    ids = prompt_ids(20 + K, seed=3)
    prompt, verify = ids[:20], ids[20:]
    worst = 0.0
    for j in range(K + 1):
        ctx = _fresh(model, [prompt], rollback="checkpoint")
        saved = ctx.checkpoint(0)
        ctx.decode(verify)
        if j < K:
            assert not ctx.seq_rm(0, 20 + j)  # no snapshots in checkpoint mode
        ctx.restore(0, saved)
        assert ctx.n_past(0) == 20
        if j:
            ctx.decode(verify[:j])
        ref = _fresh(model, [prompt, verify[:j]], rollback="checkpoint")
        worst = max(worst, _state_diff(ctx, ref))
        nxt = [int(ids[0])]
        worst = max(worst, max_abs(ctx.decode(nxt).logits, ref.decode(nxt).logits))
    print(f"\n[checkpoint restore + re-decode {device}] every j≤{K}: max|Δ| (state, next logits) {worst:.2e}")
    assert worst <= STATE_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_sequences_are_independent(model_file, device):
    skip_unless_device(device)
    model = load_model(model_file, device=device, dtype=DTYPE)
    prompts = [prompt_ids(12, seed=s) for s in (4, 5, 6)]
    ctx = Context(model, GraphType.MAIN, n_seq=3, n_ctx=64, n_rs_seq=4)
    # interleave: prompts, then steps in a rotating order, with a rollback on sequence 1
    for s in (2, 0, 1):
        ctx.decode(prompts[s], seq=s)
    got = {s: [] for s in range(3)}
    for step in range(3):
        for s in ((0, 1, 2), (2, 1, 0), (1, 0, 2))[step]:
            got[s].append(ctx.decode([int(prompts[s][step])], seq=s).logits[0])
    assert ctx.seq_rm(1, 12 + 2)  # sequence 1 drops its third step and takes token 7 instead
    got[1][2] = ctx.decode([7], seq=1).logits[0]
    worst = 0.0
    for s in range(3):
        alone = Context(model, GraphType.MAIN, n_ctx=64)
        alone.decode(prompts[s])
        steps = [int(t) for t in prompts[s][:3]]
        if s == 1:
            steps[2] = 7
        for got_logits, t in zip(got[s], steps):
            worst = max(worst, max_abs(got_logits, alone.decode([t]).logits[0]))
    assert ctx.n_past(0) == 15 and ctx.n_past(1) == 15 and ctx.n_past(2) == 15
    print(f"\n[3 sequences vs 3 separate contexts {device}] max|Δlogit| {worst:.2e}")
    assert worst <= STATE_TOL


def test_chunked_and_recurrent_kernels_agree():
    """Random inputs in the model's ranges, 150 tokens (3 chunks, the last partial), non-zero state."""
    gen = torch.Generator().manual_seed(0)
    n, nv, dk, dv = 150, 4, 16, 16
    q = torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=gen), dim=-1)
    v = torch.randn(n, nv, dv, generator=gen)
    g = -16 * torch.rand(n, nv, generator=gen) * torch.rand(n, nv, generator=gen)
    beta = torch.rand(n, nv, generator=gen)
    state = torch.randn(nv, dk, dv, generator=gen)
    o_rec, s_rec = gdn.recurrent_delta_rule(q, k, v, g, beta, state, keep=1)
    o_chk, s_chk = gdn.chunked_delta_rule(q, k, v, g, beta, state)
    d_out, d_state = max_abs(o_rec, o_chk), max_abs(s_rec[-1], s_chk)
    o_mix, s_mix = gdn.delta_rule(q, k, v, g, beta, state, keep=5, mode="chunked")  # chunked head, recurrent tail
    d_mix = max(max_abs(o_mix, o_rec), max_abs(s_mix[-1], s_rec[-1]))
    print(f"\n[GDN kernels f32, {n} tokens] chunked vs recurrent: outputs {d_out:.2e}, final state {d_state:.2e} "
          f"(magnitude {s_rec.abs().max():.1f}); chunked head + recurrent tail {d_mix:.2e}")
    assert d_mix <= 1e-5
    assert d_out <= 1e-5 and d_state <= 1e-5


@pytest.mark.parametrize("decay", [2, 16])
def test_the_chunked_form_is_as_exact_as_the_recurrence(decay):
    """float32 chunked form (150 tokens: 3 chunks) against the float64 recurrence, within 3x the
    float32 recurrence's own error (outputs and every token's state). The decays between tokens come
    from the cumulative log-decay Γ in float64 (gdn.cumulative_log_decay): from float32 Γ they were
    only as exact as ulp(Γ), 30x the recurrence's error with log-decays down to -16 per token, and on
    a GPU that put a MoE model's chunked and recurrent float32 logits 1.45e-3 apart (TF32 was not
    involved: the same logits with cuBLAS and cuDNN held to IEEE float32)."""
    gen = torch.Generator().manual_seed(0)
    n, nv, dk, dv = 150, 4, 16, 16
    q = torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=gen), dim=-1)
    v = torch.randn(n, nv, dv, generator=gen)
    g = -decay * torch.rand(n, nv, generator=gen) * torch.rand(n, nv, generator=gen)
    beta = torch.rand(n, nv, generator=gen)
    state = torch.randn(nv, dk, dv, generator=gen)
    inputs = (q, k, v, g, beta, state)
    exact, exact_states = gdn.recurrent_delta_rule(*(x.double() for x in inputs), keep=n)  # every token's state
    rec_out, rec_states = gdn.recurrent_delta_rule(*inputs, keep=n)
    rec = max(max_abs(rec_out, exact), max_abs(rec_states, exact_states))
    out, last = gdn.chunked_delta_rule(*inputs)
    chunked = max(max_abs(out, exact), max_abs(last, exact_states[-1]))
    print(f"\n[GDN forms f32, log-decays down to -{decay}] max|Δ| from the float64 recurrence: recurrent {rec:.1e}, "
          f"chunked {chunked:.1e}")
    assert chunked <= 3 * rec


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_and_recurrent_model_forms_agree(model_file, device):
    """Whole model, prompt of 100 tokens: exact in float64; float32 printed with its rounding noise."""
    skip_unless_device(device)
    ids = prompt_ids(100, seed=7)
    results = {}
    for dtype in ("f64", "f32"):
        model = load_model(model_file, device=device, dtype=dtype)
        out = {mode: Context(model, GraphType.MAIN, n_ctx=128, gdn_mode=mode).decode(ids).logits
               for mode in ("chunked", "recurrent")}
        results[dtype] = max_abs(out["chunked"], out["recurrent"])
    print(f"\n[GDN forms, whole model {device}] chunked vs recurrent max|Δlogit|: "
          f"float64 {results['f64']:.2e}, float32 {results['f32']:.2e}")
    assert results["f64"] <= 1e-10 and results["f32"] <= 1e-3
