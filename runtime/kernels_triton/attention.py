"""Causal attention over a layer's whole fixed-size K/V buffer, and the write of a batch's K/V into it,
in one Triton launch each (a prompt of many rows over a long buffer: a few, below).

    attention(q, k, v, q_pos, k_pos, scale, gate=None, window=0, sinks=None, keep=None, q_rest=None)
                                              -> o [n, heads, dv] in q's dtype
    write_kv(k_cache, v_cache, cells, k, v)   k_cache[cells] = k, v_cache[cells] = v, in place

q [n, heads, dk]; k [cells, kv_heads, dk], v [cells, kv_heads, dv]: the layer's buffers
(runtime/memory.py `Batch.attend_kv(..., whole=True)`), float32 / bfloat16 / float16, the last
dimension contiguous, the others read through their strides; k_pos [cells] the position of every
cell (memory.UNWRITTEN where none was written), q_pos [n] the query rows' positions (integer
tensors on the same device, never read on the host). Query head j reads KV head j // (heads /
kv_heads). Cell c is visible to row r iff 0 ≤ q_pos[r] − k_pos[c], and with a `window` > 0 also
q_pos[r] − k_pos[c] < window (sliding-window layers); o[r] = softmax((q·kᵀ)·scale) v over the
visible cells, the formula of runtime/graphs/ops.py `causal_attention` / `windowed_attention`, in
float32. `sinks` [heads] (float32, contiguous): one more logit per head, in the softmax's max and
denominator, whose probability mass is dropped (attention sinks). With a per-head `gate` [n, heads]
(Step-3.5): o rounded into q's dtype times sigmoid(gate) in float32, one rounding out. With `gate`
[n, heads, dv]: o rounded into q's dtype, times sigmoid(gate) rounded into q's dtype (Qwen3.5's
gated attention: o · sigmoid(gate)), one rounding out. `keep` [n, cells] (bool or uint8, the last
dimension contiguous): cell c is visible to row r only where keep[r, c] too (DeepSeek Sparse
Attention's chosen keys).

Multi-head latent attention (runtime/graphs/deepseek2.py): V a view of K's first dv entries (the
latent c of each cell `[c | rope(k_pe)]`, one buffer) is recognised (same storage, offset and
strides, dv < dk) and each cell is read once: its first dv entries give the score's first part and
the value, the other dk − dv (up to MAX_HEAD_DIM each: 512 + 64 in DeepSeek-V3, Kimi K2, GLM-5) the
score's second part. `q_rest` [n, heads, dk − dv]: the query's last dk − dv entries as a tensor of
their own (the roped q_pe, in any float dtype: widened as it is read), q then holding its first dv
(q_lat): no concatenation first.

The grid (_attention_jit.py) is (rows, pieces, KV heads · head tiles): one program per query row,
piece of the cells, and KV head with a tile of the query heads sharing it (the `group` = heads /
kv_heads heads padded to a power of two, at most MAX_HEAD_TILE: Qwen3.5-27B's 6 in one tile of 8,
MLA's 128 in 8 tiles of 16). Each block of BLOCK_T cells (a size fixed by the head dimension,
`block_cells`) is loaded once for the whole tile, so a K/V cell is read once per (row, KV head,
head tile), not once per query head. The piece rule (`cell_pieces`): a buffer of `cells` cells
(blocks = ⌈cells / BLOCK_T⌉) is cut into P = min(multiprocessors // (KV heads · tiles),
cells // MIN_PIECE_CELLS), at least 1, pieces of ⌈blocks / P⌉ whole blocks each (the last one the
rest) — a function of the buffer's size, the layer's shape and the device, never of the number of
rows, and the same at every step of a context (one shape for a CUDA-graph capture). With one piece
a program writes its rows' output; with several each writes its running max, denominator and
float32 value sums, and the program that finishes last (a counter per row and tile) combines them in
piece order 0, 1, 2, ... in the same launch. Every row's sums thus run in the same order whatever the
batch: a row gives the same bits alone or in a batch of any width. Nothing is read on the host.
Several pieces need float32 partial sums (heads · pieces · dv a row): a prompt beyond
WORKSPACE_VALUES of them takes several launches of whole rows, with the same bits.

write_kv: k, v [n, kv_heads, d] into the caches [cells, kv_heads, d] of the same dtype at the cells
`cells` [n] (an int64 tensor on the device, never read on the host; the caller's cells are in
range: runtime/memory.py reserves them), both in one launch where two index_copy_ take two.
"""

