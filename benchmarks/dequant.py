"""Dequantization throughput: the runtime's torch decoders against gguf.quants (numpy).

    python3 benchmarks/dequant.py [--size 4096] [--repeats 5] [--threads 1] [--types Q8_0,Q4_K]

For each supported type, one size x size matrix of random bytes (the row layout of that type) is
dequantized to float32 by `specconv.runtime.dequant.dequantize_rows` and by
`gguf.quants.dequantize`, alternately, in this one process. Prints the median time of each,
elements per second and the ratio (ours / numpy, higher is better). Time is this process's CPU
time by default (steadier than the wall clock when other work shares the cores). torch runs on
`--threads` threads (default 1, like numpy's single-threaded code); the device is the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specconv.runtime.dequant import SUPPORTED, dequantize_rows, row_bytes  # noqa: E402


def timed(run, clock) -> float:
    start = clock()
    run()
    return clock() - start


def measure(qtype: GGMLQuantizationType, size: int, repeats: int, clock) -> tuple[float, float]:
    """Median seconds (ours, numpy) for one size x size matrix of `qtype`, runs alternating."""
    raw = np.random.default_rng(0).integers(0, 256, (size, row_bytes(qtype, size)), dtype=np.uint8)
    tensor = torch.from_numpy(raw)
    ours, reference = [], []
    for _ in range(repeats):
        ours.append(timed(lambda: dequantize_rows(tensor, qtype), clock))
        reference.append(timed(lambda: quants.dequantize(raw, qtype), clock))
    return statistics.median(ours), statistics.median(reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--types", default="", help="comma-separated type names (default: all supported)")
    parser.add_argument("--wall", action="store_true",
                        help="time with the wall clock (default: this process's CPU time, steadier on a shared "
                             "machine; use --wall with more than one thread)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    warnings.simplefilter("ignore")  # random bytes make some NaN/Inf scales; numpy warns about them
    # F32 is left out by default: both sides only reinterpret the bytes (a view, no work)
    names = args.types.split(",") if args.types else sorted(t.name for t in SUPPORTED if t.name != "F32")
    elements = args.size * args.size
    print(f"{args.size}x{args.size} to float32, median of {args.repeats}, torch {torch.__version__} "
          f"on {args.threads} thread(s), numpy {np.__version__}, {'wall' if args.wall else 'CPU'} time")
    print(f"{'type':8} {'ours ms':>9} {'numpy ms':>9} {'ours Gelem/s':>13} {'numpy Gelem/s':>14} {'ratio':>6}")
    for name in names:
        ours, reference = measure(GGMLQuantizationType[name], args.size, args.repeats, clock)
        print(f"{name:8} {ours * 1e3:9.1f} {reference * 1e3:9.1f} {elements / ours / 1e9:13.3f} "
              f"{elements / reference / 1e9:14.3f} {reference / ours:6.2f}")


if __name__ == "__main__":
    main()
