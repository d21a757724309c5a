"""Cost of the fused stored-weight product by number of activation rows, the kernel alone.

What verifying k+1 tokens costs in the weight products (runtime/dq_dot_simd.inc) against one token.

    python3 benchmarks/fused_rows.py                       # each fused type, one core, weights in L2
    python3 benchmarks/fused_rows.py --model FILE.gguf --threads 2 --rows 1,4,5

Without --model: a 512 x 1024 matrix of random blocks per type (its bytes stay in this core's L2, so
the figure is the kernel's arithmetic, not memory), one thread, 1..9 activation rows; prints ns per 16
weight values and the ratio to one row. With --model: every 2-D stored matrix of the file (the
embedding excepted) through the kernel in file order, weights from memory, the row counts and the
activations (float32, and 8-bit where the type has that kernel: runtime/dq_dot_i8.inc) alternating
over the passes; prints the medians (CPU time, and wall) and the ratios to one row. Both in one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def in_cache(rows: list[int], repeats: int) -> None:
    import torch
    from gguf import GGMLQuantizationType as QType

    from benchmarks.dequant_native import blocks  # random codes, ordinary f16 scales
    from specconv.runtime import dequant_native
    n_out, n_in = 512, 1024
    print(f"one thread, {n_out} x {n_in} matrix in L2, kernel {dequant_native.fused_width(QType.Q8_0)}-bit; "
          "ns per 16 weight values (ratio to 1 row):")
    kernels = [(t, "float32") for t in (QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16, QType.F16)]
    kernels += [(t, "int8") for t in (QType.Q8_0,) if dequant_native.int8_width(t)]
    for qtype, activations in kernels:
        raw = blocks(qtype, n_out, n_in, seed=int(qtype))
        xs = {nx: torch.randn(nx, n_in) for nx in rows}
        samples: dict[int, list[float]] = {nx: [] for nx in rows}
        for _ in range(repeats):
            for nx in rows:  # interleaved: a slow moment of the machine hits every row count alike
                calls = 200
                t0 = time.perf_counter()
                for _ in range(calls):
                    dequant_native.matmul_t(xs[nx], raw, qtype, n_in, threads=1, activations=activations)
                samples[nx].append((time.perf_counter() - t0) / calls / (n_out * n_in / 16) * 1e9)
        med = {nx: statistics.median(v) for nx, v in samples.items()}
        label = f"{qtype.name} {'8-bit x' if activations == 'int8' else ''}"
        print(f"  {label:12s} " + "  ".join(f"{nx}: {med[nx]:.2f} ({med[nx] / med[rows[0]]:.2f})" for nx in rows))


def whole_model(path: str, rows: list[int], repeats: int, activations: list[str]) -> None:
    import torch

    from specconv.runtime import dequant_native, load_model
    from specconv.runtime.stored import StoredWeight
    model = load_model(path, device="cpu", weights="stored")
    mats = [w for name, w in model.weights.items()
            if isinstance(w, StoredWeight) and w.ndim == 2 and name != "token_embd.weight"
            and dequant_native.has_fused_kernel(w.qtype)]
    xs = {(nx, w.shape[1]): torch.randn(nx, w.shape[1]) for nx in rows for w in mats}
    modes = [m for m in activations if m == "float32" or all(dequant_native.int8_width(w.qtype) for w in mats)]
    totals: dict[tuple[str, int], list[tuple[float, float]]] = {(m, nx): [] for m in modes for nx in rows}
    for _ in range(repeats):
        for m in modes:  # interleaved: a slow moment of the machine hits every mode and row count alike
            for nx in rows:
                c0, t0 = time.process_time(), time.perf_counter()
                for w in mats:
                    dequant_native.matmul_t(xs[(nx, w.shape[1])], w.raw, w.qtype, w.shape[1], activations=m)
                totals[(m, nx)].append((time.process_time() - c0, time.perf_counter() - t0))
    values = sum(w.numel() for w in mats)
    print(f"{Path(path).name}: {len(mats)} matrices, {values / 1e6:.0f} M values, {torch.get_num_threads()} "
          f"thread(s), medians of {repeats} (CPU time, wall in parentheses)")
    for m in modes:
        cpu = {nx: statistics.median(c for c, _ in totals[(m, nx)]) for nx in rows}
        wall = {nx: statistics.median(t for _, t in totals[(m, nx)]) for nx in rows}
        print(f"  {m} activations: " + ", ".join(f"t({nx}) {cpu[nx] * 1e3:.1f} ms ({wall[nx] * 1e3:.1f})" for nx in rows)
              + "; t(n)/t(1): " + ", ".join(f"{nx}: {cpu[nx] / cpu[rows[0]]:.3f}" for nx in rows))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a GGUF file: every matrix through the kernel, weights from memory")
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9", help="activation row counts, the first is the baseline")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--activations", default="float32,int8",
                   help="with --model: the products' activations, alternating (int8 where the types have the kernel)")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    if args.model:
        whole_model(args.model, rows, args.repeats, args.activations.split(","))
    else:
        in_cache(rows, args.repeats)


if __name__ == "__main__":
    main()
