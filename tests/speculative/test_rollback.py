"""Rollback of a verification batch with pending recurrent states (runtime/memory.py, gdn.PendingStates).

A verification of k+1 tokens writes only its last Gated DeltaNet state; a rollback builds the one
state it keeps. Reference for every rollback: a plain context (one held state, token by token, as
`generate` decodes) that evaluated only the accepted tokens. Its Gated DeltaNet states (conv window
and SSM state of every layer), its attention cells (K, V, positions of every attention layer), its
position count and its next logits must equal the speculative context's after rounds of k = 1..8
drafts rejected at every position, over enough rounds that the ring wraps several times.
Float64 compute (as tests/runtime/test_memory.py): any wrong slot, state or cell is an O(1) error.
"""

from __future__ import annotations

import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.graphs import gdn
from tests.fixtures.runtime_common import max_abs, prompt_ids, tiny_gguf

torch.set_num_threads(1)

TOL = 1e-9


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(tiny_gguf(tmp_path_factory)[1], device="cpu", dtype="f64")


def _diff(a: Context, b: Context) -> float:
    worst = 0.0
    mem = a.memory
    for layer in mem.layout.rec_layers:
        for x, y in zip(a.recurrent_state(0, layer), b.recurrent_state(0, layer)):
            worst = max(worst, max_abs(x, y))
    for layer in mem.layout.attn_layers:
        for x, y in zip(mem.cells(0, layer), b.memory.cells(0, layer)):
            worst = max(worst, max_abs(x, y))
    return worst


@pytest.mark.parametrize("k", range(1, 9))
def test_rollback_at_every_position_equals_plain_run_of_accepted_tokens(model, k):
    ids = [int(t) for t in prompt_ids(200, seed=k)]
    spec = Context(model, GraphType.MAIN, n_ctx=160, n_rs_seq=k)
    plain = Context(model, GraphType.MAIN, n_ctx=160, n_rs_seq=0)
    assert spec.memory.layout.rec_layers and spec.memory.layout.attn_layers  # both kinds are checked
    spec.decode(ids[:6])
    plain.decode(ids[:6])
    cursor, worst, rounds = 6, 0.0, 0
    # every accepted count j = 0..k (j = k: all drafts accepted, no rollback), twice, in a shuffled order
    order = [j for j in range(k + 1)] * 2
    order = order[1::2] + order[::2]
    for j in order:
        batch = ids[cursor:cursor + k + 1]
        pos0 = spec.n_past()
        spec.decode(batch)
        if j < k:
            assert spec.seq_rm(0, pos0 + j + 1)
        for t in batch[:j + 1]:
            plain.decode([t])
        cursor += j + 1
        rounds += 1
        assert spec.n_past() == plain.n_past() == pos0 + j + 1
        worst = max(worst, _diff(spec, plain))
    nxt = [ids[cursor]]
    worst_logit = max_abs(spec.decode(nxt).logits, plain.decode(nxt).logits)
    print(f"\n[pending-state rollback k={k}] {rounds} rounds, j = 0..{k}: max|Δ| states and cells {worst:.2e}, "
          f"next logits {worst_logit:.2e}")
    assert worst <= TOL and worst_logit <= TOL


def test_a_verification_writes_only_its_last_state(model, monkeypatch):
    """The point of pending states: k+1 verified tokens write one SSM state per layer, and a
    rollback writes the one it keeps."""
    writes = []
    real = gdn.PendingStates.state
    monkeypatch.setattr(gdn.PendingStates, "state", lambda self, i, out=None: writes.append(i) or real(self, i, out))
    ctx = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=4)
    ctx.decode([3, 4, 5])
    writes.clear()
    ctx.decode([6, 7, 8, 9, 10])
    n_rec = len(ctx.memory.layout.rec_layers)
    assert writes == [4] * n_rec  # the last of 5 kept states, once per recurrent layer
    writes.clear()
    assert ctx.seq_rm(0, 3 + 2)  # keep 2 of the 5
    assert writes == [1] * n_rec


def test_pending_states_whose_start_is_overwritten_are_dropped_not_wrong(model):
    """A batch's pending states start from the state before it; once a later batch writes over that
    slot they are no longer held: seq_rm refuses (False, nothing changed) instead of building a
    wrong state. States written in full stay within reach as before."""
    ids = [int(t) for t in prompt_ids(40, seed=9)]

    def run(batches):
        ctx = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=3)  # 4 states held, 5 slots
        for b in batches:
            ctx.decode(b)
        return ctx

    def plain(n):
        ref = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=0)
        ref.decode(ids[:n])
        return ref

    # positions 0..1 (after 1 written), 2..4 (after 2, 3 pending on the slot of 1; after 4 written), 5
    ctx = run([ids[:2], ids[2:5], [ids[5]]])
    assert ctx.seq_rm(0, 4)  # after 3: pending, its start still intact, built now
    assert _diff(ctx, plain(4)) <= TOL
    # one more step writes over the slot of position 1: the states pending on it are dropped
    ctx = run([ids[:2], ids[2:5], [ids[5]], [ids[6]]])
    held = list(ctx.memory.slot_pos[0])
    assert not ctx.seq_rm(0, 3) and not ctx.seq_rm(0, 4)  # after 2, after 3
    assert ctx.memory.slot_pos[0] == held and ctx.n_past() == 7
    assert ctx.seq_rm(0, 5)  # the state after 4 was written in full
    assert _diff(ctx, plain(5)) <= TOL
