"""Rows with their values first: the storage type the CUDA backend keeps Q8_0 matrices in (`Q8_0_ROWS`).

A GGUF Q8_0 block is 34 bytes: an f16 scale d, then 32 int8 values. Read on a GPU, a block's values
start 2 bytes past a 16-byte boundary at best, so a kernel loads them 2 bytes at a time. A
rows-first type holds the same bytes of each row in another order: each block's values, block
after block (32 bytes a Q8_0 block), then the blocks' scales. A row whose width is a multiple of
256 values starts every block's values on a 16-byte boundary (its length is a multiple of 16
bytes), and a kernel reads them 16 bytes at a time (docs/benchmarks.md: the tensor-core product
over these bytes at 1.4x its rate over the file's). A type is its file type's block cut into byte
ranges, values first (`parts`): Q6_K (210-byte blocks) would take one more row of the table, but its
tensor-core product measured slower than its per-lane one, which needs no rearranging.

The rearrangement is per row: rows stay whole (an embedding lookup, a slice of rows, still works on
the rearranged bytes) and the tensor keeps its shape and size (no memory beyond the file's). These
are the runtime's own types, never written to a file: `to_ggml_layout` gives the file's bytes back,
and runtime/dequant.py decodes them through it.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

ROW_VALUES_MULTIPLE = 256  # rows this wide or a multiple: every block's values 16-byte aligned
# bytes of rows rearranged at a time on a device: its memory holds the file's bytes plus about twice this
CHUNK_BYTES = 64 << 20


class RowsFirstType:
    """A rows-first storage type: named like a GGUF type (`name`), with the kernels' type number
    (int(), no GGUF type has it), the file type whose bytes it holds and that type's block split
    into its parts (byte ranges), values first."""

    def __init__(self, name: str, value: int, file_type: QType, parts: tuple[tuple[int, int], ...]):
        self.name, self.value, self.file_type, self.parts = name, value, file_type, parts

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"<{self.name}: {self.value}>"


# the kernels' type number: kernels_triton/_quant_jit.py Q8_0_ROWS
Q8_0_ROWS = RowsFirstType("Q8_0_ROWS", 108, QType.Q8_0, ((2, 34), (0, 2)))
ROWS_FIRST = {t.file_type: t for t in (Q8_0_ROWS,)}


def kept_as(qtype, shape: tuple[int, ...]):
    """The rows-first type a weight of `qtype` and torch-order `shape` is kept as, or None: a Q8_0 matrix
    (2-D) whose rows are a multiple of ROW_VALUES_MULTIPLE values wide."""
    if len(shape) == 2 and shape[-1] % ROW_VALUES_MULTIPLE == 0:
        return ROWS_FIRST.get(qtype)
    return None


def file_type(qtype):
    """The GGUF type whose bytes `qtype` holds (itself for a GGUF type)."""
    return qtype.file_type if isinstance(qtype, RowsFirstType) else qtype


def to_rows_layout(raw: torch.Tensor, kind: RowsFirstType) -> torch.Tensor:
    """Rows of kind.file_type, uint8 [..., blocks · size] -> the same rows as `kind` (a new tensor on raw's
    device)."""
    size = GGML_QUANT_SIZES[kind.file_type][1]
    blocks = raw.unflatten(-1, (raw.shape[-1] // size, size))
    return torch.cat([blocks[..., a:b].flatten(-2) for a, b in kind.parts], dim=-1)


def moved_as_rows(raw: torch.Tensor, kind: RowsFirstType, device: torch.device,
                  chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Host rows of kind.file_type (uint8 [..., blocks · size], contiguous) -> the same rows as `kind` on
    `device`. Off the CPU the file's bytes are copied there as they are and rearranged there in place
    (`rearrange_in_place`): a GPU does it at its memory's bandwidth where a host core manages 2–3
    GB/s (benchmarks/rows_first.py; runtime/weights.py loads tens of GB this way), and the device
    never holds a second copy of the matrix. On the CPU, a new tensor (to_rows_layout)."""
    if device.type == "cpu":
        return to_rows_layout(raw, kind)
    return rearrange_in_place(raw.to(device), kind, chunk_bytes)


def rearrange_in_place(raw: torch.Tensor, kind: RowsFirstType, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Rows of kind.file_type (uint8 [..., blocks · size], contiguous and writable) rewritten as `kind`,
    `chunk_bytes` of whole rows at a time (at least one row); returns raw."""
    if not raw.is_contiguous():
        raise ValueError("rearrange_in_place: rows must be contiguous")
    rows = raw.view(-1, raw.shape[-1])
    step = max(1, chunk_bytes // max(1, rows.shape[-1]))
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        part.copy_(to_rows_layout(part, kind))
    return raw


def to_ggml_layout(raw: torch.Tensor, kind: RowsFirstType) -> torch.Tensor:
    """Rows of `kind` -> the GGUF bytes of the same rows (a new tensor on raw's device)."""
    n_blocks = raw.shape[-1] // GGML_QUANT_SIZES[kind.file_type][1]
    pieces, start = {}, 0
    for a, b in kind.parts:
        pieces[a] = raw[..., start:start + n_blocks * (b - a)].unflatten(-1, (n_blocks, b - a))
        start += n_blocks * (b - a)
    return torch.cat([pieces[a] for a in sorted(pieces)], dim=-1).flatten(-2)
