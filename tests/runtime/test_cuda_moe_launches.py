"""Fewer launches in a MoE block on the CUDA backend: the softmax router in one launch
(runtime/kernels_triton/routing.py `softmax_topk`, CudaBackend.route_softmax_topk).

* the kernel against the torch formula (softmax, topk, weights / their sum): the same chosen
  experts on inputs without ties, weights within a stated float32 ulp bound (printed); ties: the
  lowest index first;
* batch invariance: a row alone has the bits of the same row in a batch of 16;
* the routed experts' pairs without a sort, gather or repeated x: `expert_matmul(..., fanout=k)`
  (each row of x read for its k pairs) has the bits of the product over x repeated k times, and
  `moe_combine` (weights · pair outputs summed per row in increasing expert order) the bits of the
  torch formula it replaces, rows alone == in a batch of 16;
* the gate and up products of the pairs in one launch (`expert_matmul_pair`), each the bits of its
  own `expert_matmul`;
* the routed sum plus the sigmoid-gated shared expert in one launch (`add_gated_shared`) against the
  torch formula: float32 within a stated ulp bound, bf16 within one bf16 ulp (printed); inside the
  combine launch (`moe_combine(..., shared_gate=)`) the bits of the combine then that launch, and
  in the tiny Qwen3.5 MoE step one launch fewer per block;
* launches of one decode step and one verification batch of the tiny Qwen3.5 MoE (counted on the
  `meta` device by benchmarks/cuda_op_count.py): the router's torch formula (softmax, topk, sum,
  div) becomes one launch per MoE block, nothing else changes.
Without a GPU the kernel runs in Triton's interpreter; with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_mode import DEVICE, ON_GPU  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from benchmarks import cuda_op_count  # noqa: E402
from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import kernels_triton as kt  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from tests.fixtures.counted_calls import CountedCalls  # noqa: E402
from tests.fixtures.runtime_common import tiny_gguf  # noqa: E402

torch.set_num_threads(1)
MAX_ULPS = 8  # exp, two divisions and two float32 sums in another order: a few ulps of each weight


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| in float32 ulps of want."""
    want = want.abs()
    spacing = torch.nextafter(want, torch.full_like(want, float("inf"))) - want
    return float(((got.abs() - want).abs() / spacing).max())


