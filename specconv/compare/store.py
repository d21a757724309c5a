"""The source's per-position log-probabilities, kept compact while the quants run (docs/compare.md §4).

One row per scored position: the log-probabilities of the whole vocabulary as 16-bit codes (llama.cpp's
`--kl-divergence-base` layout: a float32 step and offset per row, value = step·code + offset), plus the
row's exact target log-probability and argmax (so PPL(base), Δp and Same top p stay exact, and only
the KL divergence carries the store's error). Two choices differ from llama.cpp's file and make the
error small and provable:

* the codes cover RANGE = 32 nats below the row's maximum logit (llama.cpp: 16), so the tokens left
  out (clamped below the range) hold at most |D|·e^offset ≤ V·e^-32 of the mass, ~1e-9 for any vocabulary;
* the KL divergence is taken from the reconstructed distribution renormalised over the coded tokens,
  so a code's rounding moves the estimate by (step)·|log p − log q − KLD| rather than (step)·(1 + …).

The bound, per row, of |KLD_store − KLD_exact| (derivation in docs/compare.md §4), with δ = step/2 plus
the float32 rounding of the offset, ε = e^{2δ} − 1, p̂ the renormalised reconstruction over the coded
set C, b the quant's log-probabilities, K̂ the estimate, π = |D|·e^{offset} the mass bound of the clamped set D:

    ε·e^{2δ}·(Σ_C p̂·|log p̂ − b − K̂| + 2δ) + ε²            (the rounding of the codes)
    + π·(|K̂| + first term) + π + π·ln(|D|/π) + π·max_D |b|   (the clamped tokens; 0 when none)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

RANGE = 32.0  # nats below a row's maximum logit covered by its codes
LEVELS = 65535  # uint16 codes 0..65535
BLOCK_ROWS = 8  # rows processed at once: bounds the float64 temporaries to a few × 8 × vocabulary
_F32_REL = 2.0 ** -23  # a float32 rounding, with a factor two of margin (2^-24 is the half-ulp)


def encode(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of logits -> (uint16 codes [n, V], float32 step [n], float32 offset [n]).

    The offset is the log-probability of the lowest coded logit, min_l = max(min logit, max − RANGE);
    a logit below min_l gets code 0 (clamped: reconstructed at the offset)."""
    x = logits.detach().to(torch.float64)
    top = x.max(dim=-1, keepdim=True).values
    low = torch.maximum(x.min(dim=-1, keepdim=True).values, top - RANGE)
    lse = torch.logsumexp(x - top, dim=-1, keepdim=True)
    step = ((top - low) / LEVELS).to(torch.float32)
    offset = (low - top - lse).to(torch.float32)
    inv = torch.where(step > 0, 1.0 / step.to(torch.float64), torch.zeros_like(top))
    codes = torch.clamp(torch.round((x - low) * inv), 0, LEVELS)
    codes = torch.where(x > low, codes, torch.zeros_like(codes))
    return (codes.to(torch.int32).cpu().numpy().astype(np.uint16), step.reshape(-1).cpu().numpy(),
            offset.reshape(-1).cpu().numpy())


def decode(codes: np.ndarray, step: np.ndarray, offset: np.ndarray) -> torch.Tensor:
    """The reconstructed log-probabilities (float64): step·code + offset."""
    c = torch.from_numpy(np.asarray(codes, dtype=np.int32)).to(torch.float64)
    s = torch.from_numpy(np.asarray(step, dtype=np.float32)).to(torch.float64)[:, None]
    o = torch.from_numpy(np.asarray(offset, dtype=np.float32)).to(torch.float64)[:, None]
    return c * s + o


def kld_and_bound(codes: np.ndarray, step: np.ndarray, offset: np.ndarray, quant_logprobs: torch.Tensor):
    """(estimate, bound) per row: the KL divergence of the stored rows from the quant's log-probabilities
    `quant_logprobs` [n, V] (float64), and the bound on |estimate − exact| (module docstring)."""
    b = quant_logprobs.to(torch.float64).cpu()
    a_hat = decode(codes, step, offset)
    off = torch.from_numpy(np.asarray(offset, dtype=np.float32)).to(torch.float64)
    delta = torch.from_numpy(np.asarray(step, dtype=np.float32)).to(torch.float64) / 2 + off.abs() * _F32_REL + 1e-12
    clamped = _clamped(codes, step)
    coded = ~clamped
    la = torch.where(coded, a_hat, torch.full_like(a_hat, -math.inf))
    log_p = la - torch.logsumexp(la, dim=-1, keepdim=True)  # renormalised over the coded tokens
    p = log_p.exp()
    diff = torch.where(coded, log_p - b, torch.zeros_like(b))
    est = (p * diff).sum(-1)
    eps = torch.expm1(2 * delta)
    first = eps * torch.exp(2 * delta) * ((p * (diff - est[:, None]).abs()).sum(-1) + 2 * delta) + eps * eps
    n_clamped = clamped.sum(-1).to(torch.float64)
    pi = n_clamped * torch.exp(off + delta)
    b_max = torch.where(clamped, b.abs(), torch.zeros_like(b)).max(-1).values
    tail = pi * (est.abs() + first) + pi + pi * torch.log(torch.clamp(n_clamped, min=1) / torch.clamp(pi, min=1e-300)
                                                         ).clamp(min=0) + pi * b_max
    bound = first + torch.where(n_clamped > 0, tail, torch.zeros_like(tail))
    return est.numpy(), bound.numpy()


