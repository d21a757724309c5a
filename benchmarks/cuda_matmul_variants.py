"""Forms of the Q8_0 one-pass product on one GPU: the two kernels_triton.quant_matmul runs (the per-lane
form over the file's bytes, the tensor-core form over Q8_0_ROWS) against two forms it does not run,
the evidence for the choice of the tensor-core form over rows-first bytes (docs/benchmarks.md, "The
third measurement").

    python3 benchmarks/cuda_matmul_variants.py --json $OUT/variants.json

* `packed-lanes`: quant_matmul over the file's bytes (34-byte blocks read at 2-byte alignment, each
  value decoded, scaled and multiplied with every row in its own lane: the form of float32 rows and
  of Q8_0 tensors not kept rows first).
* `rows-dot`: quant_matmul over Q8_0_ROWS (runtime/rows_first.py) with 16-bit rows: tensor cores.
* `split-lanes` (not run by the runtime): the per-lane loop over a split layout of the same bytes
  (the int8 values of the whole matrix [n_out, n_in], 16-byte aligned rows, then the f16 scales
  [n_out, blocks]): whole 16-byte loads.
* `packed-dot` (not run by the runtime): tensor cores over the file's bytes, one block a step, rows
  padded to 16 (the 2026-11-28 figures were taken with 2 blocks a step).

The two forms the runtime does not run write float32 pieces [splits, rows, n_out], cut along the
inner dimension by the production split plan, the pieces then added by torch (a launch the
production kernel does not make). The bytes moved are the same in every form. Timings are CUDA-graph
replays (benchmarks/cuda_matmul.py `timed`); each form's result is checked against torch's product
of the dequantized matrix (max |Δ| printed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# (n_out, n_in): a 1.1 B Qwen3.5-shaped block's FFN up and down projections, the Gated DeltaNet qkv
SHAPES = [(6144, 2048), (2048, 6144), (4096, 2048)]
# (form, BLOCK_N, blocks per step, warps) of the forms the runtime does not run
CONFIGS = [("split-lanes", 16, 8, 4), ("split-lanes", 32, 4, 4), ("split-lanes", 16, 4, 2),
           ("packed-dot", 64, 1, 4), ("packed-dot", 32, 1, 4)]
DOT_ROWS = 16


@triton.jit
def split_lanes_kernel(x_ptr, q_ptr, d_ptr, part_ptr, n_out, n_in, n_blocks, per_split,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = n < n_out
    first = tl.program_id(1) * per_split
    last = tl.minimum(first + per_split, n_blocks)
    i = tl.arange(0, 32)
    j = tl.arange(0, NB)
    sums = (tl.zeros([BLOCK_N, NB, 32], dtype=tl.float32),) * ROWS
    for b0 in range(first, last, NB):
        blk = b0 + j
        ok = row_ok[:, None] & (blk < last)[None, :]
        k = blk[:, None] * 32 + i[None, :]
        q = tl.load(q_ptr + n.to(tl.int64)[:, None, None] * n_in + k[None, :, :], mask=ok[:, :, None], other=0)
        d = tl.load(d_ptr + n.to(tl.int64)[:, None] * n_blocks + blk[None, :], mask=ok, other=0).to(tl.float32)
        w = q.to(tl.float32) * d[:, :, None]
        updated = ()
        for m in tl.static_range(ROWS):
            x = tl.load(x_ptr + m * n_in + k, mask=(blk < last)[:, None], other=0).to(tl.float32)
            updated = updated + (sums[m] + w * x[None, :, :],)
        sums = updated
    for m in tl.static_range(ROWS):
        total = tl.sum(tl.sum(sums[m], axis=2), axis=1)
        tl.store(part_ptr + (tl.program_id(1) * ROWS + m) * n_out + n, total, mask=row_ok)


@triton.jit
def packed_dot_kernel(x_ptr, w_ptr, part_ptr, n_out, n_in, n_blocks, per_split, stride_w,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
    """Tensor cores over the file's Q8_0 bytes, one block a step; WIDE the dot's operand type (bfloat16
    on a GPU; float32, multiplied in IEEE float32, under the interpreter)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_of_w = w_ptr + n.to(tl.int64) * stride_w
    first = tl.program_id(1) * per_split
    padded = tl.arange(0, DOT_ROWS)
    sums = tl.zeros([DOT_ROWS, BLOCK_N], dtype=tl.float32)
    for blk in range(first, tl.minimum(first + per_split, n_blocks)):
        at = rows_of_w[None, :] + blk * 34  # value v of the block at byte 2 + v, its f16 scale at 0
        xs = tl.load(x_ptr + padded[:, None] * n_in + blk * 32 + tl.arange(0, 32)[None, :],
                     mask=(padded < ROWS)[:, None], other=0).to(WIDE)
        w = tl.load(at + 2 + tl.arange(0, 32)[:, None], mask=(n < n_out)[None, :], other=0)
        scale_bits = tl.load(at, mask=(n < n_out)[None, :], other=0).to(tl.uint16) | (
            tl.load(at + 1, mask=(n < n_out)[None, :], other=0).to(tl.uint16) << 8)
        if WIDE == tl.float32:
            product = tl.dot(xs, w.to(tl.int8, bitcast=True).to(WIDE), input_precision="ieee", out_dtype=tl.float32)
        else:
            product = tl.dot(xs, w.to(tl.int8, bitcast=True).to(WIDE), out_dtype=tl.float32)
        sums += product * scale_bits.to(tl.float16, bitcast=True).to(tl.float32)
    out = part_ptr + (tl.program_id(1) * ROWS + padded[:, None]) * n_out + n[None, :]
    tl.store(out, sums, mask=(padded < ROWS)[:, None] & (n < n_out)[None, :])