def logits(n: int, n_experts: int, seed: int) -> torch.Tensor:
    """Distinct random logits (a router's scale): no ties, so the chosen set is defined."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, n_experts, generator=gen) * 2.0).to(DEVICE)


@pytest.mark.parametrize("n_experts,k", [(8, 2), (60, 4), (128, 8), (512, 10), (1000, 1)])
def test_router_kernel_matches_the_torch_formula(n_experts, k):
    x = logits(16, n_experts, seed=n_experts + k)
    weights, chosen = kt.softmax_topk(x, k)
    ref_w, ref_c = TorchBackend().route_softmax_topk(x.cpu(), k)
    assert weights.dtype == torch.float32 and chosen.dtype == torch.int64
    assert torch.equal(chosen.cpu().sort(-1).values, ref_c.sort(-1).values)
    # both in decreasing order of weight: slot by slot the same expert
    assert torch.equal(chosen.cpu(), ref_c)
    err = ulps(weights.cpu(), ref_w)
    print(f"\n[softmax_topk {DEVICE.type}, {n_experts} experts, k={k}] chosen equal; "
          f"max weight error {err:.1f} ulps (bound {MAX_ULPS})")
    assert err <= MAX_ULPS
    assert float((weights.sum(-1) - 1).abs().max()) < 1e-6


def test_ties_take_the_lowest_index_first():
    x = torch.zeros(3, 16, device=DEVICE)
    x[1, [3, 9, 12]] = 1.0  # three equal largest logits, then thirteen equal ones
    x[2, 5] = float("-inf")  # an expert that can never win is still skipped among ties
    _, chosen = kt.softmax_topk(x, 4)
    assert chosen.cpu().tolist() == [[0, 1, 2, 3], [3, 9, 12, 0], [0, 1, 2, 3]]


def test_a_row_alone_has_the_bits_of_the_row_in_a_batch_of_16():
    x = logits(16, 128, seed=7)
    batch_w, batch_c = kt.softmax_topk(x, 8)
    for r in (0, 5, 15):
        w, c = kt.softmax_topk(x[r:r + 1].clone(), 8)
        assert torch.equal(w, batch_w[r:r + 1]) and torch.equal(c, batch_c[r:r + 1])


def test_the_backend_takes_the_kernel_for_float32_logits_only(monkeypatch):
    backend = CudaBackend(kt, device_types=(DEVICE.type,))
    taken = []
    monkeypatch.setattr(kt, "softmax_topk", lambda *a: taken.append(1) or TorchBackend().route_softmax_topk(*a))
    backend.route_softmax_topk(logits(2, 8, seed=1), 2)
    assert taken == [1]
    w, _ = backend.route_softmax_topk(logits(2, 8, seed=1).double(), 2)  # float64: the torch formula
    assert taken == [1] and w.dtype == torch.float64


def test_bad_input_one_line_errors():
    with pytest.raises(SpecconvError, match="expected logits"):
        kt.softmax_topk(torch.zeros(4, device=DEVICE), 1)
    with pytest.raises(SpecconvError, match="0 < k"):
        kt.softmax_topk(torch.zeros(2, 4, device=DEVICE), 5)
    with pytest.raises(SpecconvError, match="float32, bfloat16 or float16"):
        kt.softmax_topk(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), 1)


def reference_combine(y: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The torch formula: slots sorted by expert, Σ float32(y) · weight from 0 in that order."""
    n, k = chosen.shape
    order = chosen.argsort(dim=-1)
    w = weights.gather(1, order)
    y = y.reshape(n, k, -1).gather(1, order[:, :, None].expand(n, k, y.shape[-1]))
    total = torch.zeros(n, y.shape[-1], dtype=torch.float32)
    for s in range(k):
        total = total + y[:, s].to(torch.float32) * w[:, s:s + 1]
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,width", [(1, 8, 64), (4, 3, 1500), (16, 2, 256)])
def test_combine_has_the_bits_of_the_torch_formula(n, k, width, dtype):
    gen = torch.Generator().manual_seed(n * 100 + k)
    chosen = torch.stack([torch.randperm(40, generator=gen)[:k] for _ in range(n)])  # unsorted, distinct
    weights = torch.rand(n, k, generator=gen)
    weights = weights / weights.sum(-1, keepdim=True)
    y = torch.randn(n * k, width, generator=gen).to(dtype)
    got = kt.moe_combine(y.to(DEVICE), weights.to(DEVICE), chosen.to(DEVICE)).cpu()
    want = reference_combine(y, weights, chosen)
    print(f"\n[moe_combine {DEVICE.type}, n={n}, k={k}, {dtype}] equal bits to the torch formula: "
          f"{torch.equal(got, want)}")
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if n > 1:  # a row alone: the bits of the same row in the batch
        alone = kt.moe_combine(y[:k].to(DEVICE), weights[:1].to(DEVICE), chosen[:1].to(DEVICE)).cpu()
        assert torch.equal(alone, got[:1])


def test_expert_pairs_read_each_row_once_with_the_bits_of_a_repeated_x():
    from gguf import GGMLQuantizationType as QType

    from tests.fixtures.quant_rows import sane_rows

    n_expert, n_out, n_in, n, k = 6, 32, 256, 4, 3
    raw = sane_rows(QType.Q8_0, n_expert * n_out, n_in, seed=5)
    raw = raw.reshape(n_expert, n_out, raw.shape[-1]).to(DEVICE)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(n, n_in, generator=gen).to(torch.bfloat16).to(DEVICE)
    pairs = torch.stack([torch.randperm(n_expert, generator=gen)[:k] for _ in range(n)]).reshape(-1).to(DEVICE)
    shared = kt.expert_matmul(x, raw, QType.Q8_0, n_out, n_in, pairs, fanout=k)
    repeated = kt.expert_matmul(x.repeat_interleave(k, dim=0), raw, QType.Q8_0, n_out, n_in, pairs)
    assert shared.shape == (n * k, n_out) and torch.equal(shared, repeated)
    with pytest.raises(SpecconvError, match="per activation row"):
        kt.expert_matmul(x, raw, QType.Q8_0, n_out, n_in, pairs[:-1], fanout=k)


