"""runtime/context_pool.py: generate() and speculative_generate() reuse a model's contexts that replay
graphs (the capture plumbing on the CPU: tests/fixtures/capture_standin.py, mode "on").

Evidence: a second call takes the first call's context, its graphs already captured (no capture
more), and gives the tokens and logits of a new context; a context in use is never handed out
twice; nothing is pooled where contexts do not replay (the CPU's "auto"); `release` drops the pool.
"""

from __future__ import annotations

import pytest
import torch

from specconv.runtime import Context, GraphType, load_model, step_graphs
from specconv.runtime import context_pool
from specconv.runtime.context_pool import pooled, pooled_cells
from specconv.runtime.drafters.synthetic import SyntheticDrafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    return tiny_gguf(tmp_path_factory, outtype="q8_0")[1]


def test_cells_are_powers_of_two_of_at_least_256():
    assert [pooled_cells(n) for n in (1, 200, 256, 257, 1000, 4096, 4097)] == [256, 256, 256, 512, 1024, 4096, 8192]


def test_plain_and_speculative_spans_get_one_buffer_size():
    """A plain call over a span asks span + 1 positions, a speculative one span + k + 2: the same
    cells for every k up to the CLI's 64, at every span, so the attention kernel cuts both buffers
    alike (at the old rule, spans just under a power of two got two sizes)."""
    for span in list(range(1, 3000, 7)) + [190, 254, 255, 446, 510, 511, 4030, 4094]:
        plain = pooled_cells(span + 1, span)
        assert all(pooled_cells(span + k + 2, span) == plain for k in (1, 3, 8, 16, 64)), span
        assert plain >= span + 66


def test_on_a_device_without_graphs_the_span_decides_too(q8_file):
    """Where contexts do not replay and the device is not the CPU (a GPU with --no-cuda-graphs; the
    meta device here), nothing is pooled but the buffers still follow the span."""
    model = load_model(q8_file, device="meta", dtype="bf16")
    sizes = set()
    for n_ctx, n_rs_seq in ((20 + 1, 0), (20 + 3 + 2, 3)):
        with pooled(model, GraphType.MAIN, n_ctx, n_rs_seq, span=20) as ctx:
            assert ctx.graphs is None
            sizes.add(ctx.n_ctx)
    assert sizes == {pooled_cells(21, 20)} and "_context_pool" not in model.__dict__


def test_calls_reuse_the_context_and_its_graphs(q8_file, graphable):
    model = load_model(q8_file, device="cpu", dtype="bf16")
    prompts = [[int(t) for t in prompt_ids(12, seed=s)] for s in (3, 4)]
    with step_graphs.cuda_graphs("off"):
        fresh = [generate(model, p, 10).tokens for p in prompts]
    used = []
    with pooled(model, GraphType.MAIN, 40, 0, rollback="checkpoint") as ctx:
        used.append(ctx)
    first = generate(model, prompts[0], 10)
    captures = used[0].graphs.captures
    assert captures > 0  # the first call captured its widths in the pooled context
    second = generate(model, prompts[1], 10)
    with pooled(model, GraphType.MAIN, 40, 0, rollback="checkpoint") as ctx:
        assert ctx is used[0] and ctx.n_past() == 0 and ctx.n_decode_calls == 0
    assert used[0].graphs.captures == captures  # the second call replayed what the first captured
    assert [first.tokens, second.tokens] == fresh
    assert second.target_evaluations == first.target_evaluations  # counted per call, not per context


def test_speculative_calls_reuse_theirs_and_equal_plain(q8_file, graphable):
    model = load_model(q8_file, device="cpu", dtype="bf16")
    prompt = [int(t) for t in prompt_ids(12, seed=5)]
    plain = generate(model, prompt, 12).tokens
    runs = [speculative_generate(model, SyntheticDrafter(prompt + plain, model.vocab_size, 0.6, seed=s), prompt, 12,
                                 SpecConfig(draft_max=3)) for s in (1, 2, 3)]
    pool = model.__dict__["_context_pool"]
    keys = sorted(pool, key=str)
    print(f"\n[pool] {len(pool)} contexts kept: {keys}")
    assert all(r.tokens == plain for r in runs)
    assert len(pool) == 2  # one plain (checkpoint) context, one speculative (snapshot ring of 3)
    assert {k[2] for k in pool} == {0, 3}
    assert len({k[1] for k in pool}) == 1  # over one span: buffers of one size


def test_a_reused_context_gives_the_bits_of_a_new_one(q8_file, graphable):
    """Logits of a prompt and a verification in a context a previous call filled and cleared, against
    a new context of the same cells."""
    model = load_model(q8_file, device="cpu", dtype="f32")
    ids = [int(t) for t in prompt_ids(20, seed=6)]
    generate(model, [int(t) for t in prompt_ids(30, seed=7)], 8)  # fills the pooled context
    with pooled(model, GraphType.MAIN, 40, 0, rollback="checkpoint") as reused:
        assert reused.graphs.captures > 0
        got = torch.cat([reused.decode(ids[:16]).logits, reused.decode(ids[16:17]).logits])
    new = Context(model, GraphType.MAIN, n_ctx=pooled_cells(40), n_rs_seq=0, rollback="checkpoint")
    want = torch.cat([new.decode(ids[:16]).logits, new.decode(ids[16:17]).logits])
    assert torch.equal(got, want)


def test_a_context_in_use_is_not_handed_out_twice(q8_file, graphable):
    model = load_model(q8_file, device="cpu", dtype="bf16")
    with pooled(model, GraphType.MAIN, 30, 3) as outer:
        with pooled(model, GraphType.MAIN, 30, 3) as inner:
            assert inner is not outer
    with pooled(model, GraphType.MAIN, 30, 3) as again:
        assert again in (inner, outer)  # the last given back is kept, one per key
    context_pool.release(model)
    with pooled(model, GraphType.MAIN, 30, 3) as after:
        assert after is not again


def test_nothing_is_pooled_where_contexts_do_not_replay(q8_file):
    model = load_model(q8_file, device="cpu", dtype="bf16")
    with pooled(model, GraphType.MAIN, 30, 3) as first:
        assert first.graphs is None and first.n_ctx == 30  # the CPU's "auto": exactly the cells asked for
    with pooled(model, GraphType.MAIN, 30, 3) as second:
        assert second is not first
    generate(model, [5, 6, 7], 4)
    assert "_context_pool" not in model.__dict__
