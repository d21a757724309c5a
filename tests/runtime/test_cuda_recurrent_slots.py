"""The CUDA backend's Gated DeltaNet in ring slots (runtime/backend_cuda_recurrent.py `causal_conv_slots`,
`delta_rule_slots` -> runtime/kernels_triton's causal_conv and gdn_step): a tiny Qwen3.5 run through
the CUDA backend's code path against the torch reference backend, and against itself token by token.

* float32: logits of prompts, verification batches and the steps after a rollback at every
  rejection position, and every recurrent state and attention cell after it, equal to the torch
  backend's (its forms of runtime/graphs/gdn.py) within float32 noise; every kept state is written
  into its own slot (nothing left pending), so a rollback only picks a slot;
* bfloat16 (batch-invariant mode): a speculative run with a rollback at every position gives the
  bits of plain one-token decoding, logits and states; prompts longer than a kernel launch take
  the kernels in pieces whose bits are those of one-token launches.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
tests/fixtures/triton_mode.py before Triton compiles a kernel) on CPU tensors; with one, the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tests.fixtures.triton_mode import ON_GPU, count_calls  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.runtime import (  # noqa: E402
    Context, GraphType, backend as backend_module, kernels_triton, load_model, step_graphs,
)
from specconv.runtime.backend import batch_invariant  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.graphs import gdn  # noqa: E402
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf  # noqa: E402

torch.set_num_threads(1)
DEVICE = "cuda" if ON_GPU else "cpu"
K = 3
BACKENDS = {"cuda": CudaBackend(kernels_triton, device_types=(DEVICE,)), "torch": TorchBackend()}


@pytest.fixture(autouse=True)
def eager():
    """The recurrence itself, eagerly: no CUDA graphs (tests/runtime/test_cuda_graphs.py replays it)."""
    with step_graphs.cuda_graphs("off"):
        yield


@contextmanager
def on(kind: str):
    """Forwards inside run on BACKENDS[kind] (the CUDA backend's code, or the torch reference)."""
    saved = backend_module._backend
    backend_module._backend = lambda _device_kind: BACKENDS[kind]
    try:
        yield
    finally:
        backend_module._backend = saved


@pytest.fixture
def launches(monkeypatch):
    """Counts of the recurrent kernels' launches (they must be what runs)."""
    return count_calls(monkeypatch, kernels_triton, ("gdn_step", "causal_conv"))


def _states(ctx: Context):
    """Every current recurrent state and every committed attention cell of sequence 0."""
    mem = ctx.memory
    out = [t for layer in mem.layout.rec_layers for t in ctx.recurrent_state(0, layer)]
    return out + [t for layer in mem.layout.attn_layers for t in mem.cells(0, layer)]


def _max_diff(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def _rounds(k: int):
    """Accepted counts j = 0..k once each, in an order that mixes them."""
    return [1, k, 0] + [j for j in range(2, k)]


def _speculative_vs_plain(model, ids, prompt: int, spec_kind: str, plain_kind: str, compare):
    """A speculative context (ring of K states) verifying K+1 tokens a round and rolled back to each
    accepted count, against a plain context decoding the accepted tokens one at a time: `compare`
    (what, spec tensors, plain tensors) after the prompt, every round and the step after them."""
    spec = Context(model, GraphType.MAIN, n_ctx=len(ids) + 2, n_rs_seq=K)
    plain = Context(model, GraphType.MAIN, n_ctx=len(ids) + 2, n_rs_seq=0, rollback="checkpoint")
    with on(spec_kind):
        spec_prompt = spec.decode(ids[:prompt]).logits
    with on(plain_kind):
        plain_prompt = torch.cat([plain.decode([t]).logits for t in ids[:prompt]])
    compare("prompt", [spec_prompt[-1:]], [plain_prompt[-1:]])
    cursor = prompt
    for j in _rounds(K):
        batch = ids[cursor:cursor + K + 1]
        pos0 = spec.n_past()
        with on(spec_kind):
            verified = spec.decode(batch).logits
        if j < K:
            assert spec.seq_rm(0, pos0 + j + 1)
        if spec_kind == "cuda":  # every kept state in its slot: the rollback picked one
            assert not any(spec.memory.pending), "a state left pending: the rollback would rebuild it"
        with on(plain_kind):
            steps = torch.cat([plain.decode([t]).logits for t in batch[:j + 1]])
        compare(f"round j={j}", [verified[:j + 1]] + _states(spec), [steps] + _states(plain))
        cursor += j + 1
    with on(spec_kind):
        nxt = spec.decode(ids[cursor:cursor + 1]).logits
    with on(plain_kind):
        ref = plain.decode(ids[cursor:cursor + 1]).logits
    compare("step after", [nxt], [ref])


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    return tiny_gguf(tmp_path_factory)[1]  # F32 matrices: products by torch, the recurrence by the kernels


@pytest.fixture(scope="module", params=["qwen35", "qwen3next"])
def family_file(request, f32_file, tmp_path_factory):
    """F32 files of both graphs that reach the recurrence (Qwen3-Next: value heads grouped, q and k
    repeated per group before the kernel, MoE in every block)."""
    if request.param == "qwen35":
        return f32_file
    from tests.fixtures import tiny_qwen3next

    return tiny_qwen3next.converted(tmp_path_factory.mktemp("q3n-slots"))[1]["embed"]


def test_rollback_at_every_position_equals_the_torch_backend_in_float32(family_file, launches):
    """The tiny random Gated DeltaNet layers amplify float32 rounding (docs/runtime.md "Measured"), so
    the bound is the torch backend's own noise on the same run: its batched verification forms
    against its one-token steps. The CUDA path against torch one-token steps must stay within
    max(1e-4, twice that), the rule of the parity tests (tests/fixtures/runtime_common.py `parity`;
    measured values printed); a wrong slot, an unwritten state or a stale window is O(1)."""
    model = load_model(family_file, device=DEVICE, dtype="f32")
    ids = [int(t) for t in prompt_ids(40, seed=21)]

    def worst_of(spec_kind):
        worst = {"logits": 0.0, "states": 0.0}

        def compare(what, spec, plain):
            worst["logits"] = max(worst["logits"], _max_diff(spec[:1], plain[:1]))
            if len(spec) > 1:
                worst["states"] = max(worst["states"], _max_diff(spec[1:], plain[1:]))

        _speculative_vs_plain(model, ids, 9, spec_kind, "torch", compare)
        return worst

    noise = worst_of("torch")
    assert launches["gdn_step"] == 0
    cuda = worst_of("cuda")
    print(f"\n[{model.arch}: cuda path vs torch backend, f32, k={K}, rollback to every j] max |Δlogit| {cuda['logits']:.2e}, "
          f"max |Δ| states and cells {cuda['states']:.2e} (torch's batched forms vs its steps: {noise['logits']:.2e}, "
          f"{noise['states']:.2e}); launches {launches}")
    assert launches["gdn_step"] > 0 and launches["causal_conv"] == 0  # the conv runs inside gdn_step (conv=)
    for what in ("logits", "states"):
        assert cuda[what] <= max(1e-4, 2 * noise[what]), what


def test_rollback_at_every_position_gives_the_bits_of_plain_steps_in_bfloat16(f32_file, launches):
    """bfloat16 on the CUDA backend's path: verification rows, and the states kept after a rollback
    at every position, are the bits of one-token decode steps (the kernels' per-token arithmetic does
    not depend on how many tokens a launch holds)."""
    model = load_model(f32_file, device=DEVICE, dtype="bf16")
    ids = [int(t) for t in prompt_ids(40, seed=22)]
    checked = []

    def compare(what, spec, plain):
        same = all(torch.equal(x, y) for x, y in zip(spec, plain))
        checked.append(what)
        assert same, f"{what}: max |Δ| {_max_diff(spec, plain):.2e}"

    _speculative_vs_plain(model, ids, 6, "cuda", "cuda", compare)
    print(f"\n[cuda path, bf16, k={K}] {len(checked)} checks ({', '.join(checked)}): logits, states and cells "
          f"bit-identical to one-token steps; launches {launches}")
    assert launches["gdn_step"] > 0


def test_quantized_forward_equals_the_torch_backend(tmp_path_factory):
    """A q8_0 file, float32: the fused products and the recurrent kernels together (a prompt, a
    verification of K+1, a rollback, a step) against the torch backend."""
    model = load_model(tiny_gguf(tmp_path_factory, outtype="q8_0")[1], device=DEVICE, dtype="f32")
    ids = [int(t) for t in prompt_ids(16, seed=23)]

    def run(kind):
        ctx = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=K)
        with on(kind):
            out = [ctx.decode(ids[:6]).logits, ctx.decode(ids[6:6 + K + 1]).logits]
            assert ctx.seq_rm(0, 8)
            out.append(ctx.decode(ids[12:13]).logits)
        return torch.cat(out), _states(ctx)

    (logits, states), (ref_logits, ref_states) = run("cuda"), run("torch")
    dl, ds = _max_diff([logits], [ref_logits]), _max_diff(states, ref_states)
    print(f"\n[cuda path q8_0 vs torch backend, f32] max |Δlogit| {dl:.2e}, states and cells {ds:.2e}")
    assert dl <= 1e-3 and ds <= 1e-4


@pytest.mark.parametrize("keep,slots", [(1, 3), (5, 7), (20, 22), (1, 1)], ids=["keep1", "keep5", "keep20", "one-slot"])
def test_prompts_in_pieces_give_the_bits_of_one_token_launches(keep, slots):
    """37 tokens in batch-invariant mode: the kernels in pieces of MAX_TOKENS (backend_cuda_recurrent.ring_pieces),
    outputs and the kept states bit-identical to 37 one-token launches and within float32 noise of
    the torch form's; only the kept slots (and the source's, in a ring of one) written."""
    n, nv, dk, dv, channels, taps = 37, 2, 16, 32, 40, 4
    gen = torch.Generator().manual_seed(keep + slots)
    q = torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=gen), dim=-1)
    v, g = torch.randn(n, nv, dv, generator=gen), -torch.rand(n, nv, generator=gen)
    beta, m = torch.sigmoid(torch.randn(n, nv, generator=gen)), torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    ssm, conv = torch.randn(slots, nv, dk, dv, generator=gen), torch.randn(slots, taps - 1, channels, generator=gen)
    src = slots - 1
    dst = [(src + 1 + i) % slots for i in range(keep)]
    cuda, ref = BACKENDS["cuda"], BACKENDS["torch"]

    def index(values):
        return torch.tensor(values, dtype=torch.long, device=DEVICE)

    def run(backend, rings, tokens, src, dst):
        ssm_ring, conv_ring = rings
        a, b = tokens
        c = backend.causal_conv_slots(m[a:b].to(DEVICE), conv_ring, weight.to(DEVICE), index([src]), index(dst))
        o = backend.delta_rule_slots(*(t[a:b].to(DEVICE) for t in (q, k, v, g, beta)), ssm_ring, index([src]),
                                     index(dst))
        return c, o

    with batch_invariant(True):
        pieces = (ssm.clone().to(DEVICE), conv.clone().to(DEVICE))
        c, o = run(cuda, pieces, (0, n), src, dst)
        ones = (ssm.clone().to(DEVICE), conv.clone().to(DEVICE))
        ring_of_one = slots == 1
        steps, kept = [], {}
        for t in range(n):
            before = src if t == 0 else (0 if ring_of_one else t % slots)
            after = 0 if ring_of_one else (t + 1) % slots
            steps.append(run(cuda, ones, (t, t + 1), before, [after]))
            if t >= n - keep:
                kept[t] = (ones[0][after].clone(), ones[1][after].clone())
        reference = (ssm.clone().to(DEVICE), conv.clone().to(DEVICE))
        c_ref, o_ref = run(ref, reference, (0, n), src, dst)
    assert torch.equal(c, torch.cat([s[0] for s in steps])) and torch.equal(o, torch.cat([s[1] for s in steps]))
    for i, t in enumerate(range(n - keep, n)):
        assert torch.equal(pieces[0][dst[i]], kept[t][0]) and torch.equal(pieces[1][dst[i]], kept[t][1])
    untouched = [s for s in range(slots) if s not in dst and s != src]
    assert torch.equal(pieces[0][untouched].cpu(), ssm[untouched]) and torch.equal(pieces[1][untouched].cpu(),
                                                                                    conv[untouched])
    if not ring_of_one:
        assert torch.equal(pieces[0][src].cpu(), ssm[src])
    err = max(_max_diff([o, pieces[0][dst]], [o_ref, reference[0][dst]]), _max_diff([c], [c_ref]))
    print(f"\n[pieces n={n} keep={keep} slots={slots}] bits of {n} one-token launches; vs torch form max |Δ| {err:.2e}")
    assert torch.equal(pieces[1][dst], reference[1][dst])  # windows are copies of input rows
    assert err <= 1e-4


