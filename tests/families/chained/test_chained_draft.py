"""Chained MTP drafts, block by block, against the releases' training recursion
(runtime/drafters/mtp_chain.py; docs/reference/model-math.md §12).

The reference (tests/fixtures/chained_reference.py `Reference.chain`) runs transformers' `MtpLayer`
of every block over the whole sequence without a cache: block j on the tokens rolled by j (as
transformers' `MtpModel.forward` rolls them), its hidden rows block j−1's outputs for every row.
Nothing of the runtime's bookkeeping (one cache per block, the states carried between rounds, the
rollback) is shared with it. Checked on tiny release-layout checkpoints with chains of 3 and 4
blocks, per block (logits of the drafted position and the draft token):

* right after the prompt, after plain decode steps told one by one and several at once, and after
  rounds that accepted 0..k drafts (rollback of every block's cache); after prompts of 2 and 3
  tokens, where later blocks' rows begin inside the draft;
* in both row layouts: the releases' (shifted, the default) and llama.cpp's (rows from position 0);
* Hy3 as released, one MTP block reused for every draft position, in the release's rows;
* greedy speculative decoding equals plain greedy decoding at depth 4 and with one reused block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import MtpDrafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures import chained_reference as ref_mod
from tests.fixtures import tiny_chained as tiny

torch.set_num_threads(1)
FAMILIES = ["hy_v3", "step35", "mimo2"]
IDS = [int(x) for x in np.random.default_rng(23).integers(0, tiny.VOCAB - 3, 40)]
TOL = 1e-4
# (drafts accepted) per drafting round, or ("plain", n, at_once): n target steps without drafts, told
# to the drafter one by one or in one call (as the loop's auto mode defers them)
SCHEDULE = ["k", ("plain", 3, False), 0, 1, ("plain", 4, True), "k-1", 2, 0, "k"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("chained-draft")


def _family(family, root, k):
    extra = {} if k == tiny.K_MTP[family] else {"k": k}
    src, files = ref_mod.converted(family, root, **extra)
    return files, ref_mod.reference(src, family)


class _Target:
    """The target's greedy loop, told to a drafter the way runtime/speculative.py tells it."""

    def __init__(self, model, drafter, prompt, n_blocks):
        self.ctx = Context(model, GraphType.MAIN, n_ctx=160, n_rs_seq=n_blocks + 1)
        self.drafter, self.hid = drafter, drafter.target_hidden[0]
        prefix = prompt[:-1]
        drafter.start(prefix, self.ctx.decode(prefix, hidden=(self.hid,), logits=None).hidden[self.hid])
        self.committed, self.id_last = list(prefix), prompt[-1]

    def verify(self, drafts, accept: int):
        """Evaluate [id_last] + drafts, keep `accept` drafts (chosen, not judged), tell the drafter."""
        batch, pos0 = [self.id_last] + list(drafts), self.ctx.n_past()
        out = self.ctx.decode(batch, hidden=(self.hid,))
        self.ctx.seq_rm(0, pos0 + accept + 1)
        self.drafter.accept(accept, batch, out.hidden[self.hid])
        self.committed += batch[:accept + 1]
        self.id_last = int(out.logits[accept].argmax())

    def plain(self, n: int, at_once: bool):
        tokens, rows = [], []
        for _ in range(n):
            out = self.ctx.decode([self.id_last], hidden=(self.hid,))
            if at_once:
                tokens.append(self.id_last)
                rows.append(out.hidden[self.hid])
            else:
                self.drafter.accept(0, [self.id_last], out.hidden[self.hid])
            self.committed.append(self.id_last)
            self.id_last = int(out.logits[-1].argmax())
        if at_once:
            self.drafter.accept(len(tokens) - 1, tokens, torch.cat(rows))


