"""MTP heads' draft steps and catch-up batches replayed as CUDA graphs, and greedy drafting with no
host read per draft (runtime/step_graphs.py, runtime/drafters/mtp.py; docs/runtime.md "CUDA graphs").

On the CPU with tests/fixtures/capture_standin.py's stand-in for the capture (a replay runs the
recorded forward again, so a host value baked into it at capture would be stale). Checked:

* an MTP context's draft steps (width 1, from the second on fed the previous step's argmax as a
  device tensor, `decode(ids_on_device=True)`) and catch-up batches (widths 1..k+1) over rounds with
  rollbacks give the logits and both hidden states of eager decoding (fed host ids) bit for bit,
  float32 and bfloat16; each width is captured once; the same for every captured family's head,
  whose replays on `meta` read nothing;
* the chained heads (one context per block): the drafts and each block's logits equal eager ones;
* greedy speculative decoding with the bundled trained head (drafts accepted: catch-ups of every
  width), k = 1..3, gives the tokens of eager speculative decoding and of plain decoding (bfloat16);
* on `meta`, rounds of target verification and greedy drafting read nothing on the host and make no
  blocking host-to-device copy;
* host reads per round (tests/fixtures/host_reads.py): target verification + MTP draft of k = 3
  reads the host twice (the k draft ids once, the verification's argmax once), one-block and
  chained heads, with and without graphs; with `p_min` each draft step reads twice (documented:
  ≤ 3 needs p_min = 0);
* ids taken unread that cannot be ids are refused with a one-line error;
* on a GPU, the real capture: MTP replays equal eager decoding, speculative output equals plain.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"

from specconv.runtime import Context, GraphType, load_model, speculative as spec_module, step_graphs  # noqa: E402
from specconv.runtime.drafters import MtpDrafter  # noqa: E402
from specconv.runtime.drafters.mtp import greedy_on_device  # noqa: E402
from specconv.runtime.generate import generate  # noqa: E402
from specconv.runtime.speculative import SpecConfig, speculative_generate  # noqa: E402
from tests.fixtures.capture_standin import K  # noqa: E402
from tests.fixtures.host_reads import HostReads  # noqa: E402
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf  # noqa: E402
from tests.runtime.test_cuda_graphs_families import FAMILIES, files  # noqa: E402, F401

torch.set_num_threads(1)
ROUNDS = [1, 3, 0, 2, 2, 0, 3, 1, 0, 0]  # drafts accepted per round: the catch-up is j + 1 rows
PROMPT = 5


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    return tiny_gguf(tmp_path_factory, outtype="q8_0")[1]


def _head_rounds(ctx: Context, ids, rows, rounds, on_device: bool):
    """A prompt's catch-up, then per round K draft steps (each from the previous one's argmax and
    normed output; from the second on, the argmax fed as a device tensor if `on_device`, else as a
    host id), the draft rows removed and the catch-up of j + 1 teacher-forced rows: every output
    (logits, nextn, pre_norm) in order, and how many calls each width had."""
    out, widths = [], Counter()

    def run(tokens, pos, hidden_in):
        o = ctx.decode(tokens, positions=pos, hidden_in=hidden_in, logits="all",
                       ids_on_device=isinstance(tokens, torch.Tensor))
        out.extend([o.logits, o.hidden["nextn"], o.hidden["pre_norm"]])
        widths[len(pos)] += 1
        return o

    run(ids[:PROMPT], list(range(PROMPT)), rows[:PROMPT])
    for j in rounds:
        pos0 = ctx.n_past()
        token, h = [ids[pos0]], rows[pos0]
        for i in range(K):
            o = run(token, [pos0 + i], h.reshape(1, -1))
            token = o.logits.argmax(-1) if on_device else [int(o.logits[-1].argmax())]
            h = o.hidden["nextn"][-1]
        assert ctx.seq_rm(0, pos0)
        run(ids[pos0:pos0 + j + 1], list(range(pos0, pos0 + j + 1)), rows[pos0:pos0 + j + 1])
    return out, widths


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_replayed_mtp_steps_and_catch_ups_give_eager_outputs(q8_file, graphable, dtype):
    model = load_model(q8_file, device="cpu", dtype=dtype)
    ids = [int(t) for t in prompt_ids(60, seed=41)]
    gen = torch.Generator().manual_seed(41)
    rows = torch.randn(len(ids), model.hparams.input_width, generator=gen).to(model.dtype)
    graphed = Context(model, GraphType.MTP, n_ctx=len(ids))
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MTP, n_ctx=len(ids))
    assert graphed.graphs is not None and eager.graphs is None
    got, widths = _head_rounds(graphed, ids, rows, ROUNDS, on_device=True)
    ref, _ = _head_rounds(eager, ids, rows, ROUNDS, on_device=False)
    stats = graphed.graphs
    delta = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref))
    print(f"\n[MTP graphs, {dtype}] widths used {dict(sorted(widths.items()))}: {stats.captures} captures, "
          f"{stats.replays} replays; max |Δ| (logits, nextn, pre_norm) vs eager {delta:.1e}")
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    captured = sorted(n for n, c in widths.items() if c >= 2)  # the first call warms up, the second captures
    assert sorted(n for (n, _), w in stats.widths.items() if w.graph is not None) == captured
    assert stats.captures == len(captured) and stats.replays == sum(c - 2 for c in widths.values() if c >= 2)
    assert 1 in captured and K + 1 in captured


@pytest.mark.parametrize("family", ["step35", "mimo2"])
def test_chained_heads_replay_their_blocks_like_eager_drafting(graphable, tmp_path_factory, family):
    """One graphed context per block: the drafts and each block's logits of the drafted position equal
    eager drafting's over rounds that accept 0..k drafts."""
    from tests.fixtures import chained_reference

    files = chained_reference.converted(family, tmp_path_factory.mktemp(f"graphs-{family}"))[1]
    model = load_model(files["embed"], device="cpu", dtype="bf16")
    ids = [int(t) for t in prompt_ids(40, seed=43)]

    def drive():
        drafter = MtpDrafter(model, 64, model)
        target = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=drafter.n_blocks + 1)
        hid = drafter.target_hidden[0]
        drafter.start(ids[:6], target.decode(ids[:6], hidden=(hid,), logits=None).hidden[hid])
        cursor, drafts, logits = 6, [], []
        for j in (3, 0, 1, 2, 3, 0, 2):
            d = drafter.draft(ids[cursor], drafter.n_blocks, 0.0)
            drafts.append(d.tokens)
            logits += drafter.last_draft_logits
            batch = ids[cursor:cursor + drafter.n_blocks + 1]
            out = target.decode(batch, hidden=(hid,))
            target.seq_rm(0, target.n_past() - len(batch) + j + 1)
            drafter.accept(j, batch, out.hidden[hid])
            cursor += j + 1
        return drafter, drafts, torch.stack(logits)

    drafter, drafts, got = drive()
    with step_graphs.cuda_graphs("off"):
        _, eager_drafts, ref = drive()
    graphs = [ctx.graphs for ctx in drafter.chain.ctxs]
    print(f"\n[chained MTP graphs, {family}, {drafter.n_blocks} blocks] captures per block "
          f"{[g.captures for g in graphs]}, replays {[g.replays for g in graphs]}; max |Δlogit| vs eager "
          f"{float((got.float() - ref.float()).abs().max()):.1e}")
    assert drafts == eager_drafts and torch.equal(got, ref)
    assert all(g.captures > 0 and g.replays > 0 for g in graphs)


