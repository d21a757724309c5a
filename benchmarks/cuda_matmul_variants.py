"""Candidate forms of the Q8_0 one-pass product, timed against kernels_triton.quant_matmul on one GPU:
which main loop the decode step's products should take next.

    python3 benchmarks/cuda_matmul_variants.py --json $OUT/variants.json

Forms (each a main loop writing float32 pieces [splits, rows, n_out], cut along the inner dimension
by the production split plan, the pieces then added by torch):

* `packed-lanes`: the production kernel itself (quant_matmul: 34-byte blocks read at 2-byte
  alignment, each value decoded, scaled and multiplied with every row in its own lane).
* `split-lanes`: the same per-lane loop over a split layout of the same bytes (the int8 values of the
  whole matrix [n_out, n_in], 16-byte aligned rows, then the f16 scales [n_out, blocks]): whole
  16-byte loads.
* `split-dot` / `packed-dot`: tensor cores. The activation rows padded to 16 (one code path for 1-16
  rows: the same operations whatever the batch), each 32-value block's int8 values widened exactly
  to the activations' 16-bit type, multiplied by tl.dot into float32 and scaled by the block's f16
  scale in float32 (x · q is exact in bf16 inputs; the scale is applied exactly as the dequantizer
  would not: once per block rather than per value, so bits differ from dequant-then-multiply).

The bytes moved are the same in every form (the split layout is the packed bytes rearranged).
Timings are CUDA-graph replays (benchmarks/cuda_matmul.py `timed`); each form's result is checked
against torch's product of the dequantized matrix (max |Δ| printed).
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
# (form, BLOCK_N, blocks per step, warps)
CONFIGS = [("split-lanes", 16, 8, 4), ("split-lanes", 32, 4, 4), ("split-lanes", 16, 4, 2),
           ("split-dot", 16, 2, 4), ("split-dot", 32, 2, 4), ("split-dot", 64, 2, 4), ("split-dot", 64, 4, 4),
           ("split-dot", 128, 2, 4), ("split-dot", 64, 2, 8), ("packed-dot", 64, 2, 4), ("packed-dot", 32, 2, 4)]
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
def dot_kernel(x_ptr, q_ptr, d_ptr, part_ptr, n_out, n_in, n_blocks, per_split, stride_w,
               ROWS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
               PACKED: tl.constexpr, WIDE: tl.constexpr):
    """WIDE: the dot's operand type (bfloat16 on a GPU; float32 under the interpreter)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = n < n_out
    first = tl.program_id(1) * per_split
    last = tl.minimum(first + per_split, n_blocks)
    m = tl.arange(0, M)
    m_ok = m < ROWS
    i = tl.arange(0, 32)
    acc = tl.zeros([M, BLOCK_N], dtype=tl.float32)
    for b0 in range(first, last, NB):
        for s in tl.static_range(NB):
            b = b0 + s
            k = b * 32 + i
            k_ok = k < last * 32
            x = tl.load(x_ptr + m[:, None] * n_in + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
            ok = row_ok[None, :] & k_ok[:, None]  # [32, BLOCK_N]
            d_ok = row_ok[None, :] & (n * 0 + b < last)[None, :]
            if PACKED:  # [32, BLOCK_N]: value i of block b of row n at byte 34 b + 2 + i
                base = q_ptr + n.to(tl.int64)[None, :] * stride_w + b * 34
                q = tl.load(base + 2 + i[:, None], mask=ok, other=0).to(tl.int8, bitcast=True)
                low = tl.load(base, mask=d_ok, other=0).to(tl.uint16)
                high = tl.load(base + 1, mask=d_ok, other=0).to(tl.uint16)
                d = (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)
            else:
                q = tl.load(q_ptr + n.to(tl.int64)[None, :] * n_in + k[:, None], mask=ok, other=0)
                d = tl.load(d_ptr + n.to(tl.int64)[None, :] * n_blocks + b, mask=d_ok, other=0).to(tl.float32)
            if WIDE == tl.float32:  # exact float32 products (not TF32) where the inputs are float32
                part = tl.dot(x.to(WIDE), q.to(WIDE), input_precision="ieee", out_dtype=tl.float32)
            else:
                part = tl.dot(x.to(WIDE), q.to(WIDE), out_dtype=tl.float32)
            acc += part * d
    out = part_ptr + (tl.program_id(1) * ROWS + m[:, None]) * n_out + n[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & row_ok[None, :])


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
        packed_form = form == "packed-dot"
        wide = tl.float32 if _common.interpreting() or x.dtype == torch.float32 else (
            tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
        dot_kernel[grid](x, packed if packed_form else q, d, parts, n_out, n_in, n_blocks, per_split,
                         packed.stride(0), ROWS=rows, M=max(DOT_ROWS, _common.next_power_of_2(rows)), BLOCK_N=block_n,
                         NB=nb, PACKED=packed_form, WIDE=wide, num_warps=warps)
    return parts.sum(0)


def main(argv=None) -> list[dict]:
    import torch
    from gguf import GGMLQuantizationType as QType

    from benchmarks.cuda_matmul import random_packed, timed
    from specconv.runtime import kernels_triton as kt

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
