"""The Gated DeltaNet mixer's launches on the CUDA backend (runtime/graphs/qwen35.py and qwen3next.py
`gated_deltanet`): the kernels take the tensors as the products and the conv leave them, so nothing
is copied, cast or tiled between them, and the CPU keeps the bits of the casts and tiling it made.

* kernels (Triton's interpreter here, compiled on a GPU): gdn_step given the key heads only (tiled,
  group 1, or grouped, group nv / nk) computes the bits of the kernel given q, k expanded to every value head; 16-bit inputs
  are loaded into float32 (gdn_step, gdn_gates, l2_norm: the bits of the kernel on the float32
  values); gdn_gates reads Qwen3-Next's [n, nk, r] views as their contiguous copies; l2_norm's scale
  is the product after the norm; the gated norm stores its float32 result rounded once into bf16;
  a row alone gets the bits it gets in a batch of 16;
* the torch forms: given key heads and compute-dtype inputs they compute the bits of the graph's
  former expansion (q.repeat / repeat_interleave) and casts, float32 and float64 states, modes
  "recurrent" and "auto", the ring form included;
* launches (the `meta` device, benchmarks/cuda_op_count.py): one mixer call, decode step and
  verification batch, launches its products and exactly one kernel (the step with the conv, q and
  k's L2 norms, the gates and the gated output norm folded in, tests/runtime/test_cuda_gdn_step_fused.py
  and test_cuda_gdn_output_norm.py), nothing else; a decode step's Gated DeltaNet blocks launch no aten operation beside their
  kernels but the residual add (and the batch's cell index, once, in the first block), and
  GDN_BLOCK_LAUNCHES launches in all.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from tests.fixtures.triton_mode import DEVICE, ON_GPU, WHERE  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from benchmarks import cuda_op_count  # noqa: E402
from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import Context, GraphType, kernels_triton as kt, load_model  # noqa: E402
from specconv.runtime.backend import batch_invariant  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.graphs import gdn, qwen35, qwen3next  # noqa: E402
from specconv.runtime.graphs.ops import made  # noqa: E402
from specconv.runtime.kernels_triton import _common as kt_common  # noqa: E402
from tests.fixtures.runtime_common import tiny_gguf  # noqa: E402

REF = TorchBackend()
EPS = 1e-6
ULPS = 8  # float32 kernel vs torch formula, as tests/runtime/test_cuda_fused_kernels.py (measured: printed)
BF16 = torch.bfloat16


def rand(*shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def ulps(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().cpu().float(), ref.detach().cpu().float()
    spacing = torch.nextafter(ref.abs(), torch.full_like(ref, float("inf"))) - ref.abs()
    return float(((y - ref).abs() / spacing).max())


def old_expansion(x: torch.Tensor, nv: int, key_heads: str) -> torch.Tensor:
    """q or k as the graphs expanded them before the delta rule took key heads."""
    r = nv // x.shape[1]
    return x.repeat(1, r, 1) if key_heads == gdn.TILED else x.repeat_interleave(r, dim=1)


def rule_inputs(n: int, nk: int, nv: int, dk: int, dv: int, seed: int, dtype=torch.float32):
    """q, k [n, nk, dk] L2-normed (q scaled), v [n, nv, dv] in `dtype`, g ≤ 0 and β in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, nk, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(n, nk, dk, generator=gen), dim=-1)
    v = torch.randn(n, nv, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(n, nv, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(n, nv, generator=gen))
    return q, k, v, g, beta


# ---- kernels -------------------------------------------------------------------------------------

@pytest.mark.parametrize("key_heads", [gdn.TILED, gdn.GROUPED])
@pytest.mark.parametrize("n", [1, 4])
def test_gdn_step_reads_key_heads_and_16bit_inputs_in_place(key_heads, n):
    """The kernel with the key heads only = the kernel with q, k expanded to every value head (outputs
    and every kept state, bit for bit); bf16 v (and q, k, g, β) = their float32 values."""
    nk, nv, dk, dv, slots = 2, 6, 16, 40, 8
    q, k, v, g, beta = rule_inputs(n, nk, nv, dk, dv, seed=n)
    ring = rand(slots, nv, dk, dv, seed=n + 1)
    dst = list(range(1, n + 1))

    def run(q, k, v, g, beta, layout):
        states = ring.clone().to(DEVICE)
        group = v.shape[1] // q.shape[1] if layout == gdn.GROUPED else 1
        o = kt.gdn_step(*(t.to(DEVICE) for t in (q, k, v, g, beta)), states, 0, dst, group=group)
        return o.cpu(), states.cpu()

    o, states = run(q, k, v, g, beta, key_heads)
    o_full, states_full = run(old_expansion(q, nv, key_heads), old_expansion(k, nv, key_heads), v, g, beta, gdn.TILED)
    assert torch.equal(o, o_full) and torch.equal(states, states_full)
    assert not torch.equal(o, run(q, k, v, g, beta, gdn.GROUPED if key_heads == gdn.TILED else gdn.TILED)[0])
    low = [t.to(BF16) for t in (q, k, v, g, beta)]
    o16, states16 = run(*low, key_heads)
    o16_as_32, states16_as_32 = run(*(t.float() for t in low), key_heads)
    assert torch.equal(o16, o16_as_32) and torch.equal(states16, states16_as_32)
    with pytest.raises(SpecconvError, match=r"gdn_step: group must be 1 \(tiled heads\) or 3"):
        kt.gdn_step(*(t.to(DEVICE) for t in (q, k, v, g, beta)), ring.clone().to(DEVICE), 0, dst, group=2)
    print(f"\n[{WHERE}] gdn_step {key_heads} n={n}: key heads = expanded heads, bf16 = its float32 values, "
          "bit for bit")


def test_gdn_gates_reads_16bit_and_grouped_views():
    """Qwen3-Next's b, alpha: [n, nk, r] views of one [n, nk, 2r] bf16 projection, read through their
    strides = the kernel on contiguous float32 copies [n, nv] (bits), within ULPS of the torch
    formula; the torch formula on the views = on the copies (bits); a row alone = in a batch of 16."""
    n, nk, r = 16, 4, 3
    ba = rand(n, nk, 2 * r, seed=5, scale=4).to(BF16).to(DEVICE)
    b, alpha = ba[..., :r], ba[..., r:]
    a, dt_bias = (-rand(nk * r, seed=6).abs() - 0.1).to(DEVICE), rand(nk * r, seed=7).to(DEVICE)
    copies = [t.float().reshape(n, nk * r) for t in (b, alpha)]
    got, as_copies = kt.gdn_gates(b, alpha, a, dt_bias), kt.gdn_gates(*copies, a, dt_bias)
    assert all(torch.equal(x, y) for x, y in zip(got, as_copies))
    flat = kt.gdn_gates(*(t.reshape(n, nk * r) for t in (b, alpha)), a, dt_bias)  # 2-D bf16 rows
    assert all(torch.equal(x, y) for x, y in zip(flat, as_copies))
    ref = REF.gdn_gates(b.cpu(), alpha.cpu(), a.cpu(), dt_bias.cpu())
    ref_copies = REF.gdn_gates(*(t.cpu() for t in copies), a.cpu(), dt_bias.cpu())
    assert all(torch.equal(x, y) for x, y in zip(ref, ref_copies)) and ref[0].dtype == torch.float32
    worst = max(ulps(x, y) for x, y in zip(got, ref))
    for i in (0, 9, 15):
        alone = kt.gdn_gates(b[i:i + 1], alpha[i:i + 1], a, dt_bias)
        assert all(torch.equal(x, y[i:i + 1]) for x, y in zip(alone, got)), i
    print(f"\n[{WHERE}] gdn_gates bf16 [n, nk, r] views = float32 copies (bits); {worst:.1f} ulps from torch")
    assert worst <= ULPS


def test_l2_norm_scale_is_the_product_after_the_norm():
    """q of the conv's bf16 output (a strided head view): l2_norm(x, eps, scale) = l2_norm(x, eps) ·
    scale in float32 (bits: the two roundings of the former graph), = the kernel on x's float32
    values; the torch formula likewise; kernel within ULPS of it; a row alone = in a batch of 16."""
    n, nk, dk = 16, 2, 32
    conv_out = rand(n, 3 * nk * dk, seed=8, dtype=BF16).to(DEVICE)
    x = conv_out[:, :nk * dk].view(n, nk, dk)
    scale = dk ** -0.5
    y = kt.l2_norm(x, EPS, scale=scale)
    assert torch.equal(y, kt.l2_norm(x, EPS) * scale) and torch.equal(y, kt.l2_norm(x.float(), EPS, scale=scale))
    ref = REF.l2_norm(x.cpu(), EPS, scale)
    assert torch.equal(ref, REF.l2_norm(x.cpu(), EPS) * scale)
    for i in (0, 9, 15):
        assert torch.equal(kt.l2_norm(x[i:i + 1], EPS, scale=scale), y[i:i + 1]), i
    units = ulps(y, ref)
    print(f"\n[{WHERE}] l2_norm with scale: the norm then · scale (bits); {units:.1f} ulps from torch")
    assert y.dtype == torch.float32 and units <= ULPS


def test_gated_norm_rounds_once_into_the_products_dtype():
    """The gated norm with out_dtype bf16 stores its float32 result rounded once: to nearest on a GPU
    (torch's .to(bf16) of the float32 output, the former graph's cast), truncated by the
    interpreter (its float-to-bf16 store); the torch formula = its float32 result .to(bf16)."""
    n, nv, dv = 16, 4, 32
    o, z, w = rand(n, nv, dv, seed=9).to(DEVICE), rand(n, nv, dv, seed=10, dtype=BF16).to(DEVICE), rand(dv, seed=11)
    y32 = kt.rms_norm(o, w.to(DEVICE), EPS, gate=z)
    y16 = kt.rms_norm(o, w.to(DEVICE), EPS, gate=z, out_dtype=BF16)
    once = y32.to(BF16) if ON_GPU else (y32.view(torch.int32) & -(1 << 16)).view(torch.float32).to(BF16)
    assert y16.dtype == BF16 and torch.equal(y16, once)
    ref = REF.gated_rms_norm(o.cpu(), w, z.cpu(), EPS, BF16)
    assert torch.equal(ref, REF.gated_rms_norm(o.cpu(), w, z.cpu(), EPS).to(BF16))
    for i in (0, 9, 15):
        assert torch.equal(kt.rms_norm(o[i:i + 1], w.to(DEVICE), EPS, gate=z[i:i + 1], out_dtype=BF16), y16[i:i + 1])
    print(f"\n[{WHERE}] gated norm → bf16: its float32 result rounded once, rows alone = in a batch")


# ---- the torch forms -----------------------------------------------------------------------------

@pytest.mark.parametrize("key_heads", [gdn.TILED, gdn.GROUPED])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_the_torch_forms_expand_and_cast_as_the_graph_did(key_heads, state_dtype):
    """gdn.delta_rule ("recurrent", "auto") and TorchBackend.delta_rule_slots given key heads and a
    bf16 v = given the former graph's inputs (q, k repeated per value head, every input .to(state
    dtype)), bit for bit."""
    n, nk, nv, dk, dv = 4, 2, 4, 8, 16
    q, k, v, g, beta = rule_inputs(n, nk, nv, dk, dv, seed=12, dtype=BF16)
    state = rand(nv, dk, dv, seed=13).to(state_dtype)
    before = (old_expansion(q, nv, key_heads), old_expansion(k, nv, key_heads), v.float(), g, beta)
    before = tuple(t.to(state_dtype) for t in before)
    for mode in ("recurrent", "auto"):
        o, states = gdn.delta_rule(q, k, v, g, beta, state, keep=n, mode=mode, key_heads=key_heads)
        o_ref, states_ref = gdn.delta_rule(*before, state, keep=n, mode=mode)
        assert o.dtype == state_dtype and torch.equal(o, o_ref) and torch.equal(states, states_ref), mode
    ring, ring_ref = (state.expand(3, *state.shape).clone() for _ in range(2))
    src, dst = torch.tensor([0]), torch.tensor([1, 2])
    o = REF.delta_rule_slots(q, k, v, g, beta, ring, src, dst, key_heads=key_heads)
    o_ref = REF.delta_rule_slots(*before, ring_ref, src, dst)
    assert torch.equal(o, o_ref) and torch.equal(ring, ring_ref)


# ---- launches ------------------------------------------------------------------------------------

MIXER_KERNELS = Counter({"triton.gdn_step_kernel": 1})  # conv, q, k norms, gates and output norm inside
# the kernels of a Gated DeltaNet block of the tiny Qwen3.5 in a decode step: the input norm (in the
# first block; in the others the previous block's down product, reading silu(gate)·up itself, whose
# launch ends with the residual add and this norm), the grouped input product, the mixer's kernel,
# the output product with the residual add and post norm in its launch, grouped gate/up (were 13:
# the conv, the two l2 norms, the gates, the gated norm and silu_mul launched apart; 7 with the
# norms launched apart from the products)
GDN_BLOCK_LAUNCHES = 5


@pytest.fixture(scope="module")
def q8_files(tmp_path_factory):
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_qwen3next import build_qwen3next

    root = tmp_path_factory.mktemp("gdn-launches")
    return {"qwen35": tiny_gguf(tmp_path_factory, outtype="q8_0")[1],
            "qwen3next": convert_gguf(build_qwen3next(root / "hf"), root / "q3n.gguf", outtype="q8_0")}


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_a_mixer_call_launches_its_products_and_one_kernel(arch, q8_files):
    """One Gated DeltaNet mixer call on the meta device with the CUDA backend's choices (bf16, a decode
    step of 1 token and a verification batch of 4): the launch outside its products is exactly the
    step (conv, norms, gates and the gated output norm inside): no copy, cast or tiling."""
    mixer = {"qwen35": qwen35.gated_deltanet, "qwen3next": qwen3next.gated_deltanet}[arch]
    with cuda_op_count.meta_launches(), cuda_op_count.cuda_backend_on_meta() as backend:
        model = load_model(q8_files[arch], device="meta", dtype="bf16")
        hp, layer = model.hparams, model.hparams.recurrent.index(True)
        ctx = Context(model, GraphType.MAIN, n_ctx=16, n_rs_seq=3)
        # the arrival counters the step's output norm uses: made once per device, by the first
        # forward (a prompt, before any step is captured), not by each step
        kt_common.tile_counters(torch.device("meta"), hp.linear_num_value_heads)
        products, group = backend.linear, backend.linear_group
        for n in (1, 4):
            batch = ctx.memory.begin(0, torch.arange(n, device="meta"), list(range(n)))
            batch.index(torch.device("meta"))  # the batch's addresses, built once per batch before its blocks
            a = torch.empty(n, hp.hidden_size, dtype=BF16, device="meta")
            with cuda_op_count.counting() as counter, batch_invariant(True):
                def linear(x, w):
                    with counter.labelled("products"):
                        return products(x, w)

                def linear_group(x, ws):
                    with counter.labelled("products"):
                        return group(x, ws)

                backend.linear, backend.linear_group = linear, linear_group
                try:
                    y = made(mixer(model.weights, hp, layer, a, batch, "auto"))  # its output product too
                finally:
                    del backend.linear, backend.linear_group
            launched = Counter({op: c for op, c in counter.tally.by_op.items()})
            in_products = counter.tally.by_label["products"]
            for op in list(launched):
                if op.startswith("triton.") and op not in MIXER_KERNELS:
                    launched.pop(op)  # the products' kernels (counted by label below)
            print(f"\n[meta, bf16, {arch}, {n} token(s)] mixer: {counter.tally.total} launches = {in_products} in "
                  f"its products + {dict(launched)}")
            assert y.shape == (n, hp.hidden_size) and y.dtype == BF16
            assert launched == MIXER_KERNELS
            assert counter.tally.total == in_products + sum(MIXER_KERNELS.values())


def test_a_decode_steps_recurrent_blocks_launch_only_kernels(q8_files, monkeypatch):
    """benchmarks/cuda_op_count.py's decode step and verification batch of the tiny Qwen3.5 (q8_0,
    bf16): in each Gated DeltaNet block every launch is a Triton kernel (the residual add after the
    FFN is done by the next norm's kernel) but, in the first block only, the batch's cell index
    (memory.BatchIndex, built once per batch; a captured step reads its static index instead), and
    there are GDN_BLOCK_LAUNCHES kernels in each."""
    per_block: dict[int, Counter] = {}
    real_add = cuda_op_count.Tally.add

    def add(self, label, op):
        real_add(self, label, op)
        per_block.setdefault(id(self), Counter())[(label, op)] += 1

    monkeypatch.setattr(cuda_op_count.Tally, "add", add)
    counts = cuda_op_count.count_steps(q8_files["qwen35"], "bf16", 3)
    print(f"\n[meta, bf16] {cuda_op_count.report(counts, 3)}")
    recurrent = [i for i, r in enumerate(counts.recurrent) if r]
    for name, tally in (("step", counts.step), ("verification", counts.verify)):
        ops = per_block[id(tally)]
        for i in recurrent:
            aten = Counter({op: c for (label, op), c in ops.items() if label == f"block {i}"
                            and not op.startswith("triton.")})
            expected = Counter({"arange": 1} if i == recurrent[0] else {})
            assert aten == expected, (name, i, dict(aten))
            kernels = sum(c for (label, op), c in ops.items() if label == f"block {i}" and op.startswith("triton."))
            assert kernels == GDN_BLOCK_LAUNCHES, (name, i, kernels)
        print(f"{name}: {GDN_BLOCK_LAUNCHES} kernel launches in each of the {len(recurrent)} Gated DeltaNet blocks")


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_plain_decoding_folds_the_conv_too(arch, q8_files):
    """A plain decoding context holds one recurrent state (n_rs_seq = 0) in two slots, so a step
    never writes the slot it reads and the conv runs inside the delta rule's launch, as in a
    speculative context: the same launches per step (on a GPU the profiler counted a separate
    causal_conv_kernel per Gated DeltaNet block of plain steps while the ring had one slot)."""
    plain, speculative = (cuda_op_count.count_steps(q8_files[arch], "bf16", k) for k in (0, 3))
    print(f"\n[{arch}, meta, bf16] plain step {plain.step.total} launches, speculative context's step "
          f"{speculative.step.total}")
    assert plain.step.by_op == speculative.step.by_op
    assert not plain.step.by_op["triton.causal_conv_kernel"]
