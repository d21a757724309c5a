"""The chunked gated delta rule kernel (runtime/kernels_triton/gdn_chunked.py) and where the CUDA
backend takes it (runtime/backend_cuda_recurrent.py `delta_rule_slots`):

* the kernel against runtime/graphs/gdn.py's recurrence evaluated in float64 (the exact reference;
  the torch float32 recurrence's own error printed beside it) on the released head shapes (dk = dv
  = 128; value heads over key heads tiled as Qwen3.5's GGUF files, grouped as Qwen3-Next's), input
  lengths on both sides of a chunk, strong and mild decays, β over [0, 1] with its ends; every kept
  state in its slot of a ring that wraps, nothing else written; outputs and the final state
  independent of how many states are kept;
* the backend: a long float32 batch or a bfloat16 prompt's prefix in one chunked launch, other long
  bfloat16 batches (a verification of more drafts than a gdn_step launch holds) in gdn_step pieces;
  a tiny Qwen3.5's prompt then decode steps against the torch backend, and greedy speculative
  decoding in bfloat16 equal to plain decoding with long prompts and long verification batches.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
tests/fixtures/triton_mode.py) with fewer heads of the same size and layout; with one, the compiled
kernels on CUDA with the released head counts.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from tests.fixtures.triton_mode import DEVICE, ON_GPU, count_calls  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import (  # noqa: E402
    Context, GraphType, backend as backend_module, kernels_triton as kt, load_model, step_graphs,
)
from specconv.runtime.backend import batch_invariant, evaluating_prompt_prefix  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.graphs import gdn  # noqa: E402
from tests.fixtures.runtime_common import prompt_ids, tiny_gguf  # noqa: E402

torch.set_num_threads(1)
EPS = float(torch.finfo(torch.float32).eps)
WHERE = "cuda" if ON_GPU else "interpreter"

# max |Δ| of outputs and states against the float64 recurrence, in units of eps · (1 + max |S|), as
# tests/runtime/test_triton_kernels.py GDN_BOUND for gdn_step. The chunked form evaluates the same
# function with float32 products whose terms are of the same sizes (unit keys, |q| = dk^-1/2,
# decays and β ≤ 1, values and states as they are): each output and state sums dk + CHUNK terms
# instead of dk per token, so under random rounding its error grows by about
# √((dk + CHUNK) / dk) ≈ 1.2 for dk = 128, and the decays shrink the errors of earlier chunks as
# they shrink the recurrence's. The triangular solve adds one more sum of up to CHUNK terms per
# row (|A_ij| ≤ 1). Measured (printed): under 0.9, the torch float32 recurrence's level (0.3 - 0.7
# on the same inputs); the bound 4 leaves a GPU's exp its few ulp while a wrong term (of order |S|:
# 1/eps times larger) fails.
CHUNKED_BOUND = 4.0

# (nk, nv, layout): the released shapes on a GPU; in the interpreter fewer heads, the same ratios
HEADS = {
    "qwen35-tiled-x2": ((16, 32, gdn.TILED), (2, 4, gdn.TILED)),
    "qwen35-tiled-x3": ((16, 48, gdn.TILED), (2, 6, gdn.TILED)),
    "qwen35-tiled-x4": ((16, 64, gdn.TILED), (1, 4, gdn.TILED)),
    "qwen3next-grouped": ((16, 32, gdn.GROUPED), (2, 4, gdn.GROUPED)),
}
DK = DV = 128


def heads(name: str):
    return HEADS[name][0 if ON_GPU else 1]


def rule_inputs(n: int, nk: int, nv: int, slots: int, seed: int, dtype=torch.float32):
    """Inputs as the runtime makes them: q, k L2-normed (q scaled by dk^-1/2); the first half of the
    value heads with mild log-decays (about -0.3), the second half with strong ones (to -40: a
    chunk's Γ reaches hundreds); β uniform over [0, 1] with exact zeros and ones; a ring of random
    states. q, k, v in `dtype` (the compute dtype), g, β float32."""
    gen = torch.Generator().manual_seed(seed)
    q = (F.normalize(torch.randn(n, nk, DK, generator=gen), dim=-1) * DK ** -0.5).to(dtype)
    k = F.normalize(torch.randn(n, nk, DK, generator=gen), dim=-1).to(dtype)
    v = torch.randn(n, nv, DV, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(n, nv, generator=gen) - 1.0)
    g[:, nv // 2:] *= 16.0
    beta = torch.rand(n, nv, generator=gen)
    beta[::7] = 0.0
    beta[3::5] = 1.0
    states = torch.randn(slots, nv, DK, DV, generator=gen)
    return q, k, v, g, beta, states


def exact(q, k, v, g, beta, state, keep: int, layout: str):
    """The float64 recurrence on the same (rounded) inputs, key heads expanded in `layout`."""
    q, k, v, g, beta = gdn.rule_inputs(q, k, v, g, beta, torch.float64, layout)
    return gdn.recurrent_delta_rule(q, k, v, g, beta, state.double(), keep=keep)


def group_of(nk: int, nv: int, layout: str) -> int:
    return nv // nk if layout == gdn.GROUPED else 1


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def check_against_recurrence(n: int, head_name: str, keep: int, seed: int, dtype=torch.float32):
    nk, nv, layout = heads(head_name)
    slots = keep + 3
    q, k, v, g, beta, ring = rule_inputs(n, nk, nv, slots, seed, dtype)
    src = 2
    dst = [(src + 1 + i) % slots for i in range(keep)]  # wraps around the ring
    before = ring.clone()
    ring_dev = ring.to(DEVICE)
    o = kt.gdn_chunked(*on_device(q, k, v, g, beta), ring_dev, src, dst, group=group_of(nk, nv, layout)).cpu()
    ring = ring_dev.cpu()
    o64, s64 = exact(q, k, v, g, beta, before[src], keep, layout)
    o32, s32 = gdn.recurrent_delta_rule(*gdn.rule_inputs(q, k, v, g, beta, torch.float32, layout), before[src],
                                        keep=keep)
    scale = EPS * (1.0 + float(s64.abs().max()))
    err = max(float((o.double() - o64).abs().max()), float((ring[dst].double() - s64).abs().max())) / scale
    torch_err = max(float((o32.double() - o64).abs().max()), float((s32.double() - s64).abs().max())) / scale
    print(f"\n[{WHERE} gdn_chunked n={n} {head_name} nk={nk} nv={nv} keep={keep} {str(dtype)[6:]}] "
          f"max |Δ| = {err:.2f} (torch float32 recurrence {torch_err:.2f}) eps·(1+max|S|)")
    assert err <= CHUNKED_BOUND
    untouched = [s for s in range(slots) if s not in dst]
    assert src in untouched and torch.equal(ring[untouched], before[untouched])


@pytest.mark.parametrize("n", [1, 17, 63, 64, 65, 200])
def test_chunked_kernel_matches_the_recurrence_across_chunk_ends(n):
    """Lengths below, at and past one chunk and over several, the last state and two before it kept."""
    check_against_recurrence(n, "qwen35-tiled-x2", keep=min(n, 3), seed=n)


@pytest.mark.parametrize("head_name", list(HEADS))
def test_chunked_kernel_reads_each_value_heads_key_head(head_name):
    """Tiled and grouped key heads at the released ratios, 65 tokens (a chunk and one token), every
    state kept: 65 snapshots over two chunks, each in its own slot."""
    check_against_recurrence(65, head_name, keep=65, seed=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_chunked_kernel_reads_16bit_inputs(dtype):
    """q, k, v in the compute dtype, read as they are (no cast launch first)."""
    check_against_recurrence(70, "qwen3next-grouped", keep=2, seed=3, dtype=dtype)


def test_outputs_and_final_state_do_not_depend_on_the_kept_states():
    """keep 1, keep 70 and a ring of one slot (source = destination), slots as ints or device
    tensors: the same bits of every output and of the state after the batch (a speculative context
    keeps more states than a plain one; the two must compute a prompt alike)."""
    n = 70
    nk, nv, layout = heads("qwen35-tiled-x2")
    q, k, v, g, beta, ring = rule_inputs(n, nk, nv, n + 1, seed=5)
    inputs = on_device(q, k, v, g, beta)
    one_kept = ring.clone().to(DEVICE)
    o1 = kt.gdn_chunked(*inputs, one_kept, 0, [n])
    all_kept = ring.clone().to(DEVICE)
    index = torch.arange(1, n + 1, device=DEVICE)
    o_all = kt.gdn_chunked(*inputs, all_kept, torch.tensor([0], device=DEVICE), index)
    one_slot = ring[:1].clone().to(DEVICE)
    o_one = kt.gdn_chunked(*inputs, one_slot, 0, [0])
    assert torch.equal(o1, o_all) and torch.equal(o1, o_one)
    assert torch.equal(one_kept[n], all_kept[n]) and torch.equal(one_slot[0], all_kept[n])
    assert torch.equal(one_kept[1:n].cpu(), ring[1:n])  # keep 1: nothing else written
    _, s64 = exact(q, k, v, g, beta, ring[0], n, layout)
    err = float((all_kept[1:].cpu().double() - s64).abs().max()) / (EPS * (1.0 + float(s64.abs().max())))
    print(f"\n[{WHERE} gdn_chunked keep 1 / {n} / ring of one] same bits; all {n} states max |Δ| {err:.2f} eps·(1+max|S|)")
    assert err <= CHUNKED_BOUND


def test_bad_input_one_line_errors():
    q, k, v, g, beta, ring = on_device(*rule_inputs(20, 1, 2, 2, seed=0))
    cases = [
        (lambda: kt.gdn_chunked(q, k, v, g, beta, ring, 0, [2]), "outside the ring"),
        (lambda: kt.gdn_chunked(q, k, v, g, beta, ring.double(), 0, [1]), "must be float32"),
        (lambda: kt.gdn_chunked(q[:0], k[:0], v[:0], g[:0], beta[:0], ring, 0, [1]), "0 tokens"),
        (lambda: kt.gdn_chunked(q[:1], k[:1], v[:1], g[:1], beta[:1], ring, 0, [0, 1]), "2 destination slots"),
        (lambda: kt.gdn_chunked(q, k, v[:, :1], g, beta, ring, 0, [1]), "expected"),
        (lambda: kt.gdn_chunked(q, k, v, g, beta, ring, 0, [1], group=3), "group must be"),
    ]
    for call, message in cases:
        with pytest.raises(SpecconvError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


# ---- the CUDA backend -------------------------------------------------------------------------------

@pytest.fixture
def launches(monkeypatch):
    """Counts of the delta rule kernels' launches through the package (what the backend calls)."""
    return count_calls(monkeypatch, kt, ("gdn_step", "gdn_chunked"))


CUDA = CudaBackend(kt, device_types=(DEVICE.type,))


def test_the_backend_takes_the_chunked_kernel_for_prompts_only(launches):
    """40 tokens: float32, one chunked launch (with the results of the torch backend's forms within
    the bound); bfloat16's batch-invariant mode, gdn_step in pieces of 16 (3 launches, a long
    verification's rows must be decode steps' bits) except inside a prompt's prefix, one chunked
    launch; 16 tokens always one gdn_step launch."""
    n = 40
    nk, nv, layout = heads("qwen35-tiled-x2")
    q, k, v, g, beta, ring = rule_inputs(n, nk, nv, 4, seed=9)
    src, dst = torch.tensor([0], device=DEVICE), torch.tensor([1, 2], device=DEVICE)

    def run(backend, tokens=n):
        states = ring.clone().to(DEVICE)
        o = backend.delta_rule_slots(*on_device(q[:tokens], k[:tokens], v[:tokens], g[:tokens], beta[:tokens]),
                                     states, src, dst, key_heads=layout)
        return o, states

    def counted(call):
        before = dict(launches)
        out = call()
        return out, {name: launches[name] - before[name] for name in launches}

    (o, states), used = counted(lambda: run(CUDA))
    assert used == {"gdn_step": 0, "gdn_chunked": 1}
    o_ref, states_ref = run(TorchBackend())
    _, s64 = exact(q, k, v, g, beta, ring[0], 2, layout)
    err = max(float((o.cpu() - o_ref.cpu()).abs().max()), float((states[1:3].cpu() - states_ref[1:3].cpu()).abs().max()))
    scale = EPS * (1.0 + float(s64.abs().max()))
    print(f"\n[{WHERE} f32 delta_rule_slots n={n}] chunked kernel vs torch backend max |Δ| {err / scale:.2f} eps·(1+max|S|)")
    assert err <= 2 * CHUNKED_BOUND * scale  # each within the bound of the exact values
    with batch_invariant(True):
        _, used = counted(lambda: run(CUDA))
        assert used == {"gdn_step": 3, "gdn_chunked": 0}
        with evaluating_prompt_prefix():
            (o_prefix, _), used = counted(lambda: run(CUDA))
            assert used == {"gdn_step": 0, "gdn_chunked": 1} and torch.equal(o_prefix, o)
            _, used = counted(lambda: run(CUDA, tokens=16))
            assert used == {"gdn_step": 1, "gdn_chunked": 0}


@contextmanager
def on(backend):
    """Forwards inside run on `backend`; eagerly (no CUDA graphs: tests/runtime/test_cuda_graphs.py)."""
    saved = backend_module._backend
    backend_module._backend = lambda _device_kind: backend
    try:
        with step_graphs.cuda_graphs("off"):
            yield
    finally:
        backend_module._backend = saved


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return tiny_gguf(tmp_path_factory)[1]


def test_a_prompt_then_decode_steps_equal_the_torch_backend_in_float32(tiny_file, launches):
    """A tiny Qwen3.5 (dk = dv = 16), float32: a 70-token prompt (two chunks) through the chunked
    kernel, then decode steps through gdn_step, against the torch backend's one-token steps. The
    tiny random layers amplify float32 rounding (docs/runtime.md "Measured"), so the bound is the
    parity rule of tests/runtime/test_cuda_recurrent_slots.py: max(1e-4, twice the torch backend's
    own distance on the same run, its chunked prompt against its one-token steps); a wrong chunk,
    decay or slot moves logits and states by O(1)."""
    model = load_model(tiny_file, device=DEVICE.type, dtype="f32")
    ids = [int(t) for t in prompt_ids(74, seed=31)]

    def run(backend, prompt_batch: int):
        with on(backend):  # the context made inside: it reads the graph mode ("off": each launch counted)
            ctx = Context(model, GraphType.MAIN, n_ctx=len(ids), n_rs_seq=3)
            logits = [ctx.decode(ids[:prompt_batch]).logits] + [ctx.decode([t]).logits for t in ids[prompt_batch:]]
        layers = ctx.memory.layout.rec_layers
        return torch.cat(logits), [s for layer in layers for s in ctx.recurrent_state(0, layer)], len(layers)

    def distance(a, b):
        return (float((a[0] - b[0]).abs().max()),
                max(float((x - y).abs().max()) for x, y in zip(a[1], b[1])))

    cuda = run(CUDA, 70)
    assert launches["gdn_chunked"] == cuda[2] and launches["gdn_step"] == 4 * cuda[2]
    steps = run(TorchBackend(), 1)
    (dl, ds), (nl, ns) = distance(cuda, steps), distance(run(TorchBackend(), 70), steps)
    print(f"\n[{WHERE} tiny Qwen3.5 f32, 70-token prompt + 4 steps] cuda path vs torch one-token steps: "
          f"max |Δlogit| {dl:.2e}, max |Δ| states {ds:.2e} (the torch backend's chunked prompt: {nl:.2e}, "
          f"{ns:.2e}); launches {launches}")
    assert dl <= max(1e-4, 2 * nl) and ds <= max(1e-4, 2 * ns)


@pytest.mark.parametrize("prompt,k", [(40, 3), (20, 17)], ids=["40-token prompt", "18-row verification"])
def test_greedy_speculative_decoding_equals_plain_in_bfloat16(tiny_file, launches, prompt, k):
    """bfloat16 (batch-invariant mode): the prompt's prefix through the chunked kernel in both runs
    (a plain context keeps one state, the speculative one k + 1: the same bits), verification batches
    of k + 1 rows, more than a gdn_step launch holds for k = 17, in gdn_step pieces: the synthetic
    drafter's accepted and rejected drafts leave greedy output equal to plain decoding."""
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.generate import generate
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    model = load_model(tiny_file, device=DEVICE.type, dtype="bf16")
    ids = [int(t) for t in prompt_ids(prompt, seed=4)]
    with on(CUDA):
        plain = generate(model, ids, 8).tokens
        chunked_plain = launches["gdn_chunked"]
        spec = speculative_generate(model, SyntheticDrafter(ids + plain, model.vocab_size, 0.6, seed=2), ids, 8,
                                    SpecConfig(draft_max=k))
    stats = spec.stats["speculative"]
    print(f"\n[{WHERE} bf16, prompt {prompt}, k={k}] {stats['accepted']} of {stats['drafted']} drafts accepted; "
          f"speculative = plain: {spec.tokens == plain}; launches {launches}")
    assert chunked_plain > 0 and launches["gdn_chunked"] == 2 * chunked_plain  # the prefix, once per run
    assert stats["drafted"] > stats["accepted"] > 0  # rollbacks and accepted drafts both happened
    assert spec.tokens == plain