@pytest.mark.parametrize("graph_name", sorted(FAMILIES))
def test_every_family_head_replays_like_eager_and_reads_nothing_on_meta(files, graphable, graph_name):
    """The MTP head of every captured family whose fixture has one (the nextn block through each
    family's own attention: MLA, DSA, sliding windows...): replays equal eager decoding bit for bit
    in bfloat16, and on `meta` every width's warm-up, capture and replays read nothing."""
    path, prompt = files(graph_name)
    model = load_model(path, device="cpu", dtype="bf16")
    if GraphType.MTP not in model.serves:
        pytest.skip(f"the {graph_name} fixture has no MTP head")
    ids = (prompt * 8)[:40]
    rows = torch.randn(len(ids), model.hparams.input_width, generator=torch.Generator().manual_seed(47))
    rows = rows.to(model.dtype)
    graphed = Context(model, GraphType.MTP, n_ctx=len(ids))
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MTP, n_ctx=len(ids))
    got, widths = _head_rounds(graphed, ids, rows, ROUNDS[:6], on_device=True)
    ref, _ = _head_rounds(eager, ids, rows, ROUNDS[:6], on_device=False)
    delta = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, ref))
    print(f"\n[{graph_name} MTP head + graphs, bf16] {graphed.graphs.captures} captures, {graphed.graphs.replays} "
          f"replays; max |Δ| vs eager {delta:.1e}")
    assert all(torch.equal(x, y) for x, y in zip(got, ref))
    assert graphed.graphs.captures == sum(c >= 2 for c in widths.values())
    meta = load_model(path, device="meta", dtype="bf16")
    ctx = Context(meta, GraphType.MTP, n_ctx=len(ids))
    _head_rounds(ctx, ids, rows.to("meta"), ROUNDS[:6], on_device=True)
    assert ctx.graphs.captures == graphed.graphs.captures and ctx.graphs.replays == graphed.graphs.replays


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The bundled trained model, whose MTP head's drafts are accepted (catch-ups of every width)."""
    from specconv.demo.bundled import bundled_model_dir
    from tests.fixtures.gguf_files import convert_gguf

    out = convert_gguf(bundled_model_dir(), tmp_path_factory.mktemp("bundled") / "tiny.gguf", mtp="embed")
    model = load_model(out, device="cpu", dtype="bf16")
    return model, model.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_speculative_with_a_graphed_head_equals_eager_and_plain(trained, graphable, k):
    model, prompt = trained
    n = 24

    def run():
        drafter = MtpDrafter(model, len(prompt) + n + k + 2, model)
        res = speculative_generate(model, drafter, prompt, n, SpecConfig(draft_max=k))
        return res.tokens, res.stats["rounds"], drafter.ctx.graphs

    spec, rounds, graphs = run()
    with step_graphs.cuda_graphs("off"):
        eager, eager_rounds, _ = run()
        plain = generate(model, prompt, n).tokens
    accepted = Counter(r["accepted"] for r in rounds)
    widths = sorted(w for (w, _), g in graphs.widths.items() if g.graph is not None)
    print(f"\n[graphed MTP head, bf16, k={k}] head widths captured {widths}, {graphs.replays} replays; rounds by "
          f"drafts accepted {dict(sorted(accepted.items()))}")
    assert spec == eager == plain and rounds == eager_rounds
    assert sum(r["accepted"] for r in rounds) > 0 and 1 in widths and graphs.replays > 0


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_graphed_rounds_read_and_upload_nothing_on_the_meta_device(q8_file, graphable, dtype, graphs):
    """Rounds of target verification (K + 1 rows, rolled back) and greedy MTP drafting fed each step's
    argmax, with every width's warm-up, capture and replays, run on `meta`, where any host read
    raises; and no blocking host-to-device copy (on CUDA a sync: ids and positions go up pinned,
    without blocking). Only the two reads of a round are left out: the draft ids and the verification's
    argmax. Eagerly ("off") the same: a batch's slot indices go up pinned, without blocking."""
    model = load_model(q8_file, device="meta", dtype=dtype)
    with step_graphs.cuda_graphs(graphs):
        target = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=K)
        drafter = MtpDrafter(model, 64, model)
    prompt = list(range(5, 13))
    drafter.start(prompt, target.decode(prompt).hidden["post_norm"])
    with HostReads() as reads:
        for j in (1, 3, 0, 2, 1, 3, 2, 0):
            pos0 = target.n_past()
            assert drafter.n_committed == pos0
            ids = greedy_on_device(drafter.ctx, 7, drafter.pending_h, range(pos0, pos0 + K))
            assert ids.shape == (K,) and ids.device.type == "meta"
            batch = list(range(20, 21 + K))
            out = target.decode(batch)
            assert target.seq_rm(0, pos0 + j + 1)
            drafter.accept(j, batch, out.hidden["post_norm"])
    print(f"\n[meta, {dtype}, graphs {graphs}] {reads.count} host reads, {reads.uploads} blocking uploads {reads.sites}")
    assert reads.count == 0 and reads.uploads == 0
    if graphs == "off":
        assert drafter.ctx.graphs is None and target.graphs is None
        return
    head = drafter.ctx.graphs
    widths = sorted(n for (n, _), w in head.widths.items() if w.graph is not None)
    print(f"MTP widths {widths} captured ({head.captures}), {head.replays} replays; target "
          f"{target.graphs.captures} captures")
    assert widths == list(range(1, K + 2)) and head.replays > K + 1 and target.graphs.replays > 0