def _rounds(ref, family, model, k, layout, schedule, prompt=IDS[:14]):
    """Per-block worst |Δlogit| of the drafted position over the schedule's rounds, and the rounds."""
    drafter = MtpDrafter(model, 160, model, layout=layout)
    assert drafter.n_blocks == k and drafter.layout == (layout or "shifted")
    target = _Target(model, drafter, prompt, k)
    worst, log = np.zeros(k), []
    for step in schedule:
        if isinstance(step, tuple):
            target.plain(step[1], step[2])
            log.append(step)
            continue
        _, h = ref.trunk(target.committed)
        want, want_logits = ref.chain(target.committed, h, target.id_last, k, tiny.FAMILIES[family].chain,
                                      layout or "shifted")
        draft = drafter.draft(target.id_last, k + 2)  # more than k asked: a block is never reused
        got = torch.stack(drafter.last_draft_logits).numpy()
        assert draft.tokens == want, f"after {log}: drafts {draft.tokens} != reference {want}"
        worst = np.maximum(worst, np.abs(got - want_logits).max(axis=1))
        accept = {"k": k, "k-1": k - 1}.get(step, step)
        target.verify(draft.tokens, accept)
        log.append((len(draft.tokens), accept))
        assert drafter.committed_rows() == len(target.committed)
    return worst, log