@pytest.mark.parametrize("n_out,n_in", [(32, 256), (32, 2048)])  # the second cut along its inner dimension
def test_gate_and_up_by_pairs_in_one_launch_have_the_bits_of_two(n_out, n_in):
    from gguf import GGMLQuantizationType as QType

    from tests.fixtures.quant_rows import sane_rows

    n_expert, n, k = 5, 3, 2
    gate, up = (sane_rows(QType.Q8_0, n_expert * n_out, n_in, seed=s).reshape(n_expert, n_out, -1).to(DEVICE)
                for s in (11, 12))
    gen = torch.Generator().manual_seed(n_out)
    x = torch.randn(n, n_in, generator=gen).to(torch.bfloat16).to(DEVICE)
    pairs = torch.stack([torch.randperm(n_expert, generator=gen)[:k] for _ in range(n)]).reshape(-1).to(DEVICE)
    g, u = kt.expert_matmul_pair(x, [gate, up], QType.Q8_0, n_out, n_in, pairs, fanout=k)
    assert torch.equal(g, kt.expert_matmul(x, gate, QType.Q8_0, n_out, n_in, pairs, fanout=k))
    assert torch.equal(u, kt.expert_matmul(x, up, QType.Q8_0, n_out, n_in, pairs, fanout=k))
    assert g.is_contiguous() and u.is_contiguous()
    with pytest.raises(SpecconvError, match="one shape"):
        kt.expert_matmul_pair(x, [gate, up[:4]], QType.Q8_0, n_out, n_in, pairs, fanout=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_shared_expert_add_matches_the_torch_formula(dtype):
    gen = torch.Generator().manual_seed(21)
    n, width = 16, 1500
    routed = torch.randn(n, width, generator=gen)
    shared = torch.randn(n, width, generator=gen).to(dtype)
    gate = torch.randn(n, 1, generator=gen) * 4
    got = kt.add_gated_shared(routed.to(DEVICE), shared.to(DEVICE), gate.to(DEVICE)).cpu()
    want = TorchBackend().add_gated_shared(routed, shared, gate)
    assert got.dtype == dtype
    # errors in ulps of the terms' scale |routed| + |shared| (σ ≤ 1): where they cancel, a few ulps
    # of a term are many ulps of the small sum
    scale = routed.abs() + shared.float().abs()
    ulp = (torch.nextafter(scale, torch.full_like(scale, float("inf"))) - scale) * (
        1 if dtype == torch.float32 else 2 ** 16)  # a bfloat16 ulp is 2^16 float32 ulps
    worst = float(((got.float() - want.float()).abs() / ulp).max())
    # bf16: the gated term and the sum each round at most one ulp apart from the reference's (to nearest
    # on a GPU); the interpreter truncates its three bf16 roundings (a further ulp at most)
    bound = MAX_ULPS if dtype == torch.float32 else (2.0 if ON_GPU else 3.0)
    print(f"\n[add_gated_shared {DEVICE.type}, {dtype}] max error {worst:.2f} ulps of the terms (bound {bound}); "
          f"{int((got != want).sum())} of {got.numel()} values differ")
    assert worst <= bound
    alone = kt.add_gated_shared(routed[3:4].to(DEVICE), shared[3:4].to(DEVICE), gate[3:4].to(DEVICE)).cpu()
    assert torch.equal(alone, got[3:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_with_the_gated_shared_expert_has_the_bits_of_the_two_launches(dtype):
    """moe_combine with `shared_gate`: the bits of moe_combine's float32 sum, then add_gated_shared's
    launch (rows 1..16 of a batch; a row alone = in the batch); a gate without shared, or not [n, 1]
    float32, is a one-line error."""
    gen = torch.Generator().manual_seed(31)
    n, k, width = 16, 3, 1500
    chosen = torch.stack([torch.randperm(40, generator=gen)[:k] for _ in range(n)]).to(DEVICE)
    weights = torch.rand(n, k, generator=gen)
    weights = (weights / weights.sum(-1, keepdim=True)).to(DEVICE)
    y = torch.randn(n * k, width, generator=gen).to(dtype).to(DEVICE)
    shared = torch.randn(n, width, generator=gen).to(dtype).to(DEVICE)
    gate = (torch.randn(n, 1, generator=gen) * 4).to(DEVICE)
    got = kt.moe_combine(y, weights, chosen, shared, dtype, shared_gate=gate)
    want = kt.add_gated_shared(kt.moe_combine(y, weights, chosen), shared, gate)
    assert got.dtype == dtype and torch.equal(got, want)
    alone = kt.moe_combine(y[3 * k:4 * k], weights[3:4], chosen[3:4], shared[3:4], dtype, shared_gate=gate[3:4])
    assert torch.equal(alone, got[3:4])
    print(f"\n[moe_combine + gated shared, {DEVICE.type}, {dtype}] the bits of the combine then add_gated_shared")
    for kwargs, needle in (({"shared_gate": gate}, "with shared"), ({"shared": shared, "shared_gate": gate.double()},
                                                                    "float32 \\[n, 1\\]")):
        with pytest.raises(SpecconvError, match=needle):
            kt.moe_combine(y, weights, chosen, **kwargs)


def test_the_router_and_the_shared_gate_in_one_launch(monkeypatch):
    """CudaBackend.linear_wide_group of float32 weights (a router [E, H], a shared-expert gate [1, H],
    dense or stored F32) by 1..16 bf16 rows: one grouped launch, each output the bits of its own
    linear_wide; TorchBackend's (and 17 rows, and a quantized weight): linear_wide each."""
    from gguf import GGMLQuantizationType as QType

    from specconv.runtime.stored import StoredWeight
    from tests.fixtures.quant_rows import sane_rows
    from tests.fixtures.triton_mode import record_launches

    launched = record_launches(monkeypatch)
    cuda = CudaBackend(kt, device_types=(DEVICE.type,))
    gen = torch.Generator().manual_seed(41)
    router = torch.randn(24, 256, generator=gen).to(DEVICE)
    gate = StoredWeight(torch.randn(1, 256, generator=gen).view(torch.uint8).to(DEVICE), QType.F32, (1, 256),
                        torch.float32, DEVICE)
    x = torch.randn(17, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    for rows in (1, 4, 16):
        del launched[:]
        got = cuda.linear_wide_group(x[:rows], (router, gate))
        assert launched == ["grouped_rows_kernel"], launched
        want = tuple(cuda.linear_wide(x[:rows], w) for w in (router, gate))
        assert all(g.dtype == torch.float32 and torch.equal(g, w) for g, w in zip(got, want, strict=True)), rows
    del launched[:]
    assert all(torch.equal(g, w) for g, w in zip(cuda.linear_wide_group(x, (router, gate)),
                                                  (cuda.linear_wide(x, router), cuda.linear_wide(x, gate))))
    assert "grouped_rows_kernel" not in launched
    quantized = StoredWeight(sane_rows(QType.Q8_0, 8, 256, seed=42).to(DEVICE), QType.Q8_0, (8, 256), torch.bfloat16,
                             DEVICE)
    del launched[:]
    mixed = cuda.linear_wide_group(x[:2], (router, quantized))
    assert "grouped_rows_kernel" not in launched and torch.equal(mixed[1], cuda.linear_wide(x[:2], quantized))
    ref, xc = TorchBackend(), x[:3].cpu()
    assert all(torch.equal(g, ref.linear_wide(xc, w)) for g, w in zip(ref.linear_wide_group(xc, (router.cpu(),)),
                                                                       (router.cpu(),)))
    print(f"\n[{DEVICE.type}] router + shared gate: one grouped launch, each the bits of its own linear_wide")


class TorchRouter(CudaBackend, CountedCalls):
    """The CUDA backend with the router's torch formula (the backend before the router kernel);
    counts the launches inside that formula per active op counter."""

    def __init__(self):
        super().__init__(kt, device_types=("meta",))
        self.init_counts()

    def route_softmax_topk(self, logits, k):
        return self.counted(lambda: TorchBackend.route_softmax_topk(self, logits, k))


@pytest.fixture(scope="module")
def moe_q8(tmp_path_factory):
    return tiny_gguf(tmp_path_factory, moe=True, outtype="q8_0")[1]


def test_the_router_is_one_launch_per_moe_block(moe_q8):
    k = 3
    fused = cuda_op_count.count_steps(moe_q8, "bf16", k)
    before = TorchRouter()
    unfused = cuda_op_count.count_steps(moe_q8, "bf16", k, backend=before)
    n_blocks = len(fused.recurrent)
    for name, new, old in (("step", fused.step, unfused.step), ("verification", fused.verify, unfused.verify)):
        calls, inside = before.calls[id(old)], before.inside[id(old)]
        launches = new.by_op["triton.softmax_topk_kernel"]
        print(f"\n[meta, bf16, {name}] {old.total} -> {new.total} launches: {calls} routers, "
              f"{inside} launches of their torch formula -> {launches}")
        assert calls == launches == n_blocks  # every block of the tiny model is a MoE block
        assert inside == 4 * calls  # softmax, topk, sum, div
        assert new.total == old.total - inside + launches
        assert not any(new.by_op[op] for op in ("softmax", "topk"))


# a product cut along its inner dimension adds its pieces in its own launch: no sum_parts_kernel
PAIR_LAUNCHES = {"triton.fused_rows_kernel", "triton.combine_kernel"}


class CountedMoe(CudaBackend, CountedCalls):
    """The CUDA backend counting the launches inside each `moe` call (per active op counter)."""

    def __init__(self):
        super().__init__(kt, device_types=("meta",))
        self.init_counts()

    def moe(self, x, weights, chosen, experts):
        return self.counted(lambda: super(CountedMoe, self).moe(x, weights, chosen, experts))

    def moe_out(self, x, weights, chosen, experts, shared=None, shared_gate=None):
        return self.counted(lambda: super(CountedMoe, self).moe_out(x, weights, chosen, experts, shared, shared_gate))


class SharedAddApart(CudaBackend, CountedCalls):
    """The CUDA backend counting, per active op counter, its moe_out calls with a gated shared expert
    and the launches inside them; with `formula`, the shared add as add_gated_shared's torch
    formula after the routed sum, else as its one launch (the backend before the combine made it)."""

    def __init__(self, formula: bool):
        super().__init__(kt, device_types=("meta",))
        self.init_counts()
        self.formula = formula

    def moe_out(self, x, weights, chosen, experts, shared=None, shared_gate=None):
        add = TorchBackend.add_gated_shared if self.formula else CudaBackend.add_gated_shared
        return self.counted(lambda: add(self, self.moe(x, weights, chosen, experts), shared, shared_gate))


class WideApart(CudaBackend, CountedCalls):
    """The CUDA backend running linear_wide_group as linear_wide each (the backend before the group),
    counting the launches inside."""

    def __init__(self):
        super().__init__(kt, device_types=("meta",))
        self.init_counts()

    def linear_wide_group(self, x, ws):
        return self.counted(lambda: TorchBackend.linear_wide_group(self, x, ws))


def test_the_router_and_the_shared_gate_are_one_launch_per_moe_block(moe_q8):
    fused = cuda_op_count.count_steps(moe_q8, "bf16", 3)
    before = WideApart()
    unfused = cuda_op_count.count_steps(moe_q8, "bf16", 3, backend=before)
    for name, new, old in (("step", fused.step, unfused.step), ("verification", fused.verify, unfused.verify)):
        calls, inside = before.calls[id(old)], before.inside[id(old)]
        print(f"\n[meta, bf16, {name}] {old.total} -> {new.total} launches: {calls} router + gate products")
        assert calls == len(fused.recurrent) and inside == 2 * calls
        assert new.total == old.total - calls


def test_the_shared_expert_add_is_inside_the_combine_launch(moe_q8):
    """Per MoE block the routed experts' combine also adds the gated shared expert: one launch fewer
    than the combine then add_gated_shared's launch, six fewer than its torch formula (two roundings,
    the widening, sigmoid, mul, add), nothing else changed, no gated_shared_kernel or sigmoid left."""
    fused = cuda_op_count.count_steps(moe_q8, "bf16", 3)
    for formula, apart in ((False, 1), (True, 6)):
        before = SharedAddApart(formula)
        unfused = cuda_op_count.count_steps(moe_q8, "bf16", 3, backend=before)
        for name, new, old in (("step", fused.step, unfused.step), ("verification", fused.verify, unfused.verify)):
            calls, inside = before.calls[id(old)], before.inside[id(old)]
            print(f"\n[meta, bf16, {name}] {old.total} -> {new.total} launches: {calls} shared-expert adds "
                  f"{'as the torch formula' if formula else 'in a launch of their own'}")
            assert calls == len(fused.recurrent) and inside == calls * (3 + apart)  # pair products, combine
            assert new.total == old.total - apart * calls
            assert not new.by_op["triton.gated_shared_kernel"] and not new.by_op["sigmoid"]


def test_routed_experts_launch_their_products_and_one_combine(moe_q8):
    """Per MoE block: the expert products by pairs (gate and up in one launch, down reading SwiGLU's
    product as it loads its rows: no GLU launch, each adding its own pieces) and one combine: three
    launches; no argsort, gather, repeat_interleave, zeros or per-slot mul / add / cast."""
    backend = CountedMoe()
    counts = cuda_op_count.count_steps(moe_q8, "bf16", 3, backend=backend)
    for name, tally in (("step", counts.step), ("verification", counts.verify)):
        calls = backend.ops[id(tally)]
        print(f"\n[meta, bf16, {name}] launches inside moe per block: {dict(calls[0])}")
        assert len(calls) == len(counts.recurrent)
        for ops in calls:
            assert set(ops) <= PAIR_LAUNCHES, set(ops) - PAIR_LAUNCHES
            assert sum(ops.values()) == 3, ops
            assert ops["triton.combine_kernel"] == 1
            assert ops["triton.fused_rows_kernel"] == 2  # gate and up by pairs in one launch, down
        assert not any(tally.by_op[op] for op in ("argsort", "gather", "repeat_interleave", "zeros"))
