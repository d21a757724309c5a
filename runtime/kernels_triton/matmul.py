"""x @ Wᵀ with W kept in its GGUF type, for decode steps and verification batches in one pass.

    quant_matmul(x, packed, qtype, n_out, n_in, out=None, up=None, act=None) -> y [..., n_out]   (result_dtype)
    grouped_matmul(x, [packed, ...], qtype, [n_out, ...], n_in) -> (y, ...)    (x @ Wᵢᵀ for each i)
    quant_matmul_add_rms_norm(x, packed, qtype, n_out, n_in, h, weight, eps, up=None, act=None)
        -> (h + y, rms_norm(h + y) · weight)   (y quant_matmul's; its launch ends with the add and norm)
    quant_matmul_add_normed(x, packed, qtype, n_out, n_in, h, weight, eps, scale=None, then=None, up=None, act=None)
        -> (s, o) = ((h + rms_norm(y) · weight) (· scale), rms_norm(s) · then or None)   (Gemma's sandwich)

x: float32 / bfloat16 / float16 [..., n_in]; `packed`: W's bytes as runtime/stored.py keeps them
(`StoredWeight.raw`, uint8 [n_out, row bytes]), on x's device (CUDA, or the CPU under
TRITON_INTERPRET=1); `qtype` one of dequant.KERNEL_TYPES (Q8_0, Q4_K, Q5_K, Q6_K, BF16, F16, F32).
The result is in x's dtype, except by an F32 W (the small matrices a graph keeps float32 whatever
the compute dtype: MoE routers, gates): float32, x read in its own dtype and widened inside, so a
bfloat16 x gives the bits of x.float() and the caller needs no cast launch of its own.

With `up` (x's shape and dtype) and a GLU activation `act` (activation.GLU: "silu", "gelu_tanh"),
the rows multiplied are act(x) · up, x the gate: a GLU feed-forward's down product. The one-pass
kernel computes each value where it reads its input, rounded into x's dtype as activation.glu
rounds it, so the result has the bits of glu followed by the product, with no launch for the GLU
and no [rows, F] tensor in between (the tensor-core form, below, runs glu first); more rows run
glu, then the prompt path.

* Up to FUSED_MAX_ROWS activation rows (a decode step, the check of k drafts): one kernel that walks
  W once, decoding each block in registers and multiplying it with every row; float32 products and
  sums, one rounding into the result's dtype at the end. A row's result does not depend on how many rows
  the call holds (each row's sum runs the same operations in the same order), so a verification
  batch reproduces the one-row decode step bit for bit. A matrix with few rows of tiles is also cut
  along its inner dimension (`split_plan`: a function of W's shape and the device only), so that the
  whole GPU streams it; the float32 sums of the pieces are added in order (part 0 + part 1 + ...)
  by the last program of each tile to finish, in the same launch (a per-tile arrival counter,
  _common.tile_counters; a second small kernel where none can be had: during a CUDA graph capture).
  Two forms of that kernel, chosen by W's type and x's dtype (`uses_dot`), never by the number of
  rows: per lane (each value decoded and multiplied with every row in its own float32 lane), and,
  for a Q8_0_ROWS W (runtime/rows_first.py) and 16-bit rows, on tensor cores (the rows padded to
  DOT_ROWS, each block's values by tl.dot, then its scale: _quant_jit._dot_sums; a GLU input
  computed by one glu launch first).
* Several matrices of one type and inner dimension times the same rows (`grouped_matmul`: a block's
  projections of one normed input): up to GROUP_MAX matrices in one launch of the one-pass kernel,
  a program id standing for (matrix, tile of weight rows, piece), each matrix with its own tiling
  and split plan, so that each output has the bits quant_matmul gives that matrix alone, the pieces
  of the cut ones added as quant_matmul adds them.
* A residual add and RMSNorm after the product (`quant_matmul_add_rms_norm`: a block's mixer or
  FFN output joining the stream, normed for the next half-block): up to FUSED_MAX_ROWS rows, the
  last tile of the one-pass launch to finish (a launch-wide arrival counter after the tiles' own)
  adds y to the stream and normalises each row with norm_kernel's formula (_pointwise_jit.norm_row),
  one row at a time: the bits of the product then the norm launch, in one launch. Gemma's sandwich
  norms likewise (`quant_matmul_add_normed`): y normed, added to the stream (and scaled by the
  layer's output scale), then normed for the next half-block where one reads it.
* More rows (prompts): W a piece at a time through dequant.dequantize_rows into the result's dtype, each
  piece multiplied by torch's dense product (cuBLAS on a GPU). A float W in the result's dtype (a
  16-bit one in x's, an F32 one) is multiplied as it is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch
from gguf import GGMLQuantizationType as QType

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common, activation, norm
from specconv.runtime.kernels_triton.dequant import GEOMETRY, dequantize_rows, packed_matrix
from specconv.runtime.rows_first import Q8_0_ROWS

FUSED_MAX_ROWS = 16
FUSED_ROWS = 16  # weight rows per program of the one-pass kernel
# blocks per step of the one-pass kernel: the decoded tile [16, NB·32] is also each activation row's
# elementwise accumulator, so its size is registers per row (Q8_0's 8 blocks serve one to four rows
# best and spill past eight; 16-bit floats stay unspilled to 8 rows at 4)
STEP_BLOCKS = {QType.Q8_0: 8, Q8_0_ROWS: 8, QType.Q4_K: 2, QType.Q5_K: 2, QType.Q6_K: 1, QType.BF16: 4,
               QType.F16: 4, QType.F32: 4}
# The tensor-core form (_quant_jit._dot_sums): the types it reads with their (weight rows per program,
# blocks per step), the rows' dtypes (16-bit: exact products) and the rows it pads to. Measured on an
# H200 (benchmarks/cuda_matmul.py and _variants.py, docs/benchmarks.md): a Q8_0_ROWS product flat
# from 1 to 8 rows, where the per-lane form's time grows with every row. The same form over Q4_K and
# over rows-first Q6_K took 22 and 19 µs for a 6144 x 2048 matrix at any width, against 12.5 µs for
# Q4_K's per-lane form at one row: the K-quants keep the per-lane form
DOT_TILE = {Q8_0_ROWS: (64, 2)}
DOT_TYPES = frozenset(DOT_TILE)
DOT_DTYPES = (torch.bfloat16, torch.float16)
DOT_ROWS = 16
PROGRAMS_PER_SM = 4  # programs in flight per multiprocessor that keep the memory system busy
FUSED_WARPS = 4
# the products' multiply-adds as FMAs, said explicitly (Triton's default changes between versions):
# half the instructions of the loop, and every row's sums the same operations at every width
# (tests/runtime/test_triton_compile.py checks the compiled code)
FUSED_FMA = True
SUM_BLOCK = 1024
GROUP_MAX = 4  # matrices per launch of grouped_matmul (one pointer argument each)
# the rows the product kernel's norm tail takes: a multiple of 16 values wide (Triton's divisibility
# unit: every row's start aligned), so that it and norm_kernel (norm.WARPS warps, FUSED_WARPS here)
# read them as whole vectors in blocks of norm.row_block and their sums compile to the same reduction
# (the same layout: tools/triton_aot.py's digests), with the same bits. Other rows: the product,
# then the norm kernel's launch
TAIL_ALIGN = 16
# values of W dequantized per piece of the prompt path (32 MB in bfloat16)
TILE_VALUES = 1 << 24
_FLOAT_TYPES = {QType.BF16: torch.bfloat16, QType.F16: torch.float16, QType.F32: torch.float32}


def uses_dot(qtype, x_dtype: torch.dtype | None) -> bool:
    """Whether products by a `qtype` matrix of rows in `x_dtype` take the tensor-core form: a choice made
    by the weight's type and the model's dtype, never by the number of rows."""
    return qtype in DOT_TYPES and x_dtype in DOT_DTYPES


def tile_shape(qtype, x_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(weight rows per program, blocks per step) of the one-pass kernel for `qtype` and rows in `x_dtype`."""
    return DOT_TILE[qtype] if uses_dot(qtype, x_dtype) else (FUSED_ROWS, STEP_BLOCKS[qtype])