@pytest.mark.parametrize("k", [3, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_block_equals_the_recursion_over_rounds(root, family, k):
    files, ref = _family(family, root, k)
    model = load_model(files["embed"], device="cpu")
    worst, log = _rounds(ref, family, model, k, None, SCHEDULE)
    print(f"{family}, {k} blocks, release rows: drafts equal the recursion in every round {log}; "
          f"max |Δlogit| per block {[f'{x:.2g}' for x in worst]}")
    assert worst.max() < TOL


@pytest.mark.parametrize("layout", [None, "llama.cpp"])
@pytest.mark.parametrize("n_prompt", [2, 3])
def test_short_prompts_where_blocks_begin_late(root, n_prompt, layout):
    """Prompts of 2 and 3 tokens: in the release's rows block j has no row before position j + 1,
    so the first rounds draft with blocks whose rows begin inside the draft (hy_v3, full attention)."""
    files, ref = _family("hy_v3", root, 4)
    model = load_model(files["embed"], device="cpu")
    worst, log = _rounds(ref, "hy_v3", model, 4, layout, [0, 1, "k"], prompt=IDS[:n_prompt])
    print(f"hy_v3, 4 blocks, {n_prompt}-token prompt, {layout or 'shifted'} rows: drafts equal the recursion "
          f"over {log}; max |Δlogit| per block {[f'{x:.2g}' for x in worst]}")
    assert worst.max() < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_layout_equals_its_recursion(root, family):
    """The other layout (every block's rows from position 0, a zero state there) is the recursion
    too; on full-attention blocks (hy_v3; step35's blocks 0 and 2) it drafts other logits."""
    files, ref = _family(family, root, 3)
    model = load_model(files["embed"], device="cpu")
    worst, log = _rounds(ref, family, model, 3, "llama.cpp", SCHEDULE[:4])
    committed, h = IDS[:20], ref.trunk(IDS[:20])[1]
    chain = tiny.FAMILIES[family].chain
    shifted = ref.chain(committed, h, IDS[20], 3, chain, "shifted")[1]
    llama = ref.chain(committed, h, IDS[20], 3, chain, "llama.cpp")[1]
    apart = np.abs(shifted - llama).max(axis=1)
    print(f"{family}, llama.cpp rows: drafts equal the recursion in every round {log}; max |Δlogit| per block "
          f"{[f'{x:.2g}' for x in worst]}; the two layouts' logits apart by {[f'{x:.2g}' for x in apart]}")
    assert worst.max() < TOL
    if family == "hy_v3":
        assert apart.min() > 0.01


def test_hy3_one_block_reused_in_the_release_rows(root):
    """Hy3-preview ships one MTP layer; the drafter reuses it for every draft position (feeding back
    its post-norm output, as vLLM and SGLang do), on the release's rows (no zero-state row 0)."""
    files, ref = _family("hy_v3", root, 1)
    model = load_model(files["embed"], device="cpu")
    drafter = MtpDrafter(model, 160, model)
    assert drafter.n_blocks == 1 and drafter.layout == "shifted"
    target = _Target(model, drafter, IDS[:14], 1)
    worst, apart = 0.0, 0.0
    for accept in [3, 0, 1, 2]:
        _, h = ref.trunk(target.committed)
        draft = drafter.draft(target.id_last, 3)
        got = torch.stack([row for row in _reused_logits(drafter, target, draft.tokens)]).numpy()
        want, want_logits = _reused_reference(ref, target.committed, h, target.id_last, 3, "shifted")
        _, llama_logits = _reused_reference(ref, target.committed, h, target.id_last, 3, "llama.cpp")
        assert draft.tokens == want
        worst = max(worst, float(np.abs(got - want_logits).max()))
        apart = max(apart, float(np.abs(llama_logits - want_logits).max()))
        target.verify(draft.tokens, accept)
    print(f"hy_v3, one reused block: drafts equal the release-row reference, max |Δlogit| {worst:.2g}; "
          f"llama.cpp's rows would move them by {apart:.2g}")
    assert worst < TOL and apart > 0.01


def _reused_logits(drafter, target, tokens):
    """The one-block drafter's logits of each draft position, recomputed on a fresh drafter with the
    same committed rows (the draft call itself keeps none)."""
    fresh = MtpDrafter(drafter.head, 160, drafter.head)
    hid = drafter.target_hidden[0]
    h = Context(drafter.head, GraphType.MAIN, n_ctx=160).decode(target.committed, hidden=(hid,)).hidden[hid]
    fresh.start(target.committed, h)
    rows, token, state = [], target.id_last, fresh.pending_h
    for i, nxt in enumerate(tokens):
        out = fresh.ctx.decode([token], positions=[len(target.committed) + i], hidden_in=state[None])
        rows.append(out.logits[-1])
        token, state = nxt, out.hidden["nextn"][-1]
    return rows


def _reused_reference(ref, committed, hidden, id_last, n, layout):
    """Block 0 reused: each draft row is (d_i, block 0's own post-norm output one row back), after
    the committed rows of the layout; whole sequence, no cache."""
    x = list(committed) + [id_last]
    hidden = np.asarray(hidden, np.float32)
    if layout == "shifted":
        toks, pos, rows = x[1:], list(range(1, len(x))), hidden
    else:
        toks, pos, rows = x, list(range(len(x))), np.concatenate([np.zeros((1, hidden.shape[1]), np.float32), hidden])
    drafts, logits = [], []
    for _ in range(n):
        lg, post, _ = ref.block(0, toks, rows, pos)
        drafts.append(int(np.argmax(lg[-1])))
        logits.append(lg[-1])
        toks, pos, rows = toks + drafts[-1:], pos + [pos[-1] + 1], np.concatenate([rows, post[-1:]])
    return drafts, np.stack(logits)


@pytest.mark.parametrize("family,k", [("hy_v3", 4), ("step35", 4), ("mimo2", 4), ("hy_v3", 1)])
@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_greedy_speculation_equals_plain(root, family, k, rollback):
    files, _ = _family(family, root, k)
    model = load_model(files["embed"], device="cpu")
    plain = generate(model, IDS[:12], 14).tokens
    res = speculative_generate(model, MtpDrafter(model, 64, model), IDS[:12], 14,
                               SpecConfig(draft_max=5, rollback=rollback))
    s = res.stats["speculative"]
    print(f"{family}, {k} block(s), {rollback}: spec == plain {res.tokens == plain}; drafted {s['drafted']}, "
          f"accepted {s['accepted']}, per block {[(b['block'], b['accepted'], b['drafted']) for b in s['per_block']]}")
    assert res.tokens == plain and s["drafted"] > 0
    assert max(len(r["drafted"]) for r in res.stats["rounds"]) == (k if k > 1 else 5)
