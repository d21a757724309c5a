"""Products of the same activation rows by several weights in one launch (kernels_triton.grouped_matmul,
CudaBackend.linear_group, ops.linear_group):

* every output the same bits as the single-matrix kernel (quant_matmul) by that weight, for groups
  of 2-4 matrices of Q8_0, Q4_K, Q6_K, BF16 and F16 with different, odd numbers of rows, some cut
  along the inner dimension and some not, and within the single kernel's summation noise of the
  exact product of the reference decoder's values (runtime/dequant.py);
* batch invariance: a row alone gives the bits it gets in a batch of 16;
* the backend groups the weights by type (one launch per type, outputs in the callers' order) and
  falls back to `linear` per weight for 17 rows or a dense weight, with the same bits;
* a decode step of the tiny Qwen3.5 launches fewer kernels: each grouped call's per-weight
  launches become one (benchmarks/cuda_op_count.py, on the `meta` device).

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
tests/fixtures/triton_mode.py before Triton compiles a kernel); with one (and TRITON_INTERPRET unset) the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE, ON_GPU, WHERE  # noqa: E402 (no GPU: the interpreter)
pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from benchmarks import cuda_op_count  # noqa: E402
from specconv.archs.errors import SpecconvError  # noqa: E402
from specconv.runtime import kernels_triton as kt  # noqa: E402
from specconv.runtime.backend_cuda import CudaBackend, PairedExperts  # noqa: E402
from specconv.runtime.backend_torch import TorchBackend  # noqa: E402
from specconv.runtime.dequant import dequantize_rows as torch_dequantize  # noqa: E402
from specconv.runtime.graphs import ops  # noqa: E402
from specconv.runtime.kernels_triton import matmul as qm  # noqa: E402
from specconv.runtime.stored import StoredWeight  # noqa: E402
from tests.fixtures.quant_rows import sane_rows  # noqa: E402
from tests.fixtures.runtime_common import tiny_gguf  # noqa: E402
from tests.runtime.test_triton_kernels import FUSED_BOUND, OUTPUT_ULP, EPS, exact_product  # noqa: E402

# (type, inner dimension, numbers of rows of the group's matrices, activation dtype): odd sizes, a
# matrix of many tiles (not cut) next to matrices of few (cut along the inner dimension); 16-bit
# float rows end part-way through a 32-value step; Q4_K / Q5_K rows of an odd number of blocks (two a
# kernel step: a piece's last step partial)
GROUPS = [
    (QType.Q8_0, 512, (40, 17, 200, 33), torch.bfloat16),
    (QType.Q4_K, 1280, (17, 130, 5), torch.float32),
    (QType.Q5_K, 768, (9, 130, 40), torch.bfloat16),
    (QType.Q6_K, 512, (200, 9), torch.bfloat16),
    (QType.BF16, 520, (33, 16, 130, 7), torch.bfloat16),
    (QType.F16, 520, (24, 129, 3), torch.float16),
]


def packed_group(qtype: QType, n_in: int, n_outs, seed: int) -> list[torch.Tensor]:
    return [sane_rows(qtype, n_out, n_in, seed=seed + g).to(DEVICE) for g, n_out in enumerate(n_outs)]


def activations(rows: int, n_in: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, n_in, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def pieces(qtype: QType, n_out: int, n_in: int) -> int:
    return qm.split_plan(qtype, n_out, -(-n_in // qm.GEOMETRY[qtype][0]), DEVICE)[0]


# ---- the kernel ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype, n_in, n_outs, dtype", GROUPS, ids=lambda v: getattr(v, "name", None))
def test_each_output_is_the_single_matrix_kernel(qtype, n_in, n_outs, dtype):
    mats = packed_group(qtype, n_in, n_outs, seed=len(n_outs))
    cut = [pieces(qtype, n_out, n_in) > 1 for n_out in n_outs]
    if not ON_GPU:  # the interpreter's stand-in multiprocessor count cuts some of the group, not all
        assert any(cut) and not all(cut), cut
    worst = 0.0
    for rows in (1, 5):
        x = activations(rows, n_in, dtype, seed=rows)
        ys = kt.grouped_matmul(x, mats, qtype, n_outs, n_in)
        assert len(ys) == len(n_outs)
        for w, n_out, y in zip(mats, n_outs, ys):
            assert y.shape == (rows, n_out) and y.dtype == dtype and y.is_contiguous()
            assert torch.equal(y, kt.quant_matmul(x, w, qtype, n_out, n_in)), (rows, n_out)
            exact, scale = exact_product(x.cpu().float(), torch_dequantize(w.cpu(), qtype))
            bound = FUSED_BOUND * EPS * scale + OUTPUT_ULP[dtype] * (exact.abs() + FUSED_BOUND * EPS * scale)
            worst = max(worst, float(((y.cpu().double() - exact).abs() / bound).max()))
    print(f"\n[{WHERE}] grouped {qtype.name} x {len(n_outs)} {list(n_outs)} (cut {cut}), x {dtype}: every output "
          f"= the single-matrix kernel's bits; worst |Δ| / noise bound against the exact product {worst:.3f}")
    assert worst <= 1.0


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K], ids=lambda t: t.name)
def test_a_row_alone_equals_the_row_in_a_batch_of_16(qtype):
    n_in, n_outs = 512, (17, 40, 3)
    mats = packed_group(qtype, n_in, n_outs, seed=7)
    x = activations(16, n_in, torch.bfloat16, seed=16)
    full = kt.grouped_matmul(x, mats, qtype, n_outs, n_in)
    for m in (0, 9, 15):
        alone = kt.grouped_matmul(x[m:m + 1], mats, qtype, n_outs, n_in)
        assert all(torch.equal(a, f[m:m + 1]) for a, f in zip(alone, full)), m
    part = kt.grouped_matmul(x[4:7], mats, qtype, n_outs, n_in)
    assert all(torch.equal(p, f[4:7]) for p, f in zip(part, full))


def test_more_than_four_matrices_and_more_rows():
    """Six matrices: two launches of up to GROUP_MAX; 17 rows: quant_matmul per matrix (the prompt
    path). Outputs as the single-matrix products, shaped like x ([2, 3, n_in] here)."""
    qtype, n_in, n_outs = QType.BF16, 96, (5, 16, 33, 2, 19, 8)
    mats = packed_group(qtype, n_in, n_outs, seed=11)
    for shape in ((2, 3), (17,)):
        x = torch.randn(*shape, n_in, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        ys = kt.grouped_matmul(x, mats, qtype, n_outs, n_in)
        for w, n_out, y in zip(mats, n_outs, ys):
            assert y.shape == (*shape, n_out)
            assert torch.equal(y, kt.quant_matmul(x, w, qtype, n_out, n_in)), (shape, n_out)


def test_bad_input_one_line_errors():
    qtype, n_in = QType.Q8_0, 64
    mats = packed_group(qtype, n_in, (4, 6), seed=1)
    x = activations(2, n_in, torch.float32, seed=1)
    for call, message in (
        (lambda: kt.grouped_matmul(x, mats, qtype, (4,), n_in), "one n_out per matrix"),
        (lambda: kt.grouped_matmul(x, [], qtype, (), n_in), "at least one matrix"),
        (lambda: kt.grouped_matmul(x, mats, qtype, (4, 7), n_in), "packed has shape"),
        (lambda: kt.grouped_matmul(x, mats, QType.Q4_0, (4, 6), n_in), "no Triton kernel for Q4_0"),
        (lambda: kt.grouped_matmul(x[:, :32], mats, qtype, (4, 6), n_in), r"expected \[..., 64\]"),
        (lambda: kt.grouped_matmul(x.long(), mats, qtype, (4, 6), n_in), "float32, bfloat16 or float16"),
    ):
        with pytest.raises(SpecconvError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


# ---- the backend --------------------------------------------------------------------------------

class RecordingKernels:
    """runtime/kernels_triton, recording the types and sizes of its grouped_matmul calls."""

    def __init__(self):
        self.grouped = []

    def __getattr__(self, name):
        return getattr(kt, name)

    def grouped_matmul(self, x, packed, qtype, n_outs, n_in):
        self.grouped.append((qtype, tuple(n_outs)))
        return kt.grouped_matmul(x, packed, qtype, n_outs, n_in)


def stored(qtype: QType, n_out: int, n_in: int, seed: int) -> StoredWeight:
    return StoredWeight(sane_rows(qtype, n_out, n_in, seed=seed).to(DEVICE), qtype, (n_out, n_in), torch.bfloat16,
                        DEVICE)


def test_backend_groups_by_type_and_keeps_the_order():
    """A mixed-type file (Q4_K_M keeps some tensors at Q6_K): one launch per type, each output the
    bits of the backend's own `linear` by that weight, in the callers' order."""
    kernels = RecordingKernels()
    backend = CudaBackend(kernels, device_types=(DEVICE.type,))
    n_in = 256
    ws = [stored(QType.Q4_K, 20, n_in, 1), stored(QType.Q6_K, 9, n_in, 2), stored(QType.Q4_K, 33, n_in, 3),
          stored(QType.Q6_K, 16, n_in, 4), stored(QType.Q8_0, 5, n_in, 5)]
    x = activations(3, n_in, torch.bfloat16, seed=4)
    ys = backend.linear_group(x, ws)
    assert kernels.grouped == [(QType.Q4_K, (20, 33)), (QType.Q6_K, (9, 16))]  # Q8_0 alone: `linear`
    for w, y in zip(ws, ys):
        assert torch.equal(y, backend.linear(x, w)), w


def test_backend_falls_back_to_linear_per_weight():
    """17 rows (a prompt): `linear` per weight, also inside batch_invariant; a dense weight in the group:
    `linear` for it, the stored ones grouped; a type without a kernel: `linear`."""
    from specconv.runtime.backend import batch_invariant

    kernels = RecordingKernels()
    backend = CudaBackend(kernels, device_types=(DEVICE.type,))
    n_in = 64
    ws = [stored(QType.Q8_0, 12, n_in, 1), stored(QType.Q8_0, 7, n_in, 2)]
    for invariant in (False, True):
        with batch_invariant(invariant):
            x = activations(17, n_in, torch.bfloat16, seed=17)
            ys = backend.linear_group(x, ws)
            assert all(torch.equal(y, backend.linear(x, w)) for w, y in zip(ws, ys))
    assert kernels.grouped == []
    dense = torch.randn(5, n_in, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    legacy = stored(QType.Q4_0, 6, n_in, 3)
    x = activations(2, n_in, torch.bfloat16, seed=2)
    mixed = [ws[0], dense, legacy, ws[1]]
    ys = backend.linear_group(x, mixed)
    assert kernels.grouped == [(QType.Q8_0, (12, 7))]
    assert all(torch.equal(y, backend.linear(x, w)) for w, y in zip(mixed, ys))


def test_ops_linear_group_shows_every_product_to_the_observer():
    """The activation observer (imatrix) sees each weight's product, as with `linear` one at a time;
    the CPU's backend computes `linear` per weight."""
    from specconv.runtime.backend import observing

    seen = []

    class Observer:
        def product(self, x, w):
            seen.append((x, w))

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    ws = [StoredWeight(sane_rows(QType.Q8_0, 4, 64, seed=1), QType.Q8_0, (4, 64), torch.float32, "cpu"),
          torch.randn(6, 64, generator=torch.Generator().manual_seed(2))]
    with observing(Observer()):
        ys = ops.linear_group(x, ws)
    assert [w for _, w in seen] == ws and all(seen_x is x for seen_x, _ in seen)
    assert all(torch.equal(y, ops.linear(x, w)) for w, y in zip(ws, ys))


