"""The CUDA backend's Triton kernels compiled for the GPU (sm_90: H100 / H200) on the CPU, and what the
compiled code does to bits.

The interpreter the other Triton tests run in accepts programs the compiler rejects and computes
with numpy, so it cannot show what the compiled kernels do. Here every specialization the CUDA
backend launches in the recorded workloads (benchmarks/triton_launches.py: the tiny Qwen3.5 q8_0
and its MoE sibling, bf16 and f32 compute, a 20-token prompt and every batch width 1..8: the decode
step and the verification of up to 7 drafts; `tools/triton_aot.py --check` runs the same checks on
every family fixture, product type and width 1..16. The forwards run on the `meta` device, each
launch's specialization computed by Triton's own binder) is compiled ahead of
time by tools/triton_aot.py (Triton's bundled ptxas, worker processes without TRITON_INTERPRET), once
per session, and checked:

* every one compiles;
* every float32 -> bfloat16 / float16 conversion in the PTX rounds to nearest even (`cvt.rn`; the
  interpreter truncates), and no LLVM float instruction may be reassociated (`reassoc` / `fast`):
  the compiler keeps the order of float operations the source writes;
* batch invariance of the compiled code. The same launch site (a workload's k-th launch of a
  kernel) compiles to a different specialization at each batch width: the product kernels take the
  row count as constexprs ROWS / ROWS_P2 (one float32 tile per row; the result [ROWS_P2, BLOCK_N]), and integer
  arguments that depend on the width (a row count of 1, a multiple of 16) specialize any kernel.
  A row's bits are decided by (1) the float operations that produce each value it sums, (2) how
  each reduction (`tl.sum`) is lowered, which follows from its axis, its operand's shape and layout
  (the encoding the layout passes chose) and its combining operation, and (3) whether the backend
  contracts a product and a sum into one FMA. For (1) and (2) tools/triton_aot.py digests every
  tt.reduce of the TTGIR together with the float operations feeding it (post-order back to loads
  and loop-carried values; integer address arithmetic and layout conversions move no float bits and
  are left out).
  A kernel whose program handles ROWS rows runs one reduction chain per row, so its digests at
  ROWS = r must be r times those at ROWS = 1: the same multiset per row. The check asserts this for
  every launch site across the widths: a layout chosen differently for some width, or a float
  operation added or reordered, changes a digest. Each row's tile is reduced once after the loop
  and placed in the result by `where(m == row, total, acc)`, a selection that moves no bits. For (3), where a launch leaves FMA contraction on (enable_fp_fusion not False), the
  SASS counts of FFMA and FMUL must be in one ratio at equal ROWS (a loop over tokens, absent at
  width 1, may be unrolled, which scales both) and a + b·r at ROWS = r (a: the shared
  dequantization, b: one row's products), fitted on the two smallest: a product contracted for
  some rows or widths and not others breaks either. Launches with enable_fp_fusion=False are compiled with
  `--fmad=false` and no LLVM contraction: nothing to check.

The product kernel's main loop per weight byte (SASS) is printed as a report (tools/triton_aot.py
--cost), not asserted. Skips only when triton is not installed (or too old to have the binder
benchmarks/triton_launches.py calls).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

# before Triton's first import: the interpreter's mode (no GPU) is read then, and the tests after
# this module run their kernels in it
from tests.fixtures.triton_mode import WHERE  # noqa: E402

triton_jit = pytest.importorskip("triton.runtime.jit", reason="triton is not installed: nothing to compile")
if not (hasattr(triton_jit, "create_function_from_signature") and hasattr(triton_jit.JITFunction, "_pack_args")):
    pytest.skip("this Triton's JIT has no binder the recorder can call (create_function_from_signature, "
                "JITFunction._pack_args)", allow_module_level=True)

from benchmarks import triton_launches  # noqa: E402
from tools import triton_aot  # noqa: E402

ARCH = 90
# the decode step and the verification of k = 1..7 drafts (tools/triton_aot.py --check: widths 1..16)
WIDTHS = range(1, 9)
JOBS = max(1, min(4, os.cpu_count() or 1))
_cache: dict = {}


def _recorded() -> triton_launches.Recorder:
    if "recorder" not in _cache:
        _cache["recorder"] = triton_launches.record(triton_launches.workloads(quick=True), widths=WIDTHS)
    return _cache["recorder"]


def _compiled() -> dict:
    """Every recorded specialization compiled for sm_90, once per session: {Specialization: Compiled}."""
    if "compiled" not in _cache:
        specs = [s.to_json() for s in _recorded().found]
        results = triton_aot.compile_all(specs, archs=(ARCH,), jobs=JOBS)
        _cache["compiled"] = {triton_launches.Specialization.from_json(r.spec): r for r in results}
    return _cache["compiled"]


def test_recorded_launches_cover_every_width():
    """The recorder saw the decode step and every verification width, and each width launches the
    same kernels the same number of times (so that launch sites line up across widths)."""
    recorder = _recorded()
    by_workload: dict = {}
    for (workload, dtype, batch), launches in recorder.sequences.items():
        if batch.startswith("width "):
            counts = Counter(spec.name for spec in launches)
            by_workload.setdefault((workload, dtype), {})[batch] = tuple(sorted(counts.items()))
    assert len(by_workload) == 2 * len(triton_launches.DTYPES)
    for key, batches in by_workload.items():
        assert len(batches) == len(WIDTHS), key
        assert len(set(batches.values())) == 1, (key, batches)
    kernels = {s.name for s in recorder.found}
    print(f"\n{len(recorder.found)} specializations of {len(kernels)} kernels (recorded on meta; other "
          f"kernel tests of this session in the {WHERE}): {sorted(kernels)}")
    assert {"_quant_jit.fused_rows_kernel", "_grouped_jit.grouped_rows_kernel", "_quant_jit.dequantize_kernel"} <= kernels


def test_every_specialization_compiles_for_sm90():
    compiled = _compiled()
    failed = triton_aot.failures(list(compiled.values()))
    print(f"\n{len(compiled)} specializations compiled for sm_{ARCH}, "
          f"{sum(r.seconds for r in compiled.values()):.0f} s of compilation")
    assert not failed, "\n".join(failed)


def test_narrowing_rounds_to_nearest_even_and_nothing_reassociates():
    problems, found = triton_aot.rounding_problems(_compiled())
    print(f"\nPTX float32 -> 16-bit conversions: {dict(found)}")
    assert not problems, "\n".join(problems)
    assert any(".bf16" in instruction for instruction in found), "no bfloat16 conversion found: nothing checked"


def test_compiled_kernels_are_batch_invariant():
    problems, checked = triton_aot.invariance_problems(_recorded(), _compiled())
    print(f"\nlaunch sites whose specialization depends on the batch width, checked: {dict(checked)}")
    assert not problems, "\n".join(problems)
    assert checked["_quant_jit.fused_rows_kernel"] and checked["_grouped_jit.grouped_rows_kernel"]


def test_the_invariance_check_sees_a_layout_or_an_operation_change():
    """The check has teeth: a product kernel whose reduction at one width had another layout, or one
    more float operation in a row's chain, is reported."""
    recorder, compiled = _recorded(), _compiled()
    site = next(specs for key, specs in triton_aot.launch_sites(recorder).items()
                if key[2] == "_quant_jit.fused_rows_kernel" and len(set(specs)) > 2)
    victim = site[-1]
    original = compiled[victim]
    try:
        compiled[victim] = triton_aot.Compiled(**{**original.__dict__, "reduce_layouts": ["axis=2 operand=other"]})
        assert any("layouts differ" in p for p in triton_aot.invariance_problems(recorder, compiled)[0])
        forms = dict(original.reduce_forms)
        forms["0" * 16] = triton_aot.rows_per_program(victim)  # one more chain per row
        compiled[victim] = triton_aot.Compiled(**{**original.__dict__, "reduce_forms": forms})
        assert any("reductions or the float" in p for p in triton_aot.invariance_problems(recorder, compiled)[0])
        sass = {**original.sass, "FFMA": original.sass.get("FFMA", 0) + 1}
        compiled[victim] = triton_aot.Compiled(**{**original.__dict__, "sass": sass})
        assert any("contraction" in p for p in triton_aot.invariance_problems(recorder, compiled)[0])
    finally:
        compiled[victim] = original


def test_product_kernel_cost_report():
    """Not a check of a bound: the one-pass product kernel's main loop in SASS per weight byte
    (tools/triton_aot.py --cost), printed."""
    lines = triton_aot.cost_report(list(_compiled().values()))
    print("\n" + "\n".join(lines))
    assert lines