def _clamped(codes: np.ndarray, step: np.ndarray) -> torch.Tensor:
    """The set D: code 0 in a row whose range was cut at max − RANGE (tokens below the range, and those
    within half a step above it: each holds at most e^{offset+δ}). In a row whose whole span fits the
    range, code 0 means within half a step of the minimum logit, which the offset codes."""
    cut = np.asarray(step, dtype=np.float64) * LEVELS >= RANGE * (1 - 1e-6)
    zero = np.asarray(codes) == 0
    return torch.from_numpy(zero & cut[:, None])


@dataclass
class StoredRows:
    """Rows [start, stop) of a store, as the scoring reads a base (the same calls as ExactRows)."""

    store: "LogProbStore"
    start: int
    stop: int

    @property
    def target_logprob(self) -> np.ndarray:
        return self.store.target_logprob[self.start:self.stop]

    @property
    def argmax(self) -> np.ndarray:
        return self.store.argmax[self.start:self.stop]

    def kld(self, i0: int, i1: int, quant_logprobs: torch.Tensor):
        s = self.store
        r0, r1 = self.start + i0, self.start + i1
        return kld_and_bound(s.codes.read(r0, r1), s.step[r0:r1], s.offset[r0:r1], quant_logprobs)


class DiskRows:
    """Rows of a fixed shape in a file, written and read with plain file I/O: unlike a memory map, the
    rows on disk never count in the process's resident memory, only the ones being read."""

    def __init__(self, path: Path, dtype, row_shape: tuple[int, ...]):
        self.path, self.dtype, self.row_shape = Path(path), np.dtype(dtype), tuple(row_shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape))
        self._file = open(self.path, "w+b")

    def write(self, start: int, rows: np.ndarray) -> None:
        self._file.seek(start * self.row_bytes)
        self._file.write(np.ascontiguousarray(rows, dtype=self.dtype).tobytes())

    def read(self, start: int, stop: int) -> np.ndarray:
        self._file.seek(start * self.row_bytes)
        data = np.fromfile(self._file, dtype=self.dtype, count=(stop - start) * self.row_bytes // self.dtype.itemsize)
        return data.reshape((stop - start, *self.row_shape))

    def close(self) -> None:
        self._file.close()


class _MemoryRows:
    """DiskRows' calls over an array in memory."""

    def __init__(self, dtype, n_rows: int, row_shape: tuple[int, ...]):
        self.rows = np.zeros((n_rows, *row_shape), dtype=dtype)

    def write(self, start: int, rows: np.ndarray) -> None:
        self.rows[start:start + len(rows)] = rows

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.rows[start:stop]

    def close(self) -> None:
        pass


class LogProbStore:
    """`n_rows` rows of a `n_vocab` vocabulary; the codes go to a file in `folder` when given (DiskRows),
    else stay in memory."""

    def __init__(self, n_rows: int, vocab_size: int, folder: Path | None = None):
        self.codes = (DiskRows(Path(folder) / "source-logprobs.u16", np.uint16, (vocab_size,)) if folder is not None
                      else _MemoryRows(np.uint16, n_rows, (vocab_size,)))
        self.step = np.zeros(n_rows, dtype=np.float32)
        self.offset = np.zeros(n_rows, dtype=np.float32)
        self.target_logprob = np.zeros(n_rows, dtype=np.float64)
        self.argmax = np.zeros(n_rows, dtype=np.int64)
        self.n_rows, self.vocab_size, self.filled = n_rows, vocab_size, 0

    @property
    def nbytes(self) -> int:
        return int(self.n_rows * (2 * self.vocab_size + 4 + 4 + 8 + 8))

    def append(self, logits: torch.Tensor, targets) -> StoredRows:
        """Store the rows of `logits` [n, V] whose next tokens are `targets` [n]; returns them as rows."""
        n = logits.shape[0]
        start = self.filled
        if start + n > self.n_rows:
            raise ValueError(f"store of {self.n_rows} rows is full")
        targets = torch.as_tensor(targets, dtype=torch.long, device=logits.device)
        for i0 in range(0, n, BLOCK_ROWS):
            block = logits[i0:i0 + BLOCK_ROWS]
            r0, r1 = start + i0, start + i0 + block.shape[0]
            codes, self.step[r0:r1], self.offset[r0:r1] = encode(block)
            self.codes.write(r0, codes)
            lp = torch.log_softmax(block.to(torch.float64), dim=-1)
            self.target_logprob[r0:r1] = lp.gather(-1, targets[i0:i0 + BLOCK_ROWS, None])[:, 0].cpu().numpy()
            self.argmax[r0:r1] = block.argmax(dim=-1).cpu().numpy()
        self.filled += n
        return StoredRows(self, start, start + n)

    def close(self) -> None:
        self.codes.close()
