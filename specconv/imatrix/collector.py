"""The importance-matrix collector: an activation observer of the runtime (runtime/backend.py
`observing`) that sums, per weight matrix and per input column, the squares of the rows the matrix
multiplies — what llama-imatrix's callback accumulates (docs/imatrix.md §1):

* a product by a 2-D weight W (ops.linear): sums[W][0, j] += Σ_rows x[row, j]², count[W][0] += rows;
* a routed expert e of a 3-D expert tensor (ops.moe announces each expert's slices): the rows routed
  to e, into sums[W][e] and count[W][e] — one count per (token, expert) pair, as MUL_MAT_ID counts.

Which weights: those named `blk.*` (every block matrix, routers and shared-expert gates included),
and `output.weight` only when asked (llama-imatrix's --process-output). The token embedding is a
row lookup, never a product; a tied output head multiplies by `token_embd.weight`, which llama-imatrix
never records. A weight is known by identity (the model's weights dict, or a view of one); a product
by a tensor the graph computed from a weight has no GGUF name and is counted in `unnamed`, not
recorded.

Squares are summed in float64 (llama-imatrix adds float32 squares into float32 sums).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from specconv.errors import SpecconvError

OUTPUT = "output.weight"


def recorded(name: str, process_output: bool) -> bool:
    """Whether llama-imatrix records products by the weight named `name`."""
    return name.startswith("blk.") or (process_output and name == OUTPUT)


class ImatrixCollector:
    """Sums of squared input activations per weight (the observer protocol of runtime/backend.py)."""

    def __init__(self, weights: Mapping[str, Any], process_output: bool = False):
        # the model's weights by identity (the objects ops.linear / ops.moe are handed)
        self._names = {id(w): name for name, w in weights.items()}
        self._process_output = process_output
        self._keep = list(weights.values())  # ids stay valid while the collector lives
        self._slices: dict[int, tuple[str, int, int]] = {}  # id(expert slice) -> (name, expert, experts)
        self.sums: dict[str, torch.Tensor] = {}  # name -> float64 [experts, row length]
        self.counts: dict[str, torch.Tensor] = {}  # name -> int64 [experts]
        self.unnamed = 0  # products by tensors that are no weight of the model

    # ---- the observer protocol ------------------------------------------------------------------
    def product(self, x: torch.Tensor, w: Any) -> None:
        where = self._slices.get(id(w))
        if where is None:
            name = self._names.get(id(w))
            if name is None and isinstance(w, torch.Tensor) and w._base is not None:
                name = self._names.get(id(w._base))  # a weight reshaped for the product ([H] as [1, H])
            if name is None:
                self.unnamed += 1
                return
            if not recorded(name, self._process_output):
                return
            where = (name, 0, 1)
        name, expert, n_mat = where
        rows = x.reshape(-1, x.shape[-1])
        wide = rows.to(torch.float64)
        sums = self.sums.get(name)
        if sums is None:
            sums = self.sums[name] = torch.zeros(n_mat, rows.shape[1], dtype=torch.float64, device=rows.device)
            self.counts[name] = torch.zeros(n_mat, dtype=torch.int64)
        elif sums.shape != (n_mat, rows.shape[1]):
            raise SpecconvError(f"imatrix: {name} multiplied rows of {rows.shape[1]} after rows of {sums.shape[1]}")
        sums[expert] += (wide * wide).sum(0)
        self.counts[name][expert] += rows.shape[0]

    @contextmanager
    def expert(self, e: int, slices: Sequence[tuple[Any, Any]]) -> Iterator[None]:
        """While an expert's feed-forward runs: (3-D weight, its slice e) pairs, so that a product by
        a slice counts for expert e of that weight."""
        self._slices = {}
        for whole, part in slices:
            name = self._names.get(id(whole))
            if name is not None and recorded(name, self._process_output):
                self._slices[id(part)] = (name, e, int(whole.shape[0]))
        try:
            yield
        finally:
            self._slices = {}

    # ---- results ----------------------------------------------------------------------------------
    def check_finite(self) -> None:
        for name, s in self.sums.items():
            if not bool(torch.isfinite(s).all()):
                raise SpecconvError(f"imatrix: non-finite activations reached {name} (llama-imatrix stops there too)")

    def arrays(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(sums [experts, row] float64, counts [experts] int64) per weight name, as numpy."""
        return ({n: s.cpu().numpy() for n, s in self.sums.items()},
                {n: c.numpy().copy() for n, c in self.counts.items()})