def _reads_per_round(monkeypatch) -> list[tuple[int, list[str], int]]:
    """(host reads, where, drafts) of every speculative round run after this call."""
    per, real = [], spec_module.speculative_round

    def counted(*args, **kwargs):
        with HostReads() as reads:
            r = real(*args, **kwargs)
        per.append((reads.count, reads.sites, len(r.drafts)))
        return r

    monkeypatch.setattr(spec_module, "speculative_round", counted)
    return per


@pytest.mark.parametrize("head", ["qwen35", "step35"])
@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_round_of_k3_mtp_drafts_reads_the_host_twice(q8_file, graphable, tmp_path_factory, monkeypatch, mode, head):
    """Verification + greedy MTP draft of k = 3 (one block reused, or three chained blocks): the draft
    ids read once, the verification's argmax once (≤ 3, issue 33's goal), with graphs and eagerly;
    with p_min each draft step reads its probability and its argmax."""
    if head == "qwen35":
        path = q8_file
    else:
        from tests.fixtures import chained_reference

        path = chained_reference.converted(head, tmp_path_factory.mktemp(f"reads-{head}"))[1]["embed"]
    model = load_model(path, device="cpu", dtype="bf16")
    prompt = [int(t) for t in prompt_ids(9, seed=2)]
    per = _reads_per_round(monkeypatch)
    counts = {}
    for p_min in (0.0, 0.05):
        per.clear()
        with step_graphs.cuda_graphs(mode):
            drafter = MtpDrafter(model, 64, model)
            speculative_generate(model, drafter, prompt, 16, SpecConfig(draft_max=K, p_min=p_min))
        full = [(reads, sites) for reads, sites, n in per if n == K]
        assert full, "no round drafted k tokens"
        counts[p_min] = Counter(reads for reads, _ in full)
        if p_min == 0:
            ctxs = drafter.chain.ctxs if drafter.chain else [drafter.ctx]
            print(f"\n[host reads per round, {head} head ({len(ctxs)} context(s)), graphs {mode}, k={K}] "
                  f"{dict(counts[p_min])} over {len(full)} rounds; sites {full[0][1]}")
            assert set(counts[p_min]) == {2} and (mode == "off" or all(c.graphs.replays > 0 for c in ctxs))
    print(f"[host reads per round with p_min = 0.05] {dict(counts[0.05])}")
    assert set(counts[0.05]) == {2 * K + 1}