from __future__ import annotations

import torch

from specconv.archs.errors import SpecconvError
from specconv.runtime.kernels_triton import _common

MAX_HEAD_DIM = 512  # one program holds a head's query and output; wider heads take the torch reference
# (a latent K cell, V in K, is two pieces of up to MAX_HEAD_DIM: the value and the rest)
TILE = 8192  # values of one block of K (or V) cells a program holds: BLOCK_T · the padded head width
MAX_HEAD_TILE = 16  # query heads a program holds: [16, 512] float32 value sums are 32 registers a thread at 8 warps
MIN_PIECE_CELLS = 256  # a piece of the cells reads at least this many (its partial sums are small beside them)
WORKSPACE_VALUES = 1 << 24  # float32 partial sums one launch may write (64 MiB)


def block_cells(head_dim: int) -> int:
    """Cells per block of the online softmax for heads of `head_dim` (at least 16)."""
    return max(16, min(64, TILE // _common.next_power_of_2(head_dim)))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              scale: float, gate: torch.Tensor | None = None, window: int = 0,
              sinks: torch.Tensor | None = None, keep: torch.Tensor | None = None,
              q_rest: torch.Tensor | None = None) -> torch.Tensor:
    op = "attention"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise SpecconvError(f"{op}: expected q [n, heads, dk], k [cells, kv_heads, dk], v [cells, kv_heads, dv] "
                            f"(got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})")
    n, heads = q.shape[:2]
    cells, kv_heads, dv = v.shape
    dk = k.shape[-1]
    v_in_k = values_in_keys(k, v)
    if q_rest is not None:
        if not v_in_k:
            raise SpecconvError(f"{op}: q_rest (the query in two pieces) needs V as the first entries of K")
        _common.check_shape(op, "q_rest", q_rest, (n, heads, dk - dv))
    _common.check_shape(op, "q", q, (n, heads, dk if q_rest is None else dv))
    _common.check_shape(op, "k", k, (cells, kv_heads, dk))
    if kv_heads == 0 or heads % kv_heads:
        raise SpecconvError(f"{op}: {heads} query heads do not share {kv_heads} KV heads evenly")
    widths = (dv, dk - dv) if v_in_k else (dk, dv)
    if max(widths) > MAX_HEAD_DIM or min(dk, dv) == 0:
        raise SpecconvError(f"{op}: head dimensions {dk}, {dv} (1 to {MAX_HEAD_DIM}"
                            + (f"; V in K: {MAX_HEAD_DIM} + {MAX_HEAD_DIM})" if v_in_k else ")"))
    q_rest = q[..., dv:] if v_in_k and q_rest is None else q_rest
    named = [("q", q), ("k", k), ("v", v)] + ([("q_rest", q_rest)] if v_in_k else [])
    for name, t in named:
        _common.check_float(op, name, t)
        _common.check_last_contiguous(op, name, t)
    _common.check_shape(op, "q_pos", q_pos, (n,))
    _common.check_shape(op, "k_pos", k_pos, (cells,))
    for name, t in (("q_pos", q_pos), ("k_pos", k_pos)):
        if t.dtype not in (torch.int32, torch.int64) or (t.numel() > 1 and t.stride(0) != 1):
            raise SpecconvError(f"{op}: {name} must be a contiguous int32 or int64 vector (got {t.dtype})")
    tensors = [q, k, v, q_pos, k_pos]
    if gate is not None:
        _common.check_shape(op, "gate", gate, (n, heads, dv)[:max(gate.dim(), 2)])
        _common.check_float(op, "gate", gate)
        _common.check_last_contiguous(op, "gate", gate)
        tensors.append(gate)
    if window < 0:
        raise SpecconvError(f"{op}: window must be 0 (none) or positive (got {window})")
    if sinks is not None:
        _common.check_shape(op, "sinks", sinks, (heads,))
        if sinks.dtype != torch.float32 or (heads > 1 and sinks.stride(0) != 1):
            raise SpecconvError(f"{op}: sinks must be a contiguous float32 vector (got {sinks.dtype})")
        tensors.append(sinks)
    if keep is not None:
        _common.check_shape(op, "keep", keep, (n, cells))
        if keep.dtype not in (torch.bool, torch.uint8) or (cells > 1 and keep.stride(1) != 1):
            raise SpecconvError(f"{op}: keep must be a bool or uint8 [n, cells] mask, its rows contiguous "
                                f"(got {keep.dtype})")
        tensors.append(keep)
    if q_rest is not None:
        tensors.append(q_rest)
    device = _common.check_device(op, *tensors)
    o = torch.empty(n, heads, dv, dtype=q.dtype, device=device)
    if n * heads == 0:
        return o
    z = q if gate is None else gate
    qr = q if q_rest is None else q_rest
    mask = q_pos if keep is None else (keep.view(torch.uint8) if keep.dtype == torch.bool else keep)
    jit = _common.jit_module("_attention_jit")
    group = heads // kv_heads
    # the head widths are tl.dot's inner dimensions (q·kᵀ; with V in K, q·vᵀ and the rest)
    block_dk, block_dv = _common.dot_width(dk), _common.dot_width(dv)
    block_dr = _common.dot_width(dk - dv) if v_in_k else 1
    widest = max(block_dv, block_dr) if v_in_k else max(block_dk, block_dv)
    tile = head_tile(group)
    tiles = _common.cdiv(group, tile)
    block = block_cells(max(dk, dv))
    pieces, piece_cells = cell_pieces(cells, block, kv_heads * tiles, device)
    split = pieces > 1
    rows = rows_per_launch(heads, pieces, dv) if split else n
    for first in range(0, n, rows):  # rows run alone: launches of `rows` rows give each row its bits
        last = min(n, first + rows)
        if split:
            part_m, part_l = (torch.empty((last - first) * heads * pieces, dtype=torch.float32, device=device)
                              for _ in range(2))
            part_acc = torch.empty((last - first) * heads * pieces, dv, dtype=torch.float32, device=device)
            counts = piece_counters(device, (last - first) * kv_heads * tiles)
        else:
            part_m = part_l = part_acc = counts = o  # unused
        per_row = (t[first:] if first else t for t in (q, qr, q_pos, mask, z, o))  # this launch's rows
        row_q, row_qr, row_qpos, row_mask, row_z, row_o = per_row
        jit.attention_kernel[(last - first, pieces, kv_heads * tiles)](
            row_q, row_qr, k, v, k_pos, row_qpos, row_mask, row_z, q if sinks is None else sinks, row_o, part_m, part_l,
            part_acc, counts, cells, piece_cells, heads, group, dk, dv, float(scale), int(window), q.stride(0),
            q.stride(1), qr.stride(0), qr.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            mask.stride(0), z.stride(0), z.stride(1),
            HAS_GATE=gate is not None, GATE_PER_HEAD=gate is not None and gate.dim() == 2, HAS_WINDOW=window > 0,
            HAS_SINKS=sinks is not None, HAS_KEEP=keep is not None, V_IN_K=v_in_k, SPLIT=split, BLOCK_T=block,
            BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_DR=block_dr, HEAD_TILE=tile,
            num_warps=4 if tile * widest <= 2048 else 8, enable_fp_fusion=False)
    return o


def head_tile(group: int) -> int:
    """Query heads per program: the `group` heads sharing a KV head, padded to a power of two, at most
    MAX_HEAD_TILE (MLA's 128 heads of one latent cell: tiles of 16)."""
    return min(_common.next_power_of_2(group), MAX_HEAD_TILE)


def cell_pieces(cells: int, block: int, programs_per_piece: int, device: torch.device) -> tuple[int, int]:
    """(pieces, cells per piece) of a buffer of `cells` cells in blocks of `block`: as many pieces as
    fill the device's multiprocessors with the row's programs (`programs_per_piece`: KV heads ·
    head tiles), each of at least MIN_PIECE_CELLS cells, each a whole number of blocks (the last one
    the rest). Never a function of the number of rows, and fixed for a buffer."""
    blocks = max(1, _common.cdiv(cells, block))
    want = max(1, min(_common.multiprocessors(device) // programs_per_piece, cells // MIN_PIECE_CELLS))
    per = _common.cdiv(blocks, want)
    return _common.cdiv(blocks, per), per * block


def rows_per_launch(heads: int, pieces: int, dv: int) -> int:
    """Rows per launch with several pieces: their partial sums (float32, heads · pieces · dv a row) at
    most WORKSPACE_VALUES (a prompt of thousands of rows takes several launches)."""
    return max(1, WORKSPACE_VALUES // (heads * pieces * dv))


def piece_counters(device: torch.device, count: int) -> torch.Tensor:
    """`count` int32 zeros on `device` (_common.tile_counters: the buffer the cut products' tiles use
    too; each launch leaves its counters zero again), made or grown outside CUDA-graph capture (a
    graph's warm-up call makes them): inside one, too few is an error, not a second launch."""
    counters = _common.tile_counters(device, count)
    if counters is None:
        raise SpecconvError(f"attention: {count} piece counters needed inside a CUDA-graph capture; "
                            f"run the forward once before capturing it")
    return counters


def values_in_keys(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether V is K's first v.shape[-1] entries in memory (multi-head latent attention's one buffer):
    the same storage, offset and strides. Storage identity, not view tracking: views of tensors made
    under torch.inference_mode (a context's caches made there) record no base, and meta tensors have
    no addresses."""
    return (v.shape[-1] < k.shape[-1] and v.shape[:-1] == k.shape[:-1] and v.dtype == k.dtype
            and v.stride() == k.stride() and v.storage_offset() == k.storage_offset()
            and v.untyped_storage()._cdata == k.untyped_storage()._cdata)


def check_stored_rows(op: str, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> None:
    """k and v float rows of their caches' dtypes, the last dimension of each contiguous (write_kv's and
    rope.rope_qk_store's stores copy bits)."""
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        _common.check_float(op, name, t)
        if t.dtype != cache.dtype:
            raise SpecconvError(f"{op}: {name} is {t.dtype}, its cache {cache.dtype}")
        _common.check_last_contiguous(op, name, t)
        _common.check_last_contiguous(op, f"{name}_cache", cache)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    op = "write_kv"
    if k_cache.dim() != 3 or v_cache.dim() != 3:
        raise SpecconvError(f"{op}: expected caches [cells, kv_heads, d] (got {tuple(k_cache.shape)}, "
                            f"{tuple(v_cache.shape)})")
    if cells.dim() != 1:
        raise SpecconvError(f"{op}: cells must be a vector (got shape {tuple(cells.shape)})")
    n = cells.shape[0]
    _common.check_shape(op, "k", k, (n, *k_cache.shape[1:]))
    _common.check_shape(op, "v", v, (n, *v_cache.shape[1:]))
    if cells.dtype != torch.int64 or (n > 1 and cells.stride(0) != 1):
        raise SpecconvError(f"{op}: cells must be a contiguous int64 vector (got {cells.dtype})")
    check_stored_rows(op, k, v, k_cache, v_cache)
    _common.check_device(op, k_cache, v_cache, cells, k, v)
    kv_heads, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    if n * kv_heads == 0:
        return
    jit = _common.jit_module("_attention_jit")
    jit.write_kv_kernel[(n * kv_heads,)](k, v, cells, k_cache, v_cache, kv_heads, dk, dv, k.stride(0), k.stride(1),
                                         v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
                                         v_cache.stride(0), v_cache.stride(1),
                                         BLOCK_DK=_common.next_power_of_2(dk), BLOCK_DV=_common.next_power_of_2(dv),
                                         num_warps=1)
