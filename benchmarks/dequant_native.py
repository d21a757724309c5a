"""The native dequantizer and the stored-weight product on the CPU against the dense float32 product.

    python3 benchmarks/dequant_native.py [--types Q8_0,Q4_K] [--shapes 3584x1024,248320x1024]
                                         [--repeats 7] [--threads 1] [--wall]

For each matrix [out, in] and type: random blocks of that type with ordinary f16 scales, and their
float32 values W. Measured in this one process, the variants of one type interleaved in each
repeat (medians of --repeats):

  dense     x @ W.t() for one row of activations: the float32 matrix-vector product (the baseline)
  torch     runtime/dequant.py's torch decoders (dequantize_rows)
  native    the CPU backend's dequantize_rows (runtime/_dequant.c); like `torch`, into a new tensor, so
            both include the cost of fresh memory (page faults), which varies with the allocator
  native buf  the native decoders into one preallocated buffer: the kernels alone
  linear 1  the runtime's product of a stored weight (the CPU backend's linear), one row
  dense 8   x @ W.t() for 8 rows
  linear 8  the same, 8 rows

Each as ms and as the ratio to `dense` (`linear 8` also to `dense 8`); a sample times enough calls
in a row for ~5 ms. Time is this process's CPU time by default (steadier than the wall clock where others share the cores); torch and the native
code run on --threads threads. Then, for one 1024 x 1024 Q8_0 chunk, native dequantization on 1
thread and on 2 (wall clock: what a split over threads buys).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specconv.runtime import dequant_native  # noqa: E402
from specconv.runtime.dequant import dequantize_rows  # noqa: E402
from specconv.runtime.backend import for_device  # noqa: E402
from specconv.runtime.stored import StoredWeight  # noqa: E402

TYPES = "Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,F16,BF16"
F16_FIELDS = {  # byte offsets of the f16 scales in a block
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
    QType.IQ4_NL: (0,), QType.IQ4_XS: (0,),
}
VARIANTS = ("dense", "torch", "native", "native buf", "linear 1", "dense 8", "linear 8")


def blocks(qtype: QType, rows: int, n_in: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row bytes]: random codes, f16 scales between 1e-3 and 1.1e-2."""
    rng = np.random.default_rng(seed)
    if qtype in (QType.F16, QType.BF16):
        values = torch.from_numpy(rng.standard_normal((rows, n_in), dtype=np.float32)) * 0.05
        return values.to(torch.float16 if qtype == QType.F16 else torch.bfloat16).view(torch.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, n_in // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.random((rows, n_in // block), dtype=np.float32) * 0.01 + 1e-3).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, n_in // block, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def timed(run, clock, number: int = 1) -> float:
    """Seconds per call of `number` calls in a row."""
    start = clock()
    for _ in range(number):
        run()
    return (clock() - start) / number


def calls_per_sample(run, clock) -> int:
    """Calls per timing sample: enough for ~5 ms, so the clock's resolution does not matter."""
    once = max(timed(run, clock), 1e-6)
    return max(1, min(50, round(0.005 / once)))


CPU = for_device("cpu")


def measure(qtype: QType, rows: int, n_in: int, repeats: int, clock) -> dict[str, float]:
    raw = blocks(qtype, rows, n_in)
    w = dequantize_rows(raw, qtype)
    stored = StoredWeight(raw, qtype, (rows, n_in), torch.float32, torch.device("cpu"))
    x1, x8 = torch.randn(1, n_in), torch.randn(8, n_in)
    buffer = torch.empty(rows * n_in)
    runs = {
        "dense": lambda: x1 @ w.t(),
        "torch": lambda: dequantize_rows(raw, qtype),
        "native": lambda: CPU.dequantize_rows(raw, qtype, torch.float32),
        "native buf": lambda: dequant_native.dequantize(raw, qtype, out=buffer),
        "linear 1": lambda: CPU.linear(x1, stored),
        "dense 8": lambda: x8 @ w.t(),
        "linear 8": lambda: CPU.linear(x8, stored),
    }
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    number = {name: calls_per_sample(runs[name], clock) for name in VARIANTS}  # also a warm-up
    for _ in range(repeats):
        for name in VARIANTS:
            times[name].append(timed(runs[name], clock, number[name]))
    return {k: statistics.median(v) for k, v in times.items()}


def thread_split(repeats: int) -> tuple[float, float]:
    """Wall ms of native Q8_0 dequantization of one 1024 x 1024 chunk on 1 and on 2 threads."""
    raw = blocks(QType.Q8_0, 1024, 1024)
    out = torch.empty(1024 * 1024)
    one, two = [], []
    for _ in range(repeats):
        one.append(timed(lambda: dequant_native.dequantize(raw, QType.Q8_0, out=out, threads=1), time.perf_counter))
        two.append(timed(lambda: dequant_native.dequantize(raw, QType.Q8_0, out=out, threads=2), time.perf_counter))
    return statistics.median(one) * 1e3, statistics.median(two) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=TYPES)
    parser.add_argument("--shapes", default="3584x1024,248320x1024", help="out x in, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="wall clock instead of this process's CPU time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not dequant_native.available():
        sys.exit("the native dequantizer is not built (pip install -e . with a C compiler) or is switched off")
    clock = time.perf_counter if args.wall else time.process_time
    print(f"torch {torch.__version__}, {args.threads} thread(s), {'wall' if args.wall else 'CPU'} time, "
          f"medians of {args.repeats}; ms and (ratio to dense)")
    for shape in args.shapes.split(","):
        rows, n_in = (int(v) for v in shape.split("x"))
        print(f"\n[{rows} x {n_in}]  (out x in)")
        print(f"{'type':7} " + " ".join(f"{v:>17}" for v in VARIANTS) + f"  {'linear 8 / dense 8':>18}")
        for name in args.types.split(","):
            t = measure(QType[name], rows, n_in, args.repeats, clock)
            base = t["dense"]
            cells = " ".join(f"{t[v] * 1e3:9.3f} ({t[v] / base:5.2f})" for v in VARIANTS)
            print(f"{name:7} {cells}  {t['linear 8'] / t['dense 8']:18.2f}", flush=True)
    one, two = thread_split(args.repeats)
    print(f"\nnative Q8_0 dequantization of a 1024 x 1024 chunk (wall): 1 thread {one:.3f} ms, "
          f"2 threads {two:.3f} ms ({one / two:.2f}x)")


if __name__ == "__main__":
    main()