def test_pieces_cover_the_tokens_and_keep_the_last_states():
    """ring_pieces' plan (host arithmetic only): consecutive pieces of at most `step` tokens, each
    reading the slot its predecessor wrote, the kept tokens' states in their own slots."""
    from specconv.runtime.backend_cuda_recurrent import ring_pieces

    for n, step, keep in [(37, 16, 1), (37, 16, 20), (16, 16, 4), (5, 16, 5), (33, 16, 17)]:
        src, dst = torch.tensor([99]), torch.arange(keep) + 10
        holder = {-1: 99}  # token -> slot holding the state after it
        covered = []
        for a, b, s, d in ring_pieces(n, step, src, dst):
            assert 0 < b - a <= step and int(s) == holder[a - 1] and d.shape[0] <= b - a
            for i, slot in enumerate(d.tolist()):
                holder[b - d.shape[0] + i] = slot
            covered += range(a, b)
        assert covered == list(range(n))
        assert [holder[t] for t in range(n - keep, n)] == dst.tolist()


def test_the_recurrence_takes_the_slot_form_only_where_the_backend_declares_it(f32_file):
    """gdn.Recurrence asks the backend's `slot_states`: the CUDA backend gets ring slots, the torch
    backend state tensors (its batched forms leave states pending), mode "recurrent" the torch form."""
    model = load_model(f32_file, device=DEVICE, dtype="f32")
    ctx = Context(model, GraphType.MAIN, n_ctx=8, n_rs_seq=K)
    batch = ctx.memory.begin(0, torch.arange(2, device=DEVICE), [0, 1])
    layer = ctx.memory.layout.rec_layers[0]
    with on("cuda"):
        assert gdn.Recurrence(batch, layer, "auto").slots and not gdn.Recurrence(batch, layer, "recurrent").slots
    with on("torch"):
        assert not gdn.Recurrence(batch, layer, "auto").slots