# the tensor-core operands' type by the rows' dtype (_quant_jit's WIDE; float32: IEEE float32 products,
# the interpreter's, which has no bfloat16 arithmetic)
WIDE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _form_args(qtype, x_dtype: torch.dtype | None, rows: int) -> dict:
    """The one-pass kernels' form arguments: DOT, the tensor-core operand type WIDE (the rows' 16-bit
    type; float32 under the interpreter, which has no bfloat16 arithmetic), ROWS_P2, BLOCK_N and NB."""
    dot = uses_dot(qtype, x_dtype)
    block_n, nb = tile_shape(qtype, x_dtype)
    wide = WIDE[x_dtype if dot and not _common.interpreting() else torch.float32]
    return dict(DOT=dot, WIDE=wide, ROWS_P2=DOT_ROWS if dot else _common.next_power_of_2(rows), BLOCK_N=block_n,
                NB=nb)


def result_dtype(qtype: QType, x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of x @ Wᵀ: float32 for an F32 W (a matrix kept float32 keeps its product float32,
    as x.float() @ W does), x's dtype otherwise."""
    return torch.float32 if qtype == QType.F32 else x_dtype


def quant_matmul(x: torch.Tensor, packed: torch.Tensor, qtype: QType, n_out: int, n_in: int,
                 out: torch.Tensor | None = None, up: torch.Tensor | None = None,
                 act: str | None = None) -> torch.Tensor:
    """y = x @ Wᵀ for a packed [n_out, n_in] matrix W, in result_dtype (written into `out` when given:
    a contiguous tensor [..., n_out]); with `up` and `act`, y = (act(x) · up) @ Wᵀ (the module doc)."""
    op = "quant_matmul"
    packed = packed_matrix(op, packed, qtype, n_out, n_in)
    _common.check_float(op, "x", x)
    if x.dim() == 0 or x.shape[-1] != n_in:
        raise SpecconvError(f"{op}: x has shape {tuple(x.shape)}, expected [..., {n_in}]")
    device = _common.check_device(op, x, packed)
    xs, us = _input_rows(op, x, up, act, n_in)
    rows = xs.shape[0]
    dtype = result_dtype(qtype, x.dtype)
    if out is None:
        out = torch.empty(*x.shape[:-1], n_out, dtype=dtype, device=device)
    else:
        _common.check_shape(op, "out", out, (*x.shape[:-1], n_out))
        _common.check_device(op, x, out)
        if out.dtype != dtype or not out.is_contiguous():
            raise SpecconvError(f"{op}: out must be a contiguous {dtype} tensor (got {out.dtype}, "
                                f"strides {out.stride()})")
    ys = out.view(rows, n_out)
    if rows == 0:
        return out
    if rows <= FUSED_MAX_ROWS:
        _one_pass(xs, packed, ys, qtype, n_out, n_in, device, up=us, act=act)
        return out
    if us is not None:  # a prompt: the GLU's launch, then the dense product
        xs = activation.glu(xs, us, act)
    xs = xs.to(dtype)
    if (_FLOAT_TYPES.get(qtype) == dtype and packed.data_ptr() % dtype.itemsize == 0
            and packed.stride(0) % dtype.itemsize == 0):
        torch.mm(xs, packed.view(dtype).t(), out=ys)
        return out
    step = max(1, TILE_VALUES // n_in)
    for start in range(0, n_out, step):
        piece = dequantize_rows(packed[start:start + step], qtype, min(step, n_out - start), n_in, dtype)
        ys[:, start:start + piece.shape[0]] = xs @ piece.t()
    return out


@dataclass(frozen=True)
class NormTail:
    """The residual add and RMSNorm a product's launch ends with: h, s, o contiguous [rows, n_out]
    (h the stream, s = h + y, o = rms_norm(s) · weight), weight [n_out]. With `first` (a sandwich
    norm's weight [n_out]): s = h + rms_norm(y) · first, times `scale` (one float32 value) when
    given, and o (with weight) only where `weight` is given."""
    h: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    s: torch.Tensor
    o: torch.Tensor | None
    first: torch.Tensor | None = None
    scale: torch.Tensor | None = None


def tail_fits(width: int) -> bool:
    """Whether the norm tail takes rows of `width` values (TAIL_ALIGN; up to norm.MAX_WIDTH)."""
    return width <= norm.MAX_WIDTH and width % TAIL_ALIGN == 0


def quant_matmul_add_rms_norm(x: torch.Tensor, packed: torch.Tensor, qtype: QType, n_out: int, n_in: int,
                              h: torch.Tensor, weight: torch.Tensor, eps: float, up: torch.Tensor | None = None,
                              act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, o) = (h + y, rms_norm(h + y) · weight) for y = quant_matmul(x, packed, ..., up=up, act=act):
    a block's residual add and the norm after it, h [..., n_out] in y's dtype, weight [n_out]; s and
    o new tensors (h is not written). Up to FUSED_MAX_ROWS rows whose width the tail takes
    (`tail_fits`): one launch, the product's, which ends with them (its last tile to finish adds and normalises every
    row: fused_rows_kernel TAIL); otherwise, and where no counter can be had (during a CUDA graph
    capture), quant_matmul then norm.rms_norm(h, weight, eps, residual=y), whose bits the tail has."""
    op = "quant_matmul_add_rms_norm"
    packed, y, rows, device = _tail_checks(op, x, packed, qtype, n_out, n_in, h, weight)
    if 0 < rows <= FUSED_MAX_ROWS and tail_fits(n_out):
        xs, us = _input_rows(op, x, up, act, n_in)
        tail = NormTail(h.reshape(rows, n_out).contiguous(), weight.contiguous(), eps,
                        torch.empty(rows, n_out, dtype=y.dtype, device=device),
                        torch.empty(rows, n_out, dtype=y.dtype, device=device))
        if _one_pass(xs, packed, y.view(rows, n_out), qtype, n_out, n_in, device, up=us, act=act, tail=tail):
            return tail.s.view(h.shape), tail.o.view(h.shape)
    else:
        quant_matmul(x, packed, qtype, n_out, n_in, out=y, up=up, act=act)
    return norm.rms_norm(h, weight, eps, residual=y)


def quant_matmul_add_normed(x: torch.Tensor, packed: torch.Tensor, qtype: QType, n_out: int, n_in: int,
                            h: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor | None = None,
                            then: torch.Tensor | None = None, up: torch.Tensor | None = None,
                            act: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s, o) for y = quant_matmul(x, packed, ..., up=up, act=act): s = h + rms_norm(y) · weight (a
    sandwich norm's output joining the residual stream, Gemma's), times `scale` (one float32 value)
    when given; o = rms_norm(s) · then (the norm that reads s next) when `then` is given, else None.
    h [..., n_out] in y's dtype, weight and then [n_out]; s and o new tensors. Up to FUSED_MAX_ROWS
    rows whose width the tail takes: one launch, the product's (fused_rows_kernel SANDWICH);
    otherwise, and where no counter can be had, quant_matmul, then norm.rms_norm(y, weight, eps,
    add_to=h, out_scale=scale) and norm.rms_norm(s, then, eps), whose bits the tail has."""
    op = "quant_matmul_add_normed"
    packed, y, rows, device = _tail_checks(op, x, packed, qtype, n_out, n_in, h, weight)
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise SpecconvError(f"{op}: scale is one float32 value (got {scale.dtype}, {scale.numel()} values)")
    if then is not None:
        _common.check_shape(op, "then", then, (n_out,))
        _common.check_float(op, "then", then)
    _common.check_device(op, x, *(t for t in (scale, then) if t is not None))
    if 0 < rows <= FUSED_MAX_ROWS and tail_fits(n_out):
        xs, us = _input_rows(op, x, up, act, n_in)
        tail = NormTail(h.reshape(rows, n_out).contiguous(), None if then is None else then.contiguous(), eps,
                        torch.empty(rows, n_out, dtype=y.dtype, device=device),
                        None if then is None else torch.empty(rows, n_out, dtype=y.dtype, device=device),
                        first=weight.contiguous(), scale=scale)
        if _one_pass(xs, packed, y.view(rows, n_out), qtype, n_out, n_in, device, up=us, act=act, tail=tail):
            return tail.s.view(h.shape), None if then is None else tail.o.view(h.shape)
    else:
        quant_matmul(x, packed, qtype, n_out, n_in, out=y, up=up, act=act)
    s = norm.rms_norm(y, weight, eps, add_to=h, out_scale=scale)
    return s, None if then is None else norm.rms_norm(s, then, eps)


def _tail_checks(op: str, x: torch.Tensor, packed: torch.Tensor, qtype: QType, n_out: int, n_in: int,
                 h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, torch.device]:
    """The checks of a product with a norm tail: (packed as a matrix, y uninitialised [..., n_out] in
    the result's dtype, its row count, the device)."""
    packed = packed_matrix(op, packed, qtype, n_out, n_in)
    _common.check_float(op, "x", x)
    if x.dim() == 0 or x.shape[-1] != n_in:
        raise SpecconvError(f"{op}: x has shape {tuple(x.shape)}, expected [..., {n_in}]")
    dtype = result_dtype(qtype, x.dtype)
    if h.dtype != dtype:
        raise SpecconvError(f"{op}: h must be {dtype}, the product's dtype (got {h.dtype})")
    _common.check_shape(op, "h", h, (*x.shape[:-1], n_out))
    _common.check_shape(op, "weight", weight, (n_out,))
    _common.check_float(op, "weight", weight)
    device = _common.check_device(op, x, packed, h, weight)
    y = torch.empty(*x.shape[:-1], n_out, dtype=dtype, device=device)
    return packed, y, (y.numel() // n_out if n_out else 0), device


def grouped_matmul(x: torch.Tensor, packed: Sequence[torch.Tensor], qtype: QType, n_outs: Sequence[int],
                   n_in: int) -> tuple[torch.Tensor, ...]:
    """(x @ W₀ᵀ, x @ W₁ᵀ, ...) for packed matrices Wᵢ [n_outs[i], n_in] of one type: each output a
    contiguous [..., n_outs[i]] tensor in result_dtype, the outputs consecutive parts of one allocation.
    Up to FUSED_MAX_ROWS rows: one launch per GROUP_MAX matrices, each output the bits of quant_matmul
    by that matrix alone; more rows: quant_matmul per matrix."""
    op = "grouped_matmul"
    if not packed or len(packed) != len(n_outs):
        raise SpecconvError(f"{op}: one n_out per matrix, at least one matrix (got {len(packed)} matrices, "
                            f"{len(n_outs)} n_out)")
    mats = [packed_matrix(op, w, qtype, n_out, n_in) for w, n_out in zip(packed, n_outs)]
    _common.check_float(op, "x", x)
    if x.dim() == 0 or x.shape[-1] != n_in:
        raise SpecconvError(f"{op}: x has shape {tuple(x.shape)}, expected [..., {n_in}]")
    device = _common.check_device(op, x, *mats)
    xs = x.reshape(-1, n_in)
    _common.check_last_contiguous(op, "x", xs)
    rows = xs.shape[0]
    buffer = torch.empty(rows * sum(n_outs), dtype=result_dtype(qtype, x.dtype), device=device)
    starts = [0, *accumulate(rows * n_out for n_out in n_outs)]
    outs = tuple(buffer[a:a + rows * n_out].view(*x.shape[:-1], n_out) for a, n_out in zip(starts, n_outs))
    if rows == 0:
        return outs
    if rows > FUSED_MAX_ROWS:
        for w, n_out, y in zip(mats, n_outs, outs):
            quant_matmul(x, w, qtype, n_out, n_in, out=y)
        return outs
    for g in range(0, len(mats), GROUP_MAX):
        group = slice(g, g + GROUP_MAX)
        _grouped_pass(xs, mats[group], list(n_outs[group]), buffer, starts[group], qtype, n_in, device)
    return outs


def _grouped_pass(xs: torch.Tensor, mats: list[torch.Tensor], n_outs: list[int], buffer: torch.Tensor,
                  y_ats: list[int], qtype: QType, n_in: int, device: torch.device) -> None:
    """Up to GROUP_MAX products into `buffer` (matrix g's [rows, n_outs[g]] at element y_ats[g]): one
    launch of grouped_rows_kernel, each matrix tiled and cut as _one_pass would and its pieces added
    as _one_pass adds them (a launch of grouped_sum_kernel more where no tile counters can be had)."""
    values, size = GEOMETRY[qtype]
    n_blocks = _common.cdiv(n_in, values)
    rows = xs.shape[0]
    plans = [split_plan(qtype, n_out, n_blocks, device, xs.dtype) for n_out in n_outs]
    jit = _common.jit_module("_grouped_jit")
    form = _form_args(qtype, xs.dtype, rows)
    tiles = [_common.cdiv(n_out, form["BLOCK_N"]) for n_out in n_outs]
    ends = list(accumulate(n_tiles * splits for n_tiles, (splits, _) in zip(tiles, plans)))
    cut = [g for g, (splits, _) in enumerate(plans) if splits > 1]
    part_ats, count_ats = [0] * len(mats), [0] * len(mats)
    for g, start in zip(cut, accumulate((plans[g][0] * rows * n_outs[g] for g in cut), initial=0)):
        part_ats[g] = start
    for g, start in zip(cut, accumulate((tiles[g] for g in cut), initial=0)):
        count_ats[g] = start
    parts = (torch.empty(sum(plans[g][0] * rows * n_outs[g] for g in cut), dtype=torch.float32, device=device)
             if cut else buffer)
    counters = _common.tile_counters(device, sum(tiles[g] for g in cut)) if cut else None
    jit.grouped_rows_kernel[(ends[-1],)](
        xs, *_four(mats), buffer, parts, buffer if counters is None else counters, n_in, n_blocks, rows, xs.stride(0),
        *_four([w.stride(0) for w in mats]), *_four(n_outs), *_four([per_split for _, per_split in plans]),
        *_ends(ends), *_four(y_ats), *_four(part_ats), *_four(count_ats),
        QTYPE=int(qtype), VALUES=values, BYTES=size, ROWS=rows, LAST_ADDS=counters is not None, num_warps=FUSED_WARPS,
        enable_fp_fusion=FUSED_FMA, **form)
    if cut and counters is None:
        sum_ends = list(accumulate(_common.cdiv(rows * n_outs[g], SUM_BLOCK) for g in cut))
        jit.grouped_sum_kernel[(sum_ends[-1],)](
            parts, buffer, *_four([rows * n_outs[g] for g in cut]), *_four([plans[g][0] for g in cut]),
            *_ends(sum_ends), *_four([y_ats[g] for g in cut]), *_four([part_ats[g] for g in cut]), BLOCK=SUM_BLOCK)


def _four(values: list) -> list:
    """Per-matrix arguments of the grouped kernels: unused slots repeat the first matrix's (which keeps
    what Triton infers from the arguments, e.g. alignment, that of the matrices in the group)."""
    return values + values[:1] * (GROUP_MAX - len(values))


def _ends(ends: list[int]) -> list[int]:
    """end0..end2 of the grouped kernels: programs of matrix g end before ends[g]; slots past the last
    matrix hold the grid's size (no program reaches them)."""
    return (ends[:-1] + [ends[-1]] * GROUP_MAX)[:GROUP_MAX - 1]


def expert_matmul(x: torch.Tensor, experts: torch.Tensor, qtype: QType, n_out: int, n_in: int,
                  chosen: torch.Tensor, fanout: int = 1, up: torch.Tensor | None = None,
                  act: str | None = None) -> torch.Tensor:
    """y[r] = x[r // fanout] @ W[chosen[r]]ᵀ for each pair r: routed experts by index in one launch (no
    host read of `chosen`). x [P / fanout, n_in] (`fanout` consecutive pairs share an activation row:
    a token's k experts, without a repeated copy of x); `experts` the packed 3-D expert tensor
    [E, n_out, row bytes] (StoredWeight.raw); chosen [P] integer expert indices on x's device. Each
    pair gets the bits of a one-row quant_matmul by its expert. With `up` and `act`, the rows are
    act(x) · up (an expert FFN's down product: quant_matmul's GLU input)."""
    return _expert_products("expert_matmul", x, (experts,), qtype, n_out, n_in, chosen, fanout, up, act)[0]


def expert_matmul_pair(x: torch.Tensor, experts: Sequence[torch.Tensor], qtype: QType, n_out: int, n_in: int,
                       chosen: torch.Tensor, fanout: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_matmul by two packed expert tensors of one shape, type and layout (an expert FFN's gate
    and up) in one launch: two [P, n_out] outputs, consecutive halves of one allocation, each the
    bits of expert_matmul by that tensor."""
    if len(experts) != 2:
        raise SpecconvError(f"expert_matmul_pair: two expert tensors (got {len(experts)})")
    return _expert_products("expert_matmul_pair", x, tuple(experts), qtype, n_out, n_in, chosen, fanout)


def _expert_products(op: str, x: torch.Tensor, experts: tuple, qtype: QType, n_out: int, n_in: int,
                     chosen: torch.Tensor, fanout: int, up: torch.Tensor | None = None,
                     act: str | None = None) -> tuple[torch.Tensor, ...]:
    """The checks and the launch of expert_matmul(_pair): one [P, n_out] output per expert tensor."""
    for t in experts:
        if t.dim() != 3 or t.shape != experts[0].shape or t.stride() != experts[0].stride():
            raise SpecconvError(f"{op}: experts must be 3-D packed tensors [E, n_out, row bytes] of one shape "
                                f"and layout (got shapes {[tuple(e.shape) for e in experts]})")
    packed_matrix(op, experts[0][0], qtype, n_out, n_in)
    _common.check_float(op, "x", x)
    if chosen.dim() != 1 or chosen.dtype not in (torch.int32, torch.int64):
        raise SpecconvError(f"{op}: chosen must be a 1-D tensor of integer expert indices (got {chosen.dtype}, "
                            f"shape {tuple(chosen.shape)})")
    if fanout < 1 or chosen.shape[0] % fanout:
        raise SpecconvError(f"{op}: {chosen.shape[0]} pairs are not {fanout} per activation row")
    _common.check_shape(op, "x", x, (chosen.shape[0] // fanout, n_in))
    device = _common.check_device(op, x, *experts, chosen)
    x, us = _input_rows(op, x, up, act, n_in)
    if experts[0].stride(1) != experts[0].shape[2]:
        raise SpecconvError(f"{op}: each expert's rows must be contiguous (strides {experts[0].stride()})")
    pairs = chosen.shape[0]
    out = torch.empty(len(experts), pairs, n_out, dtype=result_dtype(qtype, x.dtype), device=device)
    if pairs:
        _one_pass(x, experts[0], out.view(-1, n_out), qtype, n_out, n_in, device, chosen=chosen.contiguous(),
                  fanout=fanout, second=experts[1] if len(experts) > 1 else None, up=us, act=act)
    return tuple(out.unbind(0))


def _input_rows(op: str, x: torch.Tensor, up: torch.Tensor | None, act: str | None,
                n_in: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x as [rows, n_in], up likewise or None), checked: `up` and `act` come together (a GLU input)."""
    if (up is None) != (act is None):
        raise SpecconvError(f"{op}: a GLU input needs both up and act (got up={up is not None}, act={act!r})")
    if up is not None:
        return activation.glu_rows(op, x, up, act)
    xs = x.reshape(-1, n_in)
    _common.check_last_contiguous(op, "x", xs)
    return xs, None


def _one_pass(xs: torch.Tensor, packed: torch.Tensor, ys: torch.Tensor, qtype: QType, n_out: int, n_in: int,
              device: torch.device, chosen: torch.Tensor | None = None, fanout: int = 1,
              second: torch.Tensor | None = None, up: torch.Tensor | None = None, act: str | None = None,
              tail: "NormTail | None" = None) -> bool:
    """ys = xs @ Wᵀ by the one-pass kernel (every row against W; with `chosen`, row r // fanout against
    expert chosen[r] of the 3-D `packed`, and with `second` the same pairs against its experts into
    the second half of ys), cut along the inner dimension per split_plan: one launch, the pieces added
    by the last of each tile's programs to finish (a second launch where no tile counters can be had,
    _common.tile_counters). With `up` (rows like xs'), the rows are act(xs) · up, computed by the
    kernel as it reads them (by a glu launch first where the product takes the tensor-core form).
    With `tail` (no `chosen`), the launch ends with the residual add and RMSNorm of ys
    (fused_rows_kernel TAIL) where counters can be had. Returns whether it did."""
    values, size = GEOMETRY[qtype]
    n_blocks = _common.cdiv(n_in, values)
    rows = ys.shape[0]
    pairs = chosen is not None
    if up is not None and not pairs and uses_dot(qtype, xs.dtype):
        # the tensor-core form pads the rows to 16 and every tile of weight rows would compute the GLU
        # of all 16 again: one glu launch first (its bits are the fused form's)
        xs, up, act = activation.glu(xs, up, act), None, None
    jit = _common.jit_module("_quant_jit")
    form = _form_args(qtype, None if pairs else xs.dtype, 1 if pairs else rows)
    splits, per_split = split_plan(qtype, n_out, n_blocks, device, None if pairs else xs.dtype)
    grid = (_common.cdiv(n_out, form["BLOCK_N"]), splits, rows if pairs else 1)
    parts = torch.empty(splits, rows, n_out, dtype=torch.float32, device=device) if splits > 1 else ys
    # the tiles' own counters (cut products), then the launch's (a norm tail)
    slots = grid[0] * grid[2] + (tail is not None)
    counters = _common.tile_counters(device, slots) if splits > 1 or tail is not None else None
    if tail is not None and counters is None:
        tail = None  # the caller's own add_rms_norm launch follows
    glu = up is not None
    h, nw, s, o, pw, scale = (ys,) * 6 if tail is None else (
        tail.h, *(ys if t is None else t for t in (tail.weight, tail.s, tail.o, tail.first, tail.scale)))
    norm_block, norm_blocks = (1, 1) if tail is None else norm.row_block(n_out)
    sandwich = tail is not None and tail.first is not None
    jit.fused_rows_kernel[grid](xs, up if glu else xs, packed, packed if second is None else second, ys, parts,
                                ys if counters is None else counters, chosen if pairs else xs, h, nw, s, o, pw, scale,
                                n_out, n_in, n_blocks, per_split, rows, xs.stride(0), up.stride(0) if glu else 0,
                                packed.stride(-2), packed.stride(0) if pairs else 0, ys.stride(0), float(n_out),
                                0.0 if tail is None else float(tail.eps),
                                QTYPE=int(qtype), VALUES=values, BYTES=size, ROWS=1 if pairs else rows,
                                PARTIAL=splits > 1, LAST_ADDS=counters is not None,
                                PAIRS=pairs, FANOUT=fanout, MATRICES=1 if second is None else 2,
                                ACT=activation.GLU[act] if glu else activation.NO_ACTIVATION, TAIL=tail is not None,
                                NORM_BLOCK=norm_block, NORM_CHUNKS=norm_blocks, SANDWICH=sandwich,
                                OUT_SCALE=sandwich and tail.scale is not None,
                                NORM_OUT=tail is not None and tail.weight is not None,
                                num_warps=FUSED_WARPS, enable_fp_fusion=FUSED_FMA, **form)
    if splits > 1 and counters is None:
        jit.sum_parts_kernel[(_common.cdiv(rows * n_out, SUM_BLOCK),)](parts, ys, rows, n_out, splits,
                                                                       ys.stride(0), BLOCK=SUM_BLOCK)
    return tail is not None


def split_plan(qtype: QType, n_out: int, n_blocks: int, device: torch.device,
               x_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(pieces, blocks per piece) along W's inner dimension for the one-pass kernel: enough programs
    for PROGRAMS_PER_SM on every multiprocessor, each piece a whole number of kernel steps (of the
    form `tile_shape` gives rows in `x_dtype`). Depends on W's shape, the rows' dtype and the device
    only, never on the number of activation rows (a row's sums must not depend on its batch)."""
    block_n, step = tile_shape(qtype, x_dtype)
    wanted = PROGRAMS_PER_SM * _common.multiprocessors(device)
    splits = max(1, min(_common.cdiv(wanted, _common.cdiv(n_out, block_n)), _common.cdiv(n_blocks, step)))
    per_split = _common.cdiv(_common.cdiv(n_blocks, splits), step) * step
    return _common.cdiv(n_blocks, per_split), per_split
