"""Cost of one target forward of n = 1..N tokens (a decode step, the check of n-1 drafts) for one GGUF
file, in CPU time and wall time, for the runtime's weight paths side by side in one process.

    python3 benchmarks/runtime_batch_cost.py FILE.gguf [--threads 1] [--batch-max 8] [--repeats 5]
        [--modes fused,chunked,dense]

Modes: `fused` — stored weights as the runtime runs them (the fused native product for up to
backend_cpu.FUSED_MAX_ROWS rows); `chunked` — the same model with the fused product off
(FUSED_MAX_ROWS = 0: native pieces + BLAS, what k+1 > 2 rows took before the multi-row kernels);
`dense` — every weight dequantized to float32 at load (`weights="dense"`). The passes alternate
modes and batch sizes (n = 1..N in turn, `--repeats` passes); the figures are medians. CPU time
(time.process_time) is the measure that holds on a shared machine with one thread: it counts the
work of this process only; wall time is printed next to it. The forwards run as
runtime/spec_auto.measure_target_costs runs them: logits for every row, at position 16 of a
context, rolled back after each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _costs(model, n_max: int, repeats: int, modes_of_pass) -> dict:
    from specconv.runtime.context import Context
    from specconv.runtime.types import GraphType

    prefix = 16
    ids = [(3 + 7919 * i) % model.vocab_size for i in range(prefix + n_max)]
    ctx = Context(model, GraphType.MAIN, n_ctx=prefix + n_max + 1, n_rs_seq=n_max)
    ctx.decode(ids[:prefix], hidden=(), logits=None)
    ctx.decode(ids[prefix:prefix + 1], hidden=(), logits="all")  # first-call costs out of the timings
    ctx.seq_rm(0, prefix)
    runs = {}
    for _ in range(repeats):
        for mode, enter in modes_of_pass:
            enter()
            for n in range(1, n_max + 1):
                c0, w0 = time.process_time(), time.perf_counter()
                ctx.decode(ids[prefix:prefix + n], hidden=(), logits="all")
                runs.setdefault(mode, {}).setdefault(n, []).append((time.process_time() - c0, time.perf_counter() - w0))
                ctx.seq_rm(0, prefix)
    return {mode: {n: (statistics.median(c for c, _ in r), statistics.median(w for _, w in r)) for n, r in per.items()}
            for mode, per in runs.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-max", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="fused,chunked,dense", help="comma-separated: fused, chunked, dense")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from specconv.runtime import backend_cpu, load_model
    from specconv.runtime import dequant_native

    modes = args.modes.split(",")
    load0 = os.getloadavg()[0]
    results = {}
    keep = backend_cpu.FUSED_MAX_ROWS

    def fused():
        backend_cpu.FUSED_MAX_ROWS = keep

    def chunked():
        backend_cpu.FUSED_MAX_ROWS = 0

    stored_modes = [(m, {"fused": fused, "chunked": chunked}[m]) for m in modes if m in ("fused", "chunked")]
    if stored_modes:
        model = load_model(args.file, device="cpu", weights="stored")
        results.update(_costs(model, args.batch_max, args.repeats, stored_modes))
        fused()
        del model
    if "dense" in modes:
        model = load_model(args.file, device="cpu", weights="dense")
        results.update(_costs(model, args.batch_max, args.repeats, [("dense", lambda: None)]))
        del model
    from gguf import GGMLQuantizationType as QType

    meta = {"file": os.path.basename(args.file), "threads": args.threads, "repeats": args.repeats,
            "kernel_bits": dequant_native.fused_width(QType.Q8_0), "pool": dequant_native.thread_pool(),
            "load": [load0, os.getloadavg()[0]]}
    print(f"{meta['file']}: {args.threads} thread(s), medians of {args.repeats} alternating passes, fused kernel "
          f"{meta['kernel_bits']}-bit, threads on {meta['pool']}, load average {load0:.1f} -> {meta['load'][1]:.1f}")
    print("| mode | t(1) CPU ms | t(1) wall ms | " + " | ".join(f"n={n}" for n in range(2, args.batch_max + 1)) + " |")
    print("|---|---|---|" + "---|" * (args.batch_max - 1))
    for mode in modes:
        per = results[mode]
        t1 = per[1][0]
        print(f"| {mode} | {t1 * 1e3:.1f} | {per[1][1] * 1e3:.1f} | "
              + " | ".join(f"{per[n][0] / t1:.2f}" for n in range(2, args.batch_max + 1)) + " |")
    out = {"meta": meta, "cpu_s": {m: [results[m][n][0] for n in sorted(results[m])] for m in modes},
           "wall_s": {m: [results[m][n][1] for n in sorted(results[m])] for m in modes}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