# ---- a decode step ------------------------------------------------------------------------------

class PerWeightOn(CudaBackend):
    """The CUDA backend on `device_type` with `linear` per weight in linear_group, and `linear_wide` per
    weight in linear_wide_group (what it ran before grouping)."""

    def __init__(self, device_type: str):
        super().__init__(kt, device_types=(device_type,))

    def linear_group(self, x, ws):
        if any(isinstance(w, PairedExperts) for w in ws):  # routed experts by pairs: not the grouping of matrices
            return super().linear_group(x, ws)
        return TorchBackend.linear_group(self, x, ws)

    def linear_wide_group(self, x, ws):
        return TorchBackend.linear_wide_group(self, x, ws)


class PerWeight(PerWeightOn):
    """PerWeightOn on `meta`, counting per active op counter the calls whose weights are all stored
    matrices (the routed experts' products by index are not), their weights and the launches inside
    them."""

    def __init__(self):
        super().__init__("meta")
        self.calls, self.weights, self.inside = Counter(), Counter(), Counter()

    def linear_group(self, x, ws):
        return self._counted(ws, lambda: super(PerWeight, self).linear_group(x, ws))

    def linear_wide_group(self, x, ws):  # a MoE block's router and shared gate (float32 weights)
        return self._counted(ws, lambda: super(PerWeight, self).linear_wide_group(x, ws))

    def _counted(self, ws, run):
        counters = cuda_op_count.active_counters()
        if not counters or not all(isinstance(w, StoredWeight) for w in ws):
            return run()
        with cuda_op_count.counting() as inside:
            out = run()
        key = id(counters[0].tally)
        self.calls[key] += 1
        self.weights[key] += len(ws)
        self.inside[key] += inside.tally.total
        return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_decode_step_launches_one_kernel_per_group(moe, tmp_path_factory):
    """The tiny Qwen3.5 in q8_0 (every projection one type): each linear_group call by stored matrices
    has its per-weight launches become one grouped launch (none of its matrices is cut on the planned
    GPU), the rest of the step unchanged."""
    path = tiny_gguf(tmp_path_factory, moe=moe, outtype="q8_0")[1]
    k = 3
    grouped = cuda_op_count.count_steps(path, "bf16", k)
    before = PerWeight()
    per_weight = cuda_op_count.count_steps(path, "bf16", k, backend=before)
    print(f"\n[meta, bf16] grouped products:\n{cuda_op_count.report(grouped, k)}")
    print(f"[meta, bf16] one launch per product:\n{cuda_op_count.report(per_weight, k)}")
    for name, new, old in (("step", grouped.step, per_weight.step), ("verification", grouped.verify,
                                                                    per_weight.verify)):
        calls, inside = before.calls[id(old)], before.inside[id(old)]
        launches = new.by_op["triton.grouped_rows_kernel"] + new.by_op["triton.grouped_sum_kernel"]
        print(f"{name}: {old.total} -> {new.total} launches: {calls} grouped calls of {before.weights[id(old)]} "
              f"products, {inside} launches -> {launches}")
        assert calls > 0 and new.by_op["triton.grouped_rows_kernel"] == calls  # one launch per call
        assert inside == before.weights[id(old)]  # one launch per product before (none cut)
        assert new.total == old.total - inside + launches  # and nothing else changed
        for kind, (_, each) in cuda_op_count.block_summary(new, grouped.recurrent).items():
            assert each < cuda_op_count.block_summary(old, per_weight.recurrent)[kind][1], kind


