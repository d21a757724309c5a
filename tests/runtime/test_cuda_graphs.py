"""Decode steps and verification batches replayed as CUDA graphs (runtime/step_graphs.py).

Without a GPU the plumbing runs on the CPU with a stand-in for the capture (`RecordingCapture`): a
"graph" that replays by running the recorded forward again and writing its results into the
tensors the capture returned, as a real replay's kernels do. The recorded forward is built once, at
capture, from the width's static buffers, so a host value baked into it (a cell offset, a slot, a
position) would be stale at the next replay and show as wrong logits. Checked:

* replayed steps and verifications give the logits of eager `Context.decode` bit for bit (the
  same backend with and without graphs), over many rounds with rollbacks at every position, and
  greedy plain and speculative decoding the same tokens; each width is captured once and replayed;
  the static buffers and outputs keep their storage from replay to replay;
* the captured region reads nothing on the host: on the `meta` device (tests/runtime/test_backend.py's
  guard), and a forward that reads a host integer of the batch fails instead of being captured;
* a capture that fails leaves the context decoding eagerly with a one-line warning;
* the CUDA backend's own path (its Triton kernels, in the interpreter without a GPU) under the stand-in;
* on a GPU, the real capture: replays equal eager decoding and speculative output equals plain.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.fixtures.triton_mode import ON_GPU  # noqa: E402 (no GPU: the interpreter)

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import Context, GraphType, backend as backend_module, load_model, step_graphs  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.drafters import MtpDrafter  # noqa: E402
from specconv.runtime.drafters.synthetic import SyntheticDrafter  # noqa: E402
from specconv.runtime.generate import generate  # noqa: E402
from specconv.runtime.speculative import SpecConfig, speculative_generate  # noqa: E402
from tests.fixtures.capture_standin import (  # noqa: E402
    K, PROMPT, ROUNDS, Graphable, RecordingCapture, rounds as _rounds, steps as _steps,
)
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def q8_file(request, tmp_path_factory):
    return tiny_gguf(tmp_path_factory, moe=request.param, outtype="q8_0")[1]


def _pointers(ctx: Context) -> dict:
    return {key: (w.buffer.data_ptr(), [t.data_ptr() for t in w.outputs])
            for key, w in ctx.graphs.widths.items() if w.graph is not None}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_replayed_steps_give_the_logits_of_eager_decoding(q8_file, graphable, dtype):
    model = load_model(q8_file, device="cpu", dtype=dtype)
    ids = [int(t) for t in prompt_ids(60, seed=31)]
    graphed = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    assert graphed.graphs is not None and eager.graphs is None
    head = [graphed.decode(ids[:PROMPT]).logits]
    first, cursor = _rounds(graphed, ids, PROMPT, ROUNDS[:3])
    pointers = _pointers(graphed)
    rest, _ = _rounds(graphed, ids, cursor, ROUNDS[3:])
    got = torch.cat(head + [first, rest])
    ref = torch.cat([eager.decode(ids[:PROMPT]).logits, _rounds(eager, ids, PROMPT, ROUNDS)[0]])
    stats = graphed.graphs
    print(f"\n[graphs, {dtype}, {model.hparams.arch}] {len(ROUNDS)} rounds with rollbacks: {stats.captures} captures, "
          f"{stats.replays} replays; max |Δlogit| vs eager {float((got - ref).abs().max()):.1e}")
    assert torch.equal(got, ref)
    assert sorted(n for n, _ in stats.widths) == [1, K + 1]
    assert stats.captures == 2 and stats.replays == 2 * len(ROUNDS) - 4  # each width: warm-up, capture, replays
    assert pointers and _pointers(graphed) == pointers  # static storage kept from replay to replay


def test_qwen3next_replays_like_eager_decoding(graphable, tmp_path_factory):
    """Another captured graph: Qwen3-Next's own Gated DeltaNet input side and MoE
    in every block, bfloat16, rounds with rollbacks: replays equal eager decoding bit for bit."""
    from tests.fixtures import tiny_qwen3next

    path = tiny_qwen3next.converted(tmp_path_factory.mktemp("q3n-graphs"))[1]["embed"]
    model = load_model(path, device="cpu", dtype="bf16")
    ids = [int(t) for t in prompt_ids(40, seed=37)]
    graphed = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    got = torch.cat([graphed.decode(ids[:PROMPT]).logits, _rounds(graphed, ids, PROMPT, ROUNDS[:6])[0]])
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    ref = torch.cat([eager.decode(ids[:PROMPT]).logits, _rounds(eager, ids, PROMPT, ROUNDS[:6])[0]])
    print(f"\n[graphs, bf16, {model.arch}] {graphed.graphs.captures} captures, {graphed.graphs.replays} replays; "
          f"max |Δlogit| vs eager {float((got - ref).abs().max()):.1e}")
    assert graphed.graphs.captures == 2 and graphed.graphs.replays == 8
    assert torch.equal(got, ref)


@pytest.mark.parametrize("drafter", ["synthetic", "mtp"])
def test_greedy_plain_and_speculative_tokens_with_graphs_equal_eager(q8_file, graphable, drafter):
    """bfloat16 (batch-invariant): plain decoding (width 1) and speculative decoding (widths 1 and
    K+1, rollbacks) with graphs give the tokens of eager decoding, and speculative equals plain."""
    model = load_model(q8_file, device="cpu", dtype="bf16")
    n = 24
    for seed, length in ((1, 1), (2, 9)):
        prompt = [int(t) for t in prompt_ids(length, seed=seed)]

        def run():
            plain = generate(model, prompt, n).tokens
            made = (SyntheticDrafter(prompt + plain, model.vocab_size, 0.8, seed=seed) if drafter == "synthetic"
                    else MtpDrafter(model, len(prompt) + n + K + 2, model))
            res = speculative_generate(model, made, prompt, n, SpecConfig(draft_max=K))
            stats = res.stats["speculative"]
            return plain, res.tokens, stats["accepted"] if drafter == "synthetic" else stats["drafted"]

        plain, spec, counted = run()
        captured = sum(len(c.graphs) for c in RecordingCapture.made)
        with step_graphs.cuda_graphs("off"):
            eager_plain, eager_spec, _ = run()
        assert plain == spec == eager_plain == eager_spec, (drafter, prompt)
        assert captured >= 2 and counted > 0  # widths 1 and K+1 captured; drafts accepted (or made)
    print(f"\n[graphs, bf16 {model.hparams.arch}, {drafter} k={K}] plain and speculative tokens identical to eager "
          f"decoding ({len(RecordingCapture.made)} contexts captured)")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_captured_region_reads_nothing_on_the_host(q8_file, graphable, dtype):
    """On the meta device any read of a value on the host raises (tests/runtime/test_backend.py): the
    captured forwards of every width run there, warm-up, capture and replays."""
    model = load_model(q8_file, device="meta", dtype=dtype)
    ctx = _steps(model)
    widths = sorted(n for n, _ in ctx.graphs.widths)
    print(f"\n[meta, {dtype}, {model.hparams.arch}] widths {widths} captured ({ctx.graphs.captures}) and replayed "
          f"({ctx.graphs.replays}): no host read")
    assert widths == list(range(1, K + 2)) and ctx.graphs.captures == K + 1 and ctx.graphs.replays > K + 1


def test_a_context_and_its_graphs_go_without_the_cycle_collector(q8_file, graphable):
    """No reference cycle through the graphs: the static buffers and captured graphs (on a GPU, their
    memory pool) are freed when the last reference to the context goes, not at some later collection."""
    model = load_model(q8_file, device="cpu", dtype="f32")
    gc.disable()
    try:
        ctx = _steps(model)
        assert ctx.graphs.captures == K + 1
        refs = [weakref.ref(x) for x in (ctx, ctx.graphs, *ctx.graphs.widths.values(),
                                          *(w.graph for w in ctx.graphs.widths.values()))]
        RecordingCapture.made.clear()  # the stand-in's own record of what it made
        del ctx
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()


def test_a_call_on_a_backend_without_the_capture_properties_runs_eagerly(q8_file, graphable, monkeypatch):
    """The backend is asked at every call: a context made with graphs, decoding where the backend
    (swapped, as tests do) has neither fixed-size K/V nor ring slots, runs those calls eagerly."""
    model = load_model(q8_file, device="cpu", dtype="f32")
    ctx = Context(model, GraphType.MAIN, n_ctx=16, n_rs_seq=K)
    assert ctx.graphs is not None
    reference = TorchBackend()
    monkeypatch.setattr(backend_module, "_backend", lambda kind: reference)
    for t in range(4):
        ctx.decode([t + 1])
    assert not ctx.graphs.widths


def test_a_forward_that_reads_a_host_address_is_not_captured(q8_file, graphable, monkeypatch):
    """A forward reading the batch's start on the host (what a captured graph would replay stale)
    fails on the replayable batch, whatever the device."""
    from specconv.runtime import memory

    model = load_model(q8_file, device="cpu", dtype="f32")
    real = memory.Batch.attend_kv

    def sliced(self, layer, k, v, whole=False):
        return real(self, layer, k, v, whole=False)  # the slice of written cells: reads batch.start

    monkeypatch.setattr(memory.Batch, "attend_kv", sliced)
    monkeypatch.setattr(memory.Batch, "kv_cells", lambda self, layer, device: None)  # K/V through attend_kv
    ctx = Context(model, GraphType.MAIN, n_ctx=16, n_rs_seq=K)
    ctx.decode([1, 2, 3, 4, 5])  # eager: fine
    with pytest.raises(SpecconvError, match="replayable batch"):
        ctx.decode([6])


def test_a_failed_capture_decodes_eagerly_with_a_one_line_warning(q8_file, graphable, monkeypatch, capfd):
    class Refusing(RecordingCapture):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(step_graphs, "CAPTURE", Refusing)
    model = load_model(q8_file, device="cpu", dtype="f32")
    ids = [int(t) for t in prompt_ids(30, seed=33)]
    graphed = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    got = torch.cat([graphed.decode(ids[:PROMPT]).logits, _rounds(graphed, ids, PROMPT, ROUNDS[:4])[0]])
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    ref = torch.cat([eager.decode(ids[:PROMPT]).logits, _rounds(eager, ids, PROMPT, ROUNDS[:4])[0]])
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "CUDA graph" in line]
    print(f"\n[capture refused] {warnings}")
    assert warnings == ["warning: CUDA graph capture failed (operation not permitted when stream is capturing); "
                        "decoding without graphs"]
    assert torch.equal(got, ref) and graphed.graphs.failed and graphed.graphs.replays == 0


def test_which_contexts_use_graphs(q8_file, tmp_path_factory):
    """auto: CUDA only; off: none; on: wherever the backend qualifies, MTP contexts included
    (tests/runtime/test_cuda_graphs_mtp.py). Never for the recurrent reference form, a backend without
    fixed-size K/V and ring slots, or another graph."""
    model = load_model(q8_file, device="cpu", dtype="f32")
    assert Context(model).graphs is None  # auto on the CPU
    with step_graphs.cuda_graphs("on"):
        assert Context(model).graphs is None  # the CPU's backends keep their own forms
    with pytest.raises(SpecconvError, match="must be one of"):
        with step_graphs.cuda_graphs("yes"):
            pass
    backend_module._backend.cache_clear()
    saved = backend_module._backend
    try:
        backend_module._backend = lambda kind: Graphable()
        with step_graphs.cuda_graphs("on"):
            assert Context(model, n_rs_seq=K).graphs.max_width == K + 1
            assert Context(model, n_rs_seq=0, rollback="checkpoint").graphs.max_width == 1
            assert Context(model, gdn_mode="recurrent").graphs is None
            assert Context(model, GraphType.MTP).graphs is not None
            f64 = load_model(q8_file, device="cpu", dtype="f64")
            assert Context(f64).graphs is None
        assert Context(model).graphs is None  # auto: not CUDA
        with step_graphs.cuda_graphs("off"):
            assert Context(model).graphs is None
    finally:
        backend_module._backend = saved


@pytest.fixture
def triton_graphable(monkeypatch):
    """The CUDA backend itself (its Triton kernels; in the interpreter on the CPU) under the stand-in."""
    pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")
    from specconv.runtime import kernels_triton
    from specconv.runtime.backend_cuda import CudaBackend

    backend = CudaBackend(kernels_triton, device_types=("cuda" if ON_GPU else "cpu",))
    monkeypatch.setattr(backend_module, "_backend", lambda kind: backend)
    monkeypatch.setattr(step_graphs, "CAPTURE", RecordingCapture)
    with step_graphs.cuda_graphs("on"):
        yield backend


def test_the_cuda_backend_path_replays_like_eager_decoding(tmp_path_factory, triton_graphable):
    """The Triton kernels read their slots from the static buffers (views 128 bytes apart): replays
    equal eager decoding on the CUDA backend bit for bit (f32 matrices: the products by torch, the
    recurrence by the kernels; bfloat16)."""
    model = load_model(tiny_gguf(tmp_path_factory)[1], device="cuda" if ON_GPU else "cpu", dtype="bf16")
    ids = [int(t) for t in prompt_ids(30, seed=34)]
    graphed = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    got = torch.cat([graphed.decode(ids[:PROMPT]).logits, _rounds(graphed, ids, PROMPT, [1, 3, 0])[0]])
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    ref = torch.cat([eager.decode(ids[:PROMPT]).logits, _rounds(eager, ids, PROMPT, [1, 3, 0])[0]])
    print(f"\n[cuda backend + graphs, bf16] {graphed.graphs.captures} captures, {graphed.graphs.replays} replays; "
          f"max |Δlogit| vs eager {float((got - ref).abs().max()):.1e}")
    assert graphed.graphs.captures == 2 and graphed.graphs.replays == 2
    assert torch.equal(got, ref)


@pytest.mark.skipif(not ON_GPU, reason="the real capture needs a GPU")
@pytest.mark.parametrize("drafter", ["synthetic", "mtp"])
def test_cuda_graphs_on_the_gpu(q8_file, drafter):
    """torch.cuda.CUDAGraph itself, the default on CUDA: replays equal eager decoding bit for bit,
    speculative output equals plain decoding in bfloat16."""
    model = load_model(q8_file, device="cuda", dtype="bf16")
    ids = [int(t) for t in prompt_ids(40, seed=35)]
    graphed = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    assert graphed.graphs is not None
    got = torch.cat([graphed.decode(ids[:PROMPT]).logits, _rounds(graphed, ids, PROMPT, ROUNDS[:5])[0]])
    with step_graphs.cuda_graphs("off"):
        eager = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
    ref = torch.cat([eager.decode(ids[:PROMPT]).logits, _rounds(eager, ids, PROMPT, ROUNDS[:5])[0]])
    assert graphed.graphs.captures == 2 and not graphed.graphs.failed
    assert torch.equal(got, ref), float((got - ref).abs().max())
    prompt = [int(t) for t in prompt_ids(9, seed=36)]
    plain = generate(model, prompt, 32).tokens
    made = (SyntheticDrafter(prompt + plain, model.vocab_size, 0.8, seed=1) if drafter == "synthetic"
            else MtpDrafter(model, len(prompt) + 32 + K + 2, model))
    spec = speculative_generate(model, made, prompt, 32, SpecConfig(draft_max=K))
    print(f"\n[cuda graphs on {torch.cuda.get_device_name(0)}, {drafter}] replays = eager; accepted "
          f"{spec.stats['speculative']['accepted']}/{spec.stats['speculative']['drafted']}")
    assert spec.tokens == plain


@pytest.mark.parametrize("flag,mode", [((), "auto"), (("--cuda-graphs",), "on"), (("--no-cuda-graphs",), "off")])
def test_generate_takes_the_cuda_graphs_flags(q8_file, monkeypatch, capsys, flag, mode):
    """generate --cuda-graphs / --no-cuda-graphs set the mode its contexts are made under (neither:
    auto, on for CUDA); verify and demo take the same option (their --help)."""
    from tests.fixtures.cli import run_cli

    seen = []
    real = step_graphs.enabled_for
    monkeypatch.setattr(step_graphs, "enabled_for", lambda ctx: seen.append(step_graphs._mode.get()) or real(ctx))
    code, out, err = run_cli(capsys, "generate", q8_file, "--tokens", "1,2,3", "-n", "3", "--device", "cpu", *flag,
                             "--spec", "ngram", "--no-baseline")
    assert code == 0, err
    assert seen and set(seen) == {mode}
    for command in ("verify", "demo"):
        assert "--cuda-graphs / --no-cuda-graphs" in run_cli(capsys, command, "--help")[1]
