"""Rollback of the Gated DeltaNet state in a verification batch: every token's state vs pending states.

    python3 benchmarks/spec_rollback.py [--threads 1] [--repeats 21]

At the 1 B Qwen3.5-shaped model's size (27 Gated DeltaNet layers, 16 value heads, dk = dv = 128: a
1 MB float32 state per layer), for a batch of n = 1..9 tokens (a verification of k = n - 1 drafts),
alternating in one process (medians):

* "every state": the batched delta rule builds the state after each of the n tokens and copies them
  into the snapshot ring (the scheme before runtime/memory.py's pending states);
* "pending": only the last state is written; `rollback` adds building one kept state (a rejection),
  which a round pays only when it rejects a draft.

Only the scan and the state writes are timed (no weight products): the part of t(n) that rollback
bookkeeping adds. Prints a markdown table (docs/benchmarks.md quotes it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NV, DK, DV, LAYERS = 16, 128, 128, 27


def main(argv=None) -> dict:
    import torch

    from specconv.runtime.graphs import gdn

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--n-max", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ring = torch.zeros(LAYERS, args.n_max + 2, NV, DK, DV)
    gen = torch.Generator().manual_seed(0)

    def inputs(n):
        q = torch.nn.functional.normalize(torch.randn(n, NV, DK, generator=gen), dim=-1) * DK ** -0.5
        k = torch.nn.functional.normalize(torch.randn(n, NV, DK, generator=gen), dim=-1)
        return q, k, torch.randn(n, NV, DV, generator=gen), -torch.rand(n, NV, generator=gen), torch.rand(n, NV, generator=gen)

    def every_state(x, n):
        slots = torch.arange(1, n + 1)
        for layer in range(LAYERS):
            _, states = gdn.delta_rule(*x, ring[layer, 0], keep=n)
            ring[layer].index_copy_(0, slots, states)

    def pending(x, n, rollback):
        for layer in range(LAYERS):
            _, states = gdn.delta_rule(*x, ring[layer, 0], keep=n, lazy=True)
            states.state(n - 1, out=ring[layer, n])
            if rollback and n > 1:
                states.state(0, out=ring[layer, 1])

    kinds = {"every state": lambda x, n: every_state(x, n), "pending": lambda x, n: pending(x, n, False),
             "pending + rollback": lambda x, n: pending(x, n, True)}
    times = {(kind, n): [] for kind in kinds for n in range(1, args.n_max + 1)}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for n in range(1, args.n_max + 1):
                x = inputs(n)
                for kind, f in kinds.items():
                    t0 = time.perf_counter()
                    f(x, n)
                    times[(kind, n)].append(time.perf_counter() - t0)
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    ns = range(1, args.n_max + 1)
    print(f"{LAYERS} layers, state {NV}x{DK}x{DV} float32, {args.threads} thread(s), median of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| ms for n tokens | " + " | ".join(f"n={n}" for n in ns) + " |")
    print("|---|" + "---|" * len(ns))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(f"{med[(kind, n)]:.1f}" for n in ns) + " |")
    return med


if __name__ == "__main__":
    main()
