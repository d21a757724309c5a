"""Products cut along their inner dimension (matmul.split_plan) in ONE launch: each tile's pieces store
their float32 sums, then count their arrival on the tile's int32 counter (_common.tile_counters);
the last to arrive adds the pieces in order (part 0 + part 1 + ..., the operations of the second
launch it replaces: sum_parts_kernel, grouped_sum_kernel) and resets the counter.

* bit for bit the two-launch path (the same kernels without counters, as while a CUDA graph is
  captured) for single, GLU-fused, grouped and expert-pair products (gate / up by pairs, an expert
  FFN's down reading SwiGLU's values), cut and uncut shapes, 1 to 16 rows; and within the summation
  noise of the exact (float64) product of the reference decoder's values (runtime/dequant.py);
* a row alone is the bits of the same row in a batch of 16; two launches of one product the same bits;
* one launch per product (two without counters); the counters are all zero after every launch;
* the counters: none made while capturing (the product falls back to two launches and leaves a
  too-small buffer as it was), a larger one made outside a capture with the smaller kept;
* the compiled code for sm_90 (Triton's compiler, no GPU): the parts stored, a CTA barrier, ONE
  atom.global.gpu.acq_rel.add (release of the whole CTA's stores after the barrier, acquire of the
  other pieces'), the old count broadcast behind another barrier, then the parts read through L2
  (ld.global.cg), added in order (add.f32), rounded once, and the counter reset.

Without a GPU the kernels run in Triton's interpreter, one program after another (so the last piece
is the last program); with one, compiled on CUDA, in any order.
"""

from __future__ import annotations

import re
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.fixtures.triton_mode import DEVICE, WHERE, record_launches  # first: the interpreter without a GPU
from tests.runtime.test_triton_kernels import FUSED_BOUND, exact_product, noise  # skips where Triton is missing
from specconv.runtime import kernels_triton as kt
from specconv.runtime.dequant import dequantize_rows as torch_dequantize
from specconv.runtime.kernels_triton import _common, matmul as qm
from tests.fixtures.quant_rows import sane_rows

torch.set_num_threads(1)
# (type, n_out, n_in): under the interpreter's 2 stand-in multiprocessors (8 programs wanted) 37 rows
# (3 tiles) of 352 Q8_0 values are cut in 2, 16 rows of 2048 in 8, 16 rows of 1024 Q4_K values
# (two steps of matmul.STEP_BLOCKS = 2 super-blocks) in 2;
# 130 rows (9 tiles) and a row of one kernel step are not cut
SHAPES = [(QType.Q8_0, 37, 352), (QType.Q8_0, 16, 2048), (QType.Q4_K, 16, 1024), (QType.BF16, 21, 520),
          (QType.Q8_0, 130, 352), (QType.Q8_0, 37, 256)]
PRODUCT_KERNELS = {"fused_rows_kernel", "grouped_rows_kernel"}
SECOND_LAUNCHES = {"sum_parts_kernel", "grouped_sum_kernel"}
KEY = DEVICE if DEVICE.type == "cpu" else torch.device("cuda", torch.cuda.current_device())  # _counters' key


