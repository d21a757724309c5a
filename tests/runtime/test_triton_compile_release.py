"""The Triton kernels at the shapes of released checkpoints, compiled for sm_90 (H100 / H200) on the CPU:
every specialization fits the device's shared memory, and no int32 index arithmetic wraps.

tests/runtime/test_triton_compile.py compiles what the tiny fixtures launch; their widths choose
small tiles. Here benchmarks/release_launches.py calls every kernel wrapper with `meta` tensors of
the layer shapes of benchmarks/release_shapes.py (Qwen3.5-27B / 397B, Qwen3-235B, GLM-4.5 / 4.6,
DeepSeek-V3 / V3.2, Gemma 4, Step-3.5, MiMo-V2, Hy3, Llama 3.1 8B / 70B: every product by every
kernel weight type, attention of each layer kind against a buffer of the whole context, norms,
ropes and K/V stores, the Gated DeltaNet, routing, the indexer) at widths 1 and 16 (the products at
one row, bf16: PRODUCT_WIDTHS), a prompt of 512 tokens and one of the whole context, bf16 and f32.
Each distinct specialization is compiled once per session by tools/triton_aot.py (Triton's cache
keeps them across runs) and checked:

* it compiles, and its shared memory (`kernel.metadata.shared`) is within sm_90's opt-in limit
  per block (232448 bytes): a kernel over it compiles but fails to launch (OutOfResources). The
  figures against sm_80's 166912 are printed (`tools/triton_aot.py --release` compiles sm_80 too);
* no int32 add / sub / mul / shift of its TTIR leaves the int32 range at any of its recorded
  launches (tools/int_ranges.py: intervals from the launch's integer arguments and grid): an
  index that wraps reads and writes elsewhere, silently. This failed before the row indices of
  glu_kernel, norm_kernel, qk_rope_kernel and gdn_chunked_kernel were made int64 (a prompt of a
  whole context times a feed-forward's width, q's row or the conv's channels).

Skips where triton is not installed (or has no binder the recorder can call). A CPU check: its name
keeps it out of tools/device_check.sh's GPU run (`not triton_compile`).
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

# before Triton's first import: the interpreter's mode (no GPU) is read then, and the tests after
# this module run their kernels in it
from tests.fixtures.triton_mode import WHERE  # noqa: E402

triton_jit = pytest.importorskip("triton.runtime.jit", reason="triton is not installed: nothing to compile")
if not (hasattr(triton_jit, "create_function_from_signature") and hasattr(triton_jit.JITFunction, "_pack_args")):
    pytest.skip("this Triton's JIT has no binder the recorder can call (create_function_from_signature, "
                "JITFunction._pack_args)", allow_module_level=True)

from benchmarks import release_launches, triton_launches  # noqa: E402
from benchmarks.release_shapes import RELEASES  # noqa: E402
from tools import int_ranges, triton_aot, triton_release  # noqa: E402

ARCH = 90
WIDTHS = (1, 16)  # the decode step and the widest verification
# the product kernels at one row in bf16: their tiles and integer arithmetic do not depend on the
# release's shape beyond its arguments (shared memory: their reductions' scratch, under 1 KB);
# tools/triton_aot.py --release compiles them at every width and dtype (a ROWS = 16 K-quant
# specialization takes a minute of compilation: dozens of them would not fit CI's budget)
PRODUCT_WIDTHS, PRODUCT_DTYPES = (1,), ("bf16",)
JOBS = max(1, min(4, os.cpu_count() or 1))
_cache: dict = {}


def _recorded() -> release_launches.ReleaseRecorder:
    if "recorder" not in _cache:
        start = time.perf_counter()
        _cache["recorder"] = release_launches.record(widths=WIDTHS, product_dtypes=PRODUCT_DTYPES,
                                                     product_widths=PRODUCT_WIDTHS)
        _cache["record_s"] = time.perf_counter() - start
    return _cache["recorder"]


def _compiled() -> dict:
    """Every recorded specialization compiled for sm_90 with its launches' int32 check, once per session."""
    if "compiled" not in _cache:
        recorder = _recorded()
        specs = list(recorder.found)
        start = time.perf_counter()
        results = triton_aot.compile_all([s.to_json() for s in specs], archs=(ARCH,), jobs=JOBS, sass=False,
                                         launches=[sorted(recorder.launches[s]) for s in specs])
        _cache["compile_s"] = time.perf_counter() - start
        _cache["compiled"] = {triton_launches.Specialization.from_json(r.spec): r for r in results}
    return _cache["compiled"]


def _kernels_defined() -> set[str]:
    """`module.kernel` of every @triton.jit function named *_kernel in runtime/kernels_triton's _*_jit modules."""
    import re
    from pathlib import Path

    folder = Path(triton_aot.REPO) / "runtime" / "kernels_triton"
    found = set()
    for path in folder.glob("_*_jit.py"):
        for name in re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text()):
            found.add(f"{path.stem}.{name}")
    return found


