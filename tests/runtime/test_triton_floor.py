"""The CUDA kernels compile for sm_90 under the oldest Triton the runtime accepts (`MIN_TRITON`), not
only under the newest one the test extras install (tests/runtime/test_triton_compile.py).

An older Triton refuses forms a newer one takes: Triton 3.6 (torch 2.11's, the GPU machines') refused a
constexpr rebound in a static loop that 3.9 compiled, and `tl.dot` narrower than 16. A GPU is lent
rarely, so the refusal has to show on the CPU: tests/run.sh installs Triton MIN_TRITON into a folder
of its own (`pip install --target`, cached) and names it in SPECCONV_TRITON_FLOOR; this test runs
tools/triton_aot.py in a child process with that folder first on its path, over the launches of
test_triton_compile.py at widths 1 and 2 (the tiny Qwen3.5 and its MoE sibling, the products of every
kernel weight type: every kernel, in its one-row and several-row forms, with fewer row counts;
Triton 3.6 compiles several times slower than the newest release, and widths 1..8 would be 428
specializations), plus the workloads in ALSO: a model wider than a norm block (rows normed in
unrolled blocks, alone and in a product's tail) and Gemma 4 (its V norm inside the rope launch,
its sandwich norms), and requires every specialization to compile. Without the folder it is skipped, and
under SPECCONV_REQUIRE_TRITON_FLOOR=1 (CI) that is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specconv.runtime.kernels_triton._common import MIN_TRITON
from tests.fixtures.paths import ROOT

WIDTHS = 2  # the decode step and the smallest verification
ALSO = ("qwen35-wide q8_0", "gemma4-release q8_0")
JOBS = max(1, min(4, os.cpu_count() or 1))


def _floor_folder() -> Path:
    folder = os.environ.get("SPECCONV_TRITON_FLOOR")
    if folder and (Path(folder) / "triton" / "__init__.py").is_file():
        return Path(folder)
    why = f"no Triton {'.'.join(map(str, MIN_TRITON))} folder (SPECCONV_TRITON_FLOOR={folder!r})"
    if os.environ.get("SPECCONV_REQUIRE_TRITON_FLOOR") == "1":
        pytest.fail(why + " but SPECCONV_REQUIRE_TRITON_FLOOR=1")
    pytest.skip(why)


def test_every_specialization_compiles_under_the_oldest_triton():
    folder = _floor_folder()
    path = [str(folder), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    env.pop("TRITON_INTERPRET", None)
    also = [a for label in ALSO for a in ("--also", label)]
    proc = subprocess.run([sys.executable, "tools/triton_aot.py", "--quick", *also, "--widths", str(WIDTHS), "--arch",
                           "90", "--no-sass", "--json", "--jobs", str(JOBS)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=3000)
    assert proc.stdout.strip(), proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    version = tuple(int(p) for p in report["triton"].split(".")[:2])
    results = report["results"]
    kernels = {(r["spec"]["module"], r["spec"]["kernel"]) for r in results}
    launched = [w for s in report["specializations"] for w in s["workloads"]]
    assert all(any(w.startswith(label + " ") for w in launched) for label in ALSO), "a workload of ALSO is missing"
    print(f"\nTriton {report['triton']} (from {folder}): {sum(r['ok'] for r in results)}/{len(results)} "
          f"specializations of {len(kernels)} kernels compiled for sm_90, "
          f"{sum(r['seconds'] for r in results):.0f} s of compilation")
    assert version == MIN_TRITON, f"the child imported Triton {report['triton']}, not the floor's"
    assert len(results) == len(report["specializations"]) > 0 and not report["problems"], "\n".join(report["problems"])
    assert proc.returncode == 0, proc.stderr[-4000:]