def split_layout(packed, n_out: int, n_in: int):
    """(q int8 [n_out, n_in], d float16 [n_out, blocks]) of packed Q8_0 rows: the same bytes."""
    import torch

    blocks = packed.view(n_out, n_in // 32, 34)
    return blocks[:, :, 2:].contiguous().view(torch.int8).view(n_out, n_in), \
        blocks[:, :, :2].contiguous().view(torch.float16).view(n_out, n_in // 32)


def run_form(form: str, x, packed, q, d, n_out: int, n_in: int, block_n: int, nb: int, warps: int):
    """The form's product x @ Wᵀ in float32 [rows, n_out] (pieces added by torch)."""
    import torch
    from gguf import GGMLQuantizationType as QType

    from specconv.runtime.kernels_triton import _common
    from specconv.runtime.kernels_triton.matmul import FUSED_ROWS, split_plan

    rows, n_blocks = x.shape[0], n_in // 32
    # the production plan, counted in tiles of this form's width
    splits, per_split = split_plan(QType.Q8_0, n_out * FUSED_ROWS // block_n, n_blocks, x.device)
    per_split = _common.cdiv(per_split, nb) * nb
    splits = _common.cdiv(n_blocks, per_split)
    parts = torch.empty(splits, rows, n_out, dtype=torch.float32, device=x.device)
    grid = (_common.cdiv(n_out, block_n), splits)
    if form == "split-lanes":
        split_lanes_kernel[grid](x, q, d, parts, n_out, n_in, n_blocks, per_split, ROWS=rows, BLOCK_N=block_n, NB=nb,
                                 num_warps=warps)
    else:
        wide = tl.float32 if _common.interpreting() or x.dtype == torch.float32 else (
            tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
        packed_dot_kernel[grid](x, packed, parts, n_out, n_in, n_blocks, per_split, packed.stride(0), ROWS=rows,
                                BLOCK_N=block_n, WIDE=wide, num_warps=warps)
    return parts.sum(0)


def main(argv=None) -> list[dict]:
    import torch
    from gguf import GGMLQuantizationType as QType

    from benchmarks.cuda_matmul import random_packed, timed
    from specconv.runtime import kernels_triton as kt, rows_first

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    results = []
    for n_out, n_in in SHAPES:
        packed = random_packed(QType.Q8_0, n_out, n_in, device)
        q, d = split_layout(packed, n_out, n_in)
        kept = rows_first.to_rows_layout(packed, rows_first.Q8_0_ROWS)
        dense = kt.dequantize_rows(packed, QType.Q8_0, n_out, n_in, torch.float32)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, n_in, device=device, dtype=torch.bfloat16)
            want = x.float() @ dense.t()
            base_s = timed(lambda: kt.quant_matmul(x, packed, QType.Q8_0, n_out, n_in), args.repeats)
            line = {"form": "packed-lanes", "n_out": n_out, "n_in": n_in, "rows": rows, "s": base_s,
                    "gb_s": packed.numel() / base_s / 1e9}
            results.append(line)
            print(f"{n_out:5}x{n_in:<5} rows {rows:2} packed-lanes (quant_matmul)       {base_s * 1e6:7.1f} us "
                  f"({line['gb_s']:5.0f} GB/s)", flush=True)
            got = kt.quant_matmul(x, kept, rows_first.Q8_0_ROWS, n_out, n_in).float()
            t = timed(lambda: kt.quant_matmul(x, kept, rows_first.Q8_0_ROWS, n_out, n_in), args.repeats)
            results.append({"form": "rows-dot", "n_out": n_out, "n_in": n_in, "rows": rows, "s": t,
                            "gb_s": packed.numel() / t / 1e9, "max_abs_err": (got - want).abs().max().item(),
                            "vs_quant_matmul": base_s / t})
            print(f"{n_out:5}x{n_in:<5} rows {rows:2} rows-dot (quant_matmul, Q8_0_ROWS) {t * 1e6:7.1f} us "
                  f"({results[-1]['gb_s']:5.0f} GB/s, {base_s / t:4.2f}x)", flush=True)
            for form, block_n, nb, warps in CONFIGS:
                try:
                    got = run_form(form, x, packed, q, d, n_out, n_in, block_n, nb, warps)
                    err = (got - want).abs().max().item()
                    t = timed(lambda: run_form(form, x, packed, q, d, n_out, n_in, block_n, nb, warps), args.repeats)
                except Exception as e:  # a form the compiler refuses: said, and the sweep goes on
                    print(f"{form} {block_n} {nb} {warps}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
                line = {"form": form, "block_n": block_n, "nb": nb, "warps": warps, "n_out": n_out, "n_in": n_in,
                        "rows": rows, "s": t, "gb_s": packed.numel() / t / 1e9, "max_abs_err": err,
                        "vs_quant_matmul": base_s / t}
                results.append(line)
                print(f"{n_out:5}x{n_in:<5} rows {rows:2} {form:11} N {block_n:3} NB {nb} warps {warps} "
                      f"{t * 1e6:7.1f} us ({line['gb_s']:5.0f} GB/s, {base_s / t:4.2f}x)  max|Δ| {err:.2e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"card": torch.cuda.get_device_name(0), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