def test_the_forward_with_grouped_products_is_the_per_weight_forward_bit_for_bit(tmp_path_factory, monkeypatch):
    """The tiny Qwen3.5 (q8_0, bf16) through the CUDA backend, a prompt of 8 tokens and a verification
    batch of 4: the logits with grouped products are the bits of those with one launch per product."""
    from specconv.runtime import Context, GraphType, backend as backend_module, load_model
    from tests.fixtures.runtime_common import prompt_ids

    path = tiny_gguf(tmp_path_factory, outtype="q8_0")[1]
    model = load_model(path, device=DEVICE.type, dtype="bf16")
    ids = [int(t) for t in prompt_ids(12, seed=5)]
    logits, kernels = {}, RecordingKernels()
    for name, backend in (("grouped", CudaBackend(kernels, device_types=(DEVICE.type,))),
                          ("per weight", PerWeightOn(DEVICE.type))):
        monkeypatch.setattr(backend_module, "_backend", lambda kind, backend=backend: backend)
        ctx = Context(model, GraphType.MAIN, n_ctx=len(ids) + 2, n_rs_seq=3)
        logits[name] = torch.cat([ctx.decode(ids[:-4]).logits, ctx.decode(ids[-4:]).logits]).float()
    diff = float((logits["grouped"] - logits["per weight"]).abs().max())
    print(f"\n[{WHERE}, bf16] logits with grouped products vs one launch per product: max |Δlogit| {diff:.2e}")
    assert kernels.grouped and torch.equal(logits["grouped"], logits["per weight"])