def test_every_kernel_is_launched_at_release_shapes():
    """The recorder reaches every kernel the package defines (a new kernel needs a call in
    benchmarks/release_launches.py), for every release in the table."""
    recorder = _recorded()
    launched = {s.name for s in recorder.found}
    missing = _kernels_defined() - launched
    models = {key[0] for key in recorder.sequences}
    print(f"\n{len(recorder.found)} specializations of {len(launched)} kernels from {len(models)} releases, "
          f"recorded in {_cache['record_s']:.0f} s (kernels in this process: {WHERE})")
    assert not missing, f"kernels never launched at release shapes: {sorted(missing)}"
    assert models == {r.name for r in RELEASES}


def test_every_release_specialization_fits_sm90_shared_memory():
    compiled = _compiled()
    results = list(compiled.values())
    failed = triton_aot.failures(results)
    print(f"\n{len(results)} specializations compiled for sm_{ARCH} in {_cache['compile_s']:.0f} s")
    print("\n".join(triton_release.resource_table(results)))
    over_sm80 = Counter(s.name for s, r in compiled.items() if r.shared > triton_release.SHARED_LIMITS[80])
    print(f"sm_90 figures over sm_80's {triton_release.SHARED_LIMITS[80]} bytes: {dict(over_sm80) or 'none'}")
    assert not failed, "\n".join(failed)
    over = [line for line in triton_release.resource_problems(results) if "shared memory" in line]
    assert not over, "\n".join(over)
    assert max(r.shared for r in results) > 0  # the figure is read: some kernel uses shared memory


def test_no_int32_index_arithmetic_wraps_at_release_sizes():
    compiled = _compiled()
    checked = sum(len(_recorded().launches[s]) for s in compiled)
    wraps = [line for line in triton_release.resource_problems(list(compiled.values())) if "wraps" in line]
    print(f"\n{checked} launches of {len(compiled)} specializations checked")
    assert not wraps, "\n".join(wraps)


def test_the_int32_check_sees_a_wrap():
    """The check has teeth on a compiled kernel: softmax_topk_kernel's row offsets (`r * stride_l`,
    `r * K`: int32) wrap once the rows pass 2^31 / K, and not at half of 2^31 / BLOCK rows."""
    recorder = _recorded()
    spec = next(s for s in recorder.found if s.kernel == "softmax_topk_kernel")
    ints, _ = sorted(recorder.launches[spec])[0]

    def wraps(rows: int) -> list:
        result = triton_aot.compile_all([spec.to_json()], archs=(ARCH,), jobs=1, sass=False,
                                        launches=[[(ints, (rows, 1, 1))]])[0]
        assert result.ok, result.error
        return result.overflows

    found = wraps((1 << 31) // spec.constant("K") + 2)
    print(f"\n{spec.describe()}: {found}")
    assert any("arith.muli" in line for line in found)
    assert wraps((1 << 30) // spec.constant("BLOCK")) == []


def test_int_ranges_bounds_each_operation():
    """tools/int_ranges.py on a hand-written module: program id times an argument wraps in int32 at a
    large grid, the same product in int64 does not, and a loop's variable spans its bounds."""
    ttir = "\n".join([
        "module {",
        "  tt.func public @k(%x_ptr: !tt.ptr<bf16>, %stride: i32, %n: i32) {",
        "    %r = tt.get_program_id x : i32 loc(#loc1)",
        "    %0 = arith.muli %r, %stride : i32 loc(#loc1)",
        "    %1 = arith.extsi %r : i32 to i64 loc(#loc2)",
        "    %2 = arith.extsi %stride : i32 to i64 loc(#loc2)",
        "    %3 = arith.muli %1, %2 : i64 loc(#loc2)",
        "    %c0 = arith.constant 0 : i32 loc(#loc3)",
        "    %c64 = arith.constant 64 : i32 loc(#loc3)",
        "    %i = tt.make_range {end = 64 : i32, start = 0 : i32} : tensor<64xi32> loc(#loc3)",
        "    scf.for %t = %c0 to %n step %c64  : i32 {",
        "      %4 = tt.splat %t : i32 -> tensor<64xi32> loc(#loc3)",
        "      %5 = arith.addi %4, %i : tensor<64xi32> loc(#loc3)",
        "      %6 = tt.splat %stride : i32 -> tensor<64xi32> loc(#loc3)",
        "      %7 = arith.muli %5, %6 : tensor<64xi32> loc(#loc3)",
        "    } loc(#loc3)",
        "  } loc(#loc)",
        "} loc(#loc)",
        '#loc1 = loc("kernel.py":10:5)',
        '#loc2 = loc("kernel.py":11:5)',
        '#loc3 = loc("kernel.py":12:5)',
    ])
    small = int_ranges.overflows(ttir, [((("n", 128), ("stride", 4096)), (1000, 1, 1))])
    assert small == []
    wide = int_ranges.overflows(ttir, [((("n", 128), ("stride", 4096)), (1 << 20, 1, 1))])
    assert wide == [f"kernel.py:10: arith.muli i32 in [0, {((1 << 20) - 1) * 4096}]"]
    long = int_ranges.overflows(ttir, [((("n", 1 << 20), ("stride", 4096)), (1, 1, 1))])
    assert long == [f"kernel.py:12: arith.muli i32 in [0, {((1 << 20) - 1 + 63) * 4096}]"]