@pytest.mark.skipif(not ON_GPU, reason="the real capture needs a GPU")
def test_cuda_graphs_of_the_mtp_head_on_the_gpu(q8_file):
    """torch.cuda.CUDAGraph itself: the head's replays equal eager decoding bit for bit and greedy
    speculative decoding with it equals plain decoding, in bfloat16."""
    model = load_model(q8_file, device="cuda", dtype="bf16")
    ids = [int(t) for t in prompt_ids(60, seed=45)]
    rows = torch.randn(len(ids), model.hparams.input_width, generator=torch.Generator().manual_seed(45))
    rows = rows.to(device="cuda", dtype=model.dtype)
    graphed = Context(model, GraphType.MTP, n_ctx=len(ids))
    got, _ = _head_rounds(graphed, ids, rows, ROUNDS[:6], on_device=True)
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MTP, n_ctx=len(ids))
    ref, _ = _head_rounds(eager, ids, rows, ROUNDS[:6], on_device=False)
    assert graphed.graphs.captures >= 2 and not graphed.graphs.failed
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    prompt = [int(t) for t in prompt_ids(9, seed=46)]
    plain = generate(model, prompt, 32).tokens
    drafter = MtpDrafter(model, len(prompt) + 32 + K + 2, model)
    spec = speculative_generate(model, drafter, prompt, 32, SpecConfig(draft_max=K))
    print(f"\n[MTP head graphs on {torch.cuda.get_device_name(0)}] replays = eager; head captures "
          f"{drafter.ctx.graphs.captures}, replays {drafter.ctx.graphs.replays}")
    assert spec.tokens == plain and drafter.ctx.graphs.replays > 0


def test_decode_refuses_device_ids_it_cannot_take_unread(q8_file):
    """Device ids go in unread, so what cannot be one (a list, a matrix, floats, ids on another device,
    nothing) is refused with a one-line error before anything is evaluated."""
    from specconv.archs.errors import SpecconvError

    model = load_model(q8_file, device="meta", dtype="f32")
    ctx = Context(model, GraphType.MTP, n_ctx=8)
    row = torch.zeros(1, model.hparams.input_width, device="meta")
    for bad, why in (([3], "one-dimensional int64 tensor"), (torch.zeros(1, 1, dtype=torch.long, device="meta"),
                     "one-dimensional"), (torch.zeros(1, device="meta"), "int64"),
                     (torch.zeros(0, dtype=torch.long, device="meta"), "non-empty"),
                     (torch.zeros(1, dtype=torch.long), "token ids on cpu, the model on meta")):
        with pytest.raises(SpecconvError, match=why):
            ctx.decode(bad, [0], hidden_in=row, ids_on_device=True)
    assert ctx.n_past() == 0 and ctx.n_decode_calls == 0
    out = ctx.decode(torch.zeros(1, dtype=torch.long, device="meta"), [0], hidden_in=row, ids_on_device=True)
    assert out.logits.shape == (1, model.vocab_size) and ctx.n_past() == 1
