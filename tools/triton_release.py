"""Resources and 32-bit index arithmetic of the Triton kernels at the shapes of released checkpoints.

    python3 tools/triton_aot.py --release            # sm_90 and sm_80: the table, a line per problem
    python3 tools/triton_aot.py --release --arch 90 --no-sass

benchmarks/release_launches.py calls every kernel wrapper at the layer shapes of
benchmarks/release_shapes.py and records each launch's specialization, integer arguments and grid;
tools/triton_aot.py compiles each distinct specialization (`Compiled`: shared memory, warps,
registers, and the int32 operations of its TTIR that wrap at one of its launches:
tools/int_ranges.py). A kernel whose shared memory passes the device's opt-in limit per block
(SHARED_LIMITS) compiles but fails to launch (Triton's OutOfResources); an index that wraps reads
and writes elsewhere, silently.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from tools.triton_aot import Compiled, compile_all, failures

# shared memory one block may use (the opt-in maximum, bytes): H100 / H200, A100
SHARED_LIMITS = {90: 232448, 80: 166912}


def resource_problems(results: list[Compiled]) -> list[str]:
    """One line per compiled specialization that cannot launch on its architecture (shared memory past
    SHARED_LIMITS) or whose int32 index arithmetic wraps at its recorded launches (`overflows`)."""
    from benchmarks.triton_launches import Specialization

    lines = []
    for r in results:
        what = f"sm_{r.arch}: {Specialization.from_json(r.spec).describe()}"
        if r.ok and r.shared > SHARED_LIMITS.get(r.arch, r.shared):
            lines.append(f"{what}: {r.shared} bytes of shared memory, the limit {SHARED_LIMITS[r.arch]}")
        lines += [f"{what}: wraps: {o}" for o in r.overflows]
    return lines


def resource_table(results: list[Compiled]) -> list[str]:
    """Per kernel and architecture: the most shared memory and registers (where the SASS step read
    them) of its specializations, and their count."""
    from benchmarks.triton_launches import Specialization

    worst: dict = {}
    for r in results:
        if r.ok:
            key = (Specialization.from_json(r.spec).name, r.arch)
            shared, regs, n = worst.get(key, (0, 0, 0))
            worst[key] = (max(shared, r.shared), max(regs, r.registers), n + 1)
    return [f"sm_{arch} {name}: {shared} bytes shared (limit {SHARED_LIMITS.get(arch, '?')}), "
            + (f"{regs} registers, " if regs else "") + f"{n} specializations"
            for (name, arch), (shared, regs, n) in sorted(worst.items())]


def release(archs: tuple, jobs: int | None, sass: bool, as_json: bool, say) -> int:
    """`--release`: every specialization benchmarks/release_launches.py records, compiled with its
    launches' int32 check; the resource table, and a line per problem (exit 1 if any)."""
    from benchmarks import release_launches

    start = time.perf_counter()
    recorder = release_launches.record(progress=say)
    specs = list(recorder.found)
    say(f"{len(specs)} distinct specializations recorded in {time.perf_counter() - start:.0f} s")
    results = compile_all([s.to_json() for s in specs], archs, jobs, sass, say,
                          launches=[sorted(recorder.launches[s]) for s in specs])
    lines = failures(results) + resource_problems(results)
    if as_json:
        json.dump({"results": [asdict(r) for r in results], "problems": lines}, sys.stdout)
        print()
    else:
        print("\n".join(resource_table(results) + lines))
    say(f"{time.perf_counter() - start:.0f} s in all")
    return 1 if lines else 0