def pieces(qtype: QType, n_out: int, n_in: int) -> int:
    return qm.split_plan(qtype, n_out, -(-n_in // qm.GEOMETRY[qtype][0]), DEVICE)[0]


def rows_of(n: int, n_in: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, n_in, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def counters_at_rest() -> bool:
    """Every counter of the device's current buffer is zero."""
    return not bool(_common.tile_counters(DEVICE, 1).any())


class Paths:
    """A product by the one-launch path (tile counters) and by the two-launch path (no counters at
    hand: `_common.capturing` says a capture is under way and no buffer exists), with the launches of
    each and the counters checked back at zero after each one-launch product."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.launched = record_launches(monkeypatch)
        self.kept = []  # every result stays alive: no later output can land on an earlier one's bytes

    def one(self, product):
        del self.launched[:]
        out = product()
        assert counters_at_rest()
        self.kept.append(out)
        return out, list(self.launched)

    def two(self, product):
        with self.monkeypatch.context() as m:
            m.setattr(_common, "_counters", {})
            m.setattr(_common, "capturing", lambda device: True)
            del self.launched[:]
            out = product()
            assert _common._counters.get(KEY, []) == []  # nothing was made
        self.kept.append(out)
        return out, list(self.launched)


def check_launches(one: list[str], two: list[str], cut: bool) -> None:
    """The one-launch path launches one product kernel; the two-launch path the same and, where the
    product is cut, its second launch."""
    assert len(one) == 1 and set(one) <= PRODUCT_KERNELS, one
    assert two[:1] == one and (len(two) == 2 and set(two[1:]) <= SECOND_LAUNCHES) == cut, two


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("qtype, n_out, n_in", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_one_launch_is_the_two_launch_path_bit_for_bit(qtype, n_out, n_in, monkeypatch):
    """quant_matmul into a NaN-filled output, 1..16 rows in bfloat16 (float32 for a few): the bits of
    the two-launch path, one launch, the counters zero after each; within the summation noise of the
    exact product; a row alone the bits of the row in the batch of 16; a second launch the same bits."""
    paths = Paths(monkeypatch)
    packed = sane_rows(qtype, n_out, n_in, seed=n_out + n_in).to(DEVICE)
    cut = pieces(qtype, n_out, n_in) > 1
    x16 = rows_of(16, n_in, torch.bfloat16, seed=n_in)

    def product(x):
        out = torch.full((x.shape[0], n_out), float("nan"), dtype=x.dtype, device=DEVICE)
        return kt.quant_matmul(x, packed, qtype, n_out, n_in, out=out)

    for rows in range(1, 17):
        x = x16[:rows]
        (one, launched), (two, launched_two) = paths.one(lambda: product(x)), paths.two(lambda: product(x))
        check_launches(launched, launched_two, cut)
        assert torch.equal(one, two) and not bool(one.isnan().any()), rows
    full = one
    for m in (0, 7, 15):
        assert torch.equal(paths.one(lambda: product(x16[m:m + 1]))[0], full[m:m + 1]), m
    assert torch.equal(paths.one(lambda: product(x16))[0], full)
    x = rows_of(3, n_in, torch.float32, seed=3)
    y = paths.one(lambda: product(x))[0]
    assert torch.equal(y, paths.two(lambda: product(x))[0])
    worst = noise(y.cpu(), *exact_product(x.cpu(), torch_dequantize(packed.cpu(), qtype)))
    print(f"\n[{WHERE}] {qtype.name} [{n_out}, {n_in}], {pieces(qtype, n_out, n_in)} piece(s): 1..16 rows one launch "
          f"= two launches bit for bit; float32 rows {worst:.3f} eps·Σ|x·w| from the exact product")
    assert worst <= FUSED_BOUND


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_the_glu_product_in_one_launch(act, monkeypatch):
    """A GLU's down product (quant_matmul(gate, up=, act=)), cut: 1..16 rows the two-launch bits."""
    paths = Paths(monkeypatch)
    qtype, n_out, n_in = QType.Q8_0, 37, 352
    assert pieces(qtype, n_out, n_in) > 1
    packed = sane_rows(qtype, n_out, n_in, seed=11).to(DEVICE)
    gate, up = rows_of(16, n_in, torch.bfloat16, seed=12) * 3, rows_of(16, n_in, torch.bfloat16, seed=13)
    for rows in range(1, 17):
        def product():
            return kt.quant_matmul(gate[:rows], packed, qtype, n_out, n_in, up=up[:rows], act=act)
        (one, launched), (two, launched_two) = paths.one(product), paths.two(product)
        check_launches(launched, launched_two, cut=True)
        assert torch.equal(one, two), rows
        assert torch.equal(one, kt.quant_matmul(kt.glu(gate[:rows], up[:rows], act), packed, qtype, n_out, n_in))
    for m in (0, 15):
        alone = paths.one(lambda: kt.quant_matmul(gate[m:m + 1], packed, qtype, n_out, n_in, up=up[m:m + 1],
                                                  act=act))[0]
        assert torch.equal(alone, one[m:m + 1]), m


# (type, inner dimension, rows of the group's matrices): cut and uncut matrices in one launch (the
# K-quant's cut ones only: an uncut one needs 8 tiles under the interpreter, slow there)
GROUPS = [(QType.Q8_0, 352, (37, 130, 16, 5)), (QType.Q4_K, 1024, (9, 16)), (QType.BF16, 520, (21, 130, 3))]


@pytest.mark.parametrize("qtype, n_in, n_outs", GROUPS, ids=lambda v: getattr(v, "name", str(v)))
def test_grouped_products_in_one_launch(qtype, n_in, n_outs, monkeypatch):
    """grouped_matmul: 1..16 rows, each output the two-launch bits and quant_matmul's by its matrix
    alone; one launch for the group; a row alone the bits of the row in the batch of 16."""
    paths = Paths(monkeypatch)
    mats = [sane_rows(qtype, n_out, n_in, seed=20 + g).to(DEVICE) for g, n_out in enumerate(n_outs)]
    cut = [pieces(qtype, n_out, n_in) > 1 for n_out in n_outs]
    assert any(cut) and (DEVICE.type != "cpu" or qtype == QType.Q4_K or not all(cut)), cut
    x16 = rows_of(16, n_in, torch.bfloat16, seed=21)
    for rows in range(1, 17):
        def product():
            return kt.grouped_matmul(x16[:rows], mats, qtype, n_outs, n_in)
        (one, launched), (two, launched_two) = paths.one(product), paths.two(product)
        check_launches(launched, launched_two, cut=any(cut))
        assert same(one, two), rows
        if rows in (1, 16):
            for w, n_out, y in zip(mats, n_outs, one):
                assert torch.equal(y, kt.quant_matmul(x16[:rows], w, qtype, n_out, n_in)), (rows, n_out)
    for m in (0, 9, 15):
        alone = paths.one(lambda: kt.grouped_matmul(x16[m:m + 1], mats, qtype, n_outs, n_in))[0]
        assert all(torch.equal(a, f[m:m + 1]) for a, f in zip(alone, one)), m
    assert same(paths.one(lambda: kt.grouped_matmul(x16, mats, qtype, n_outs, n_in))[0], one)
    print(f"\n[{WHERE}] grouped {qtype.name} {list(n_outs)} (cut {cut}): one launch = two launches bit for bit, "
          f"1..16 rows")


# (type, n_out, n_in, activation rows): a pair's program has one row whatever the batch, so the pair
# counts sample 2..32 (the interpreter runs each of a launch's pairs × tiles × pieces programs)
PAIR_SHAPES = [(QType.Q8_0, 37, 352, (1, 2, 3, 5, 8, 16)), (QType.Q4_K, 16, 1024, (1, 3))]


@pytest.mark.parametrize("qtype, n_out, n_in, counts", PAIR_SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_expert_pairs_in_one_launch(qtype, n_out, n_in, counts, monkeypatch):
    """Routed experts by index (a tile per (pair, tile of rows)): gate and up by 2 pairs per row in one
    launch (expert_matmul_pair) and the down product reading SwiGLU's values (expert_matmul with up):
    the two-launch bits, each pair the bits of a one-row product by its expert, one launch each."""
    paths = Paths(monkeypatch)
    assert pieces(qtype, n_out, n_in) > 1
    n_experts, fanout = 3, 2
    gates = sane_rows(qtype, n_experts * n_out, n_in, seed=30).reshape(n_experts, n_out, -1).to(DEVICE)
    ups = sane_rows(qtype, n_experts * n_out, n_in, seed=31).reshape(n_experts, n_out, -1).to(DEVICE)
    x16 = rows_of(16, n_in, torch.bfloat16, seed=32)
    u16 = rows_of(16, n_in, torch.bfloat16, seed=33)
    chosen32 = torch.randint(0, n_experts, (32,), generator=torch.Generator().manual_seed(34)).to(DEVICE)
    for rows in counts:
        x, u, chosen = x16[:rows], u16[:rows], chosen32[:fanout * rows]

        def pair():
            return kt.expert_matmul_pair(x, [gates, ups], qtype, n_out, n_in, chosen, fanout)

        def down():
            return kt.expert_matmul(x, gates, qtype, n_out, n_in, chosen, fanout, up=u, act="silu")
        for product in (pair, down):
            (one, launched), (two, launched_two) = paths.one(product), paths.two(product)
            check_launches(launched, launched_two, cut=True)
            assert same(one, two), (rows, product.__name__)
    for r in (0, fanout * rows - 1):
        e, row = int(chosen32[r]), r // fanout
        assert torch.equal(one[r:r + 1], kt.quant_matmul(x16[row:row + 1], gates[e], qtype, n_out, n_in,
                                                          up=u16[row:row + 1], act="silu")), r
    print(f"\n[{WHERE}] expert pairs {qtype.name} [{n_out}, {n_in}]: {[fanout * c for c in counts]} pairs, gate/up "
          f"pair and GLU down, one launch = two launches bit for bit")


def test_counters_are_made_outside_a_capture_only(monkeypatch):
    """No buffer: one is made (zeros, COUNTERS_MIN at least); a launch needing more than it holds,
    outside a capture: a larger one, the smaller kept; during a capture: None, nothing made, and
    the product falls back to two launches leaving the too-small buffer as it was."""
    device = torch.device("cpu")
    monkeypatch.setattr(_common, "_counters", {})
    first = _common.tile_counters(device, 5)
    assert first.dtype == torch.int32 and first.numel() == _common.COUNTERS_MIN and not bool(first.any())
    assert _common.tile_counters(device, _common.COUNTERS_MIN) is first
    bigger = _common.tile_counters(device, _common.COUNTERS_MIN + 1)
    assert bigger.numel() == 2 * _common.COUNTERS_MIN and _common._counters[device] == [first, bigger]
    monkeypatch.setattr(_common, "capturing", lambda device: True)
    assert _common.tile_counters(device, 10) is bigger
    assert _common.tile_counters(device, 4 * _common.COUNTERS_MIN) is None
    assert _common._counters[device] == [first, bigger]

    # a product whose tiles need more counters than the buffer holds, during a capture
    qtype, n_out, n_in = QType.Q8_0, 37, 352
    packed = sane_rows(qtype, n_out, n_in, seed=40).to(DEVICE)
    x = rows_of(4, n_in, torch.bfloat16, seed=41)
    monkeypatch.setattr(_common, "capturing", lambda device: False)
    want = kt.quant_matmul(x, packed, qtype, n_out, n_in)
    small = torch.zeros(1, dtype=torch.int32, device=DEVICE)  # 3 tiles need 3
    monkeypatch.setitem(_common._counters, KEY, [small])
    monkeypatch.setattr(_common, "capturing", lambda device: True)
    launched = record_launches(monkeypatch)
    got = kt.quant_matmul(x, packed, qtype, n_out, n_in)
    assert launched == ["fused_rows_kernel", "sum_parts_kernel"] and torch.equal(got, want)
    assert _common._counters[KEY] == [small] and not bool(small.any())


# ---- the compiled code (sm_90) ------------------------------------------------------------------

ARCH = 90
_INSTRUCTION = re.compile(r"^\s*(?:@%p\d+\s+)?([a-z][\w.:]*)")


def instructions(ptx: str) -> list[str]:
    """The PTX's instruction opcodes in order (predicates dropped; labels, directives, comments out)."""
    out = []
    for line in ptx.splitlines():
        line = line.split("//")[0]
        m = _INSTRUCTION.match(line)
        if m and not line.strip().startswith(".") and not line.strip().endswith(":"):
            out.append(m.group(1))
    return out


def cut_specializations() -> list:
    """The specializations the CUDA backend compiles for cut products on an H200 (132 multiprocessors):
    quant_matmul, grouped_matmul, expert_matmul_pair and a GLU expert_matmul by 2048 x 2048 Q8_0
    matrices (128 tiles: cut), 4 rows, recorded on `meta` (benchmarks/triton_launches.py)."""
    triton_jit = pytest.importorskip("triton.runtime.jit")
    if not (hasattr(triton_jit, "create_function_from_signature") and hasattr(triton_jit.JITFunction, "_pack_args")):
        pytest.skip("this Triton's JIT has no binder the recorder can call")
    from benchmarks import cuda_op_count, triton_launches

    specs = []

    def observe(module, kernel, grid, args, kwargs):
        specs.append(triton_launches.specialize(module, kernel, args, kwargs))

    n = 2048
    cuda_op_count.launch_observers.append(observe)
    try:
        with cuda_op_count.meta_launches(cuda_op_count.H200_SMS):
            packed = torch.empty(n, n // 32 * 34, dtype=torch.uint8, device="meta")
            experts = torch.empty(3, n, n // 32 * 34, dtype=torch.uint8, device="meta")
            x = torch.empty(4, n, dtype=torch.bfloat16, device="meta")
            chosen = torch.empty(8, dtype=torch.int32, device="meta")
            assert qm.split_plan(QType.Q8_0, n, n // 32, torch.device("meta"))[0] > 1
            kt.quant_matmul(x, packed, QType.Q8_0, n, n)
            kt.grouped_matmul(x, [packed] * 2, QType.Q8_0, [n] * 2, n)
            kt.expert_matmul_pair(x, [experts, experts], QType.Q8_0, n, n, chosen, fanout=2)
            kt.expert_matmul(x, experts, QType.Q8_0, n, n, chosen[:4], up=x, act="silu")
    finally:
        cuda_op_count.launch_observers.remove(observe)
    return specs


def test_the_compiled_arrival_is_a_release_acquire_behind_barriers():
    from tools import triton_aot

    specs = cut_specializations()
    assert [s.kernel for s in specs] == ["fused_rows_kernel", "grouped_rows_kernel"] + ["fused_rows_kernel"] * 2
    assert all(s.constant("LAST_ADDS") for s in specs)
    with ProcessPoolExecutor(2, mp_context=get_context("spawn"), initializer=triton_aot._worker_init) as pool:
        ptxs = list(pool.map(triton_aot.ptx, [s.to_json() for s in specs], [ARCH] * len(specs)))
    for spec, ptx in zip(specs, ptxs):
        ops = instructions(ptx)
        atomics = [i for i, op in enumerate(ops) if op.startswith("atom")]
        assert [ops[i] for i in atomics] == ["atom.global.gpu.acq_rel.add.u32"], [ops[i] for i in atomics]
        at = atomics[0]
        before = [op for op in ops[:at] if op.startswith(("st.global", "bar.sync"))]
        # the piece's float32 sums stored, then a barrier: every thread's stores precede the release
        assert before[-1] == "bar.sync" and "st.global.b32" in before, before[-4:]
        after = ops[at + 1:]
        first_read = after.index("ld.global.cg.b32")  # the parts, read through L2
        assert "bar.sync" in after[:first_read]  # the acquirer's count reaches the other threads
        reads = after[first_read:]
        assert "add.f32" in reads and any(op.startswith("cvt.rn.bf16.f32") for op in reads)
        assert "st.global.b32" in reads[reads.index("add.f32"):]  # the counter reset after the sum
        print(f"\nsm_{ARCH} {spec.kernel} (PAIRS={spec.constant('PAIRS') if spec.kernel == 'fused_rows_kernel' else '-'})"
              f": ... {' '.join(before[-3:])} | {ops[at]} | bar.sync ... ld.global.cg.b32 add.f32 ... cvt.rn.bf16.f32")
