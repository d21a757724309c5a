"""The one-pass quantized product alone on one GPU: achieved bandwidth of kernels_triton.quant_matmul
per weight type, matrix shape and number of activation rows, against torch's bf16 product of the same
matrix dequantized (cuBLAS) and a device-to-device copy of the packed bytes, all in the same run; and
kernels_triton.grouped_matmul (a block's projections of the same rows in one launch) against one
quant_matmul per matrix.

    python3 benchmarks/cuda_matmul.py --json $OUT/cuda_matmul.json

Weights are random blocks through the real encoders' layouts (runtime/dequant.py decodes them), in
the type the CUDA backend keeps them in (a Q8_0 matrix as Q8_0_ROWS: runtime/rows_first.py);
timings are CUDA-event medians over --repeats replays of a CUDA graph of 20 calls after a warm-up
(compilation and the host's Python excluded: the device time a decode step's replay sees).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# (n_out, n_in): a 1 B model's FFN up and down projections and its output head
SHAPES = [(6144, 2048), (2048, 6144), (65536, 2048)]
TYPES = ("Q8_0", "Q4_K", "Q6_K", "BF16")
# the products of the same rows in a 1.1 B Qwen3.5-shaped block (hidden 2048, tools/synth_qwen35.py):
# name -> (n_in, n_out of each matrix)
GROUPS = {
    "Gated DeltaNet qkv, gate, beta, alpha": (2048, (4096, 2048, 16, 16)),
    "attention q (+gate), k, v": (2048, (4096, 512, 512)),
    "SwiGLU gate, up": (2048, (6144, 6144)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--sweep", action="store_true",
                   help="also time the per-lane kernel's tiling settings (programs per SM, blocks per step, "
                        "warps) on the FFN down projection, one and four rows")
    p.add_argument("--no-grouped", action="store_true", help="skip the grouped products")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


CALLS_PER_GRAPH = 20  # calls of fn captured in one CUDA graph (the replay's launch gaps, not Python's)


def timed(fn, repeats: int) -> float:
    """Median seconds of one fn() on the device, as a decode step's graph replays it: CALLS_PER_GRAPH
    calls captured in one CUDA graph, replayed `repeats` times between CUDA events. A Python call
    costs tens of microseconds on the host, longer than a product of a few megabytes on the device,
    so timing it eagerly would time the host. Eagerly only where the capture fails."""
    import torch

    fn()  # compiles, and makes what a capture may not allocate (the products' arrival counters)
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # a warm-up on the capture stream
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(CALLS_PER_GRAPH):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        run, per = graph.replay, CALLS_PER_GRAPH
    except RuntimeError as e:  # timed eagerly, said so
        print(f"(eager timing: capture failed: {str(e).splitlines()[0][:100]})", flush=True)
        run, per = fn, 1
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per)
    return statistics.median(times)


def random_packed(qtype, n_out: int, n_in: int, device):
    """Packed rows of random bytes with sane 16-bit scales (finite values), on `device`."""
    from tests.fixtures.quant_rows import sane_rows

    return sane_rows(qtype, n_out, n_in, seed=n_out + n_in).to(device)


def kept_matrix(qtype, n_out: int, n_in: int, device):
    """(bytes, type) of a random `qtype` matrix as the CUDA backend keeps it once loaded (a Q8_0 matrix as
    Q8_0_ROWS where it takes it: runtime/rows_first.py), on `device`."""
    from specconv.runtime import rows_first
    from specconv.runtime.backend_cuda import CudaBackend

    kept = CudaBackend().stored_type(qtype, (n_out, n_in))
    packed = random_packed(qtype, n_out, n_in, device)
    return (rows_first.to_rows_layout(packed, kept) if kept is not qtype else packed), kept


def main(argv=None) -> list[dict]:
    import torch
    from gguf import GGMLQuantizationType as QType

    from specconv.runtime import kernels_triton as kt

    args = parse_args(argv)
    device = torch.device("cuda")
    results = []
    for name in args.types.split(","):
        qtype = QType[name]
        for n_out, n_in in SHAPES:
            packed, kept = kept_matrix(qtype, n_out, n_in, device)
            dense = kt.dequantize_rows(packed, kept, n_out, n_in, torch.bfloat16)
            copy = torch.empty_like(packed)
            copy_s = timed(lambda: copy.copy_(packed), args.repeats)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, n_in, device=device, dtype=torch.bfloat16)
                fused_s = timed(lambda: kt.quant_matmul(x, packed, kept, n_out, n_in), args.repeats)
                dense_s = timed(lambda: x @ dense.t(), args.repeats)
                row = {"type": name, "kept_as": kept.name, "n_out": n_out, "n_in": n_in, "rows": rows,
                       "bytes": packed.numel(), "fused_s": fused_s, "bf16_dense_s": dense_s, "copy_s": copy_s,
                       "fused_gb_s": packed.numel() / fused_s / 1e9,
                       "copy_gb_s": 2 * packed.numel() / copy_s / 1e9}
                results.append(row)
                print(f"{kept.name:9} {n_out:6}x{n_in:<5} rows {rows:2}: fused {fused_s * 1e6:7.1f} us "
                      f"({row['fused_gb_s']:6.0f} GB/s)  bf16 dense {dense_s * 1e6:7.1f} us  "
                      f"copy {row['copy_gb_s']:6.0f} GB/s", flush=True)
            del packed, dense, copy
    grouped = [] if args.no_grouped else grouped_products(args, device)
    sweep = tiling_sweep(args, device) if args.sweep else []
    if args.json:
        args.json.write_text(json.dumps({"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                         "results": results, "grouped": grouped, "sweep": sweep}, indent=1))
    return results


def grouped_products(args, device) -> list[dict]:
    """Each GROUPS case: grouped_matmul (one launch, plus one adding the pieces of cut matrices)
    against one quant_matmul per matrix, per type and number of rows; the outputs checked equal."""
    import torch
    from gguf import GGMLQuantizationType as QType

    from specconv.runtime import kernels_triton as kt

    out = []
    for name in args.types.split(","):
        qtype = QType[name]
        for case, (n_in, n_outs) in GROUPS.items():
            kept_mats = [kept_matrix(qtype, n_out, n_in, device) for n_out in n_outs]
            mats, kept = [m for m, _ in kept_mats], kept_mats[0][1]
            if any(k is not kept for _, k in kept_mats):  # a group holds one type
                mats, kept = [random_packed(qtype, n_out, n_in, device) for n_out in n_outs], qtype
            size = sum(m.numel() for m in mats)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, n_in, device=device, dtype=torch.bfloat16)

                def separate():
                    return [kt.quant_matmul(x, m, kept, n_out, n_in) for m, n_out in zip(mats, n_outs)]

                def grouped():
                    return kt.grouped_matmul(x, mats, kept, n_outs, n_in)

                same = all(torch.equal(a, b) for a, b in zip(separate(), grouped()))
                separate_s, grouped_s = timed(separate, args.repeats), timed(grouped, args.repeats)
                row = {"type": name, "kept_as": kept.name, "case": case, "n_in": n_in, "n_outs": list(n_outs),
                       "rows": rows, "bytes": size, "separate_s": separate_s, "grouped_s": grouped_s, "same_bits": same,
                       "grouped_gb_s": size / grouped_s / 1e9}
                out.append(row)
                print(f"{kept.name:9} {case:38} rows {rows:2}: {len(n_outs)} products {separate_s * 1e6:7.1f} us, "
                      f"grouped {grouped_s * 1e6:7.1f} us ({row['grouped_gb_s']:6.0f} GB/s), same bits: {same}", flush=True)
    return out


def tiling_sweep(args, device) -> list[dict]:
    """One and four rows through the FFN down projection (2048 x 6144, the file's layout) under each
    tiling setting of the per-lane kernel."""
    import torch
    from gguf import GGMLQuantizationType as QType

    from specconv.runtime import kernels_triton as kt
    from specconv.runtime.kernels_triton import matmul as qm

    saved = (qm.PROGRAMS_PER_SM, dict(qm.STEP_BLOCKS), qm.FUSED_WARPS)
    n_out, n_in = 2048, 6144
    out = []
    try:
        for name in ("Q8_0", "Q4_K"):
            qtype = QType[name]
            packed = random_packed(qtype, n_out, n_in, device)
            # (warps, blocks per step as a multiple of the default, programs per SM)
            for warps, scale, per_sm in ((4, 1, 2), (4, 1, 4), (4, 1, 8), (4, 1, 16), (8, 1, 4), (8, 1, 8),
                                         (4, 2, 4), (4, 2, 8), (8, 2, 4)):
                qm.PROGRAMS_PER_SM, qm.FUSED_WARPS = per_sm, warps
                qm.STEP_BLOCKS[qtype] = saved[1][qtype] * scale
                for rows in (1, 4):
                    x = torch.randn(rows, n_in, device=device, dtype=torch.bfloat16)
                    t = timed(lambda: kt.quant_matmul(x, packed, qtype, n_out, n_in), args.repeats)
                    out.append({"type": name, "warps": warps, "step_blocks": qm.STEP_BLOCKS[qtype],
                                "programs_per_sm": per_sm, "rows": rows, "s": t, "gb_s": packed.numel() / t / 1e9})
                    print(f"sweep {name} warps {warps} step blocks {qm.STEP_BLOCKS[qtype]:2} programs/SM "
                          f"{per_sm:2} rows {rows}: {t * 1e6:7.1f} us ({out[-1]['gb_s']:6.0f} GB/s)", flush=True)
    finally:
        qm.PROGRAMS_PER_SM, qm.FUSED_WARPS = saved[0], saved[2]
        qm.STEP_BLOCKS.clear()
        qm.STEP_BLOCKS.update(saved[1])
    return out


if __name__ == "__main__":
    main()
