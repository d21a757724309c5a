"""How fast Q8_0 rows are rearranged rows-first (runtime/rows_first.py), against a plain copy of the same bytes.

    python3 benchmarks/rows_first.py [--device cpu|cuda] [--shape 6144x2048] [--repeats 5] [--threads 1]

The CUDA backend keeps Q8_0 matrices as `Q8_0_ROWS` (each row's 32-value blocks first, then their
scales); at load the file's bytes are moved to the device and rewritten there in place
(`moved_as_rows`). This prints, for one random Q8_0 matrix of --shape values, in this one process
(medians of --repeats, each timing a fresh call; the first call of each variant is a warm-up and is
not counted):

  copy        `clone()` of the matrix's bytes on the device: reading and writing them once (the baseline)
  to_rows     `to_rows_layout`: the rearranged rows as a new tensor
  in place    `rearrange_in_place`: the rows rewritten where they are, CHUNK_BYTES at a time

each as ms, GB/s of the file's bytes and the ratio to `copy`. A GB of q8_0 file takes 1 / (GB/s)
seconds to rearrange; docs/runtime.md ("Rows-first storage") reports the figures with their machine.
On CUDA, each timing ends with a synchronize.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specconv.runtime import rows_first  # noqa: E402

VARIANTS = ("copy", "to_rows", "in place")


def random_q8_0(rows: int, n_in: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row bytes] of Q8_0 blocks: random values, each block's f16 scale a normal number."""
    block, size = GGML_QUANT_SIZES[QType.Q8_0]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, n_in // block, size), dtype=torch.uint8, generator=g)
    scales = (torch.rand(rows, n_in // block, 1, generator=g) * 1e-2 + 1e-3).to(torch.float16)
    raw[..., :2] = scales.view(torch.uint8)
    return raw.flatten(1).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(variant: str, raw: torch.Tensor) -> None:
    if variant == "copy":
        raw.clone()
    elif variant == "to_rows":
        rows_first.to_rows_layout(raw, rows_first.Q8_0_ROWS)
    else:
        rows_first.rearrange_in_place(raw, rows_first.Q8_0_ROWS)


def measure(rows: int, n_in: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each variant over `repeats` timed calls after one warm-up, variants interleaved
    in each repeat. Each call gets its own fresh matrix (in place rewrites its input)."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(repeats + 1):
        for variant in VARIANTS:
            raw = random_q8_0(rows, n_in, device, seed=r)
            _sync(device)
            start = time.perf_counter()
            _run(variant, raw)
            _sync(device)
            if r:
                times[variant].append(time.perf_counter() - start)
    return {v: statistics.median(t) for v, t in times.items()}


def report(seconds: dict[str, float], nbytes: int) -> list[str]:
    lines = [f"{'variant':<10} {'ms':>9} {'GB/s':>8} {'/ copy':>7}"]
    for variant, s in seconds.items():
        lines.append(f"{variant:<10} {s * 1e3:>9.3f} {nbytes / s / 1e9:>8.2f} {s / seconds['copy']:>7.2f}")
    return lines


def main(argv=None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="where the bytes are rearranged (cpu, cuda)")
    p.add_argument("--shape", default="6144x2048", help="the matrix, out x in values (in: a multiple of 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each variant (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = p.parse_args(argv)
    rows, n_in = (int(v) for v in args.shape.lower().split("x"))
    if n_in % rows_first.ROW_VALUES_MULTIPLE:
        p.error(f"--shape: rows of {n_in} values are not kept rows-first "
                f"(a multiple of {rows_first.ROW_VALUES_MULTIPLE} is)")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    seconds = measure(rows, n_in, device, args.repeats)
    nbytes = rows * n_in // 32 * GGML_QUANT_SIZES[QType.Q8_0][1]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"Q8_0 {rows} x {n_in} ({nbytes / 1e6:.1f} MB), {name}, medians of {args.repeats}")
    print("\n".join(report(seconds, nbytes)))
    return seconds


if __name__ == "__main__":
    main()
