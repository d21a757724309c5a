"""Measuring a mix with the runtime: the lossless reference model, its scores on the calibration text,
and the KL divergence (or the MTP head's acceptance) when some tensors take other types.

The reference GGUF (the checkpoint converted at its own precision) is loaded once. Its
log-probabilities at the scored positions of each calibration chunk go to specconv/compare's compact
store and are scored as `specconv compare` scores them (llama-perplexity's chunks: the second half of
each chunk, docs/compare.md §2-§4). A mix is measured by encoding the reference's values of the
tensors it changes with the converter's encoders (convert/kernels.py; with `--imatrix`, the weighted
ones of convert/imatrix.py), so each tensor holds the bytes the written file will hold, and putting
them in the loaded model in place of the reference's for the time of the measurement: the model then
computes what the written file computes, without a file per option.

The MTP head is judged by its acceptance, teacher-forced along the same chunks on the reference trunk
(specconv/compare/mtp_acceptance.py): the reference trunk's hidden states and greedy tokens are kept
from its one pass, so only the head runs for each of its options.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType

from specconv.compare import mtp_acceptance
from specconv.compare.chunks import Chunks
from specconv.compare.scoring import RowScores, score_rows
from specconv.compare.store import LogProbStore
from specconv.compare.trunks import GgufTrunk
from specconv.runtime.dequant import row_bytes
from specconv.runtime.spec_stats import SpecStats
from specconv.runtime.stored import StoredWeight
from specconv.threads import set_threads

from .imatrix import encode_weighted_run
from .kernels import encode_run
from .quant_rules import IQ4_TYPES

MTP_ROUNDS = 1024  # draft rounds an acceptance measurement aims at (a head step is a large part of a forward)



def encode_tensor(values: np.ndarray, ggml_type: GGMLQuantizationType, weights: np.ndarray | None) -> np.ndarray:
    """float32 values (torch order) -> the bytes the converter writes for them at `ggml_type`."""
    if weights is not None or ggml_type in IQ4_TYPES:
        return encode_weighted_run(values, ggml_type, weights, values.shape[-1],
                                   values.shape[-2] if values.ndim >= 2 else 1, 0)
    return encode_run(np.ascontiguousarray(values, dtype=np.float32), ggml_type)


@dataclass
class MixScore:
    kld: float  # mean KL divergence from the reference over the scored positions
    kld_error: float  # llama.cpp's uncertainty of that mean
    same_top: float  # share of positions with the reference's argmax
    ln_ppl_ratio: float


def _score(scores: RowScores) -> MixScore:
    n = len(scores.kld)
    err = float(np.std(scores.kld) / np.sqrt(n - 1)) if n > 1 else 0.0
    return MixScore(float(scores.kld.mean()), err, float(scores.same_top.mean()),
                    float(scores.nll.mean() - scores.nll_base.mean()))


class Calibration:
    """The reference model and the calibration `text` in chunks of `ctx` tokens (all chunks, or the first
    `n_chunks`); `folder` holds the compact store. `score_reference` runs the reference once."""

    def __init__(self, reference: Path, text: str, ctx: int, n_chunks: int | None, folder: Path, draft_max: int,
                 weights_for: Callable[[str, tuple[int, ...], GGMLQuantizationType], np.ndarray | None],
                 device: str = "cpu", tick=None):
        self.tick = tick or (lambda *a, **k: None)
        self.trunk = GgufTrunk(reference, ctx, device, None)
        self.model = self.trunk.model
        set_threads(self.model)  # torch's threads by the model's matrices and the idle cores (specconv/threads.py)
        self.weights_for = weights_for
        tok = self.model.tokenizer
        bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
        self.chunks = Chunks.plan(tok.encode(text), ctx, bos, n_chunks)
        self.folder = folder
        self.k = draft_max
        self.has_head = self.trunk.head is not None and draft_max > 0
        self.store = self.reference_acceptance = None
        self.rows, self.hidden, self.greedy = [], [], []

    def score_reference(self) -> None:
        """The reference's rows into the store, and (with a head) its hidden states, greedy tokens and
        its head's acceptance."""
        c = self.chunks
        self.store = LogProbStore(c.n_chunks * c.scored, self.model.vocab_size, self.folder)
        want = mtp_acceptance.wanted_hidden([self._drafter()]) if self.has_head else ()
        for i in range(c.n_chunks):
            out = self._run(i, want)
            self.rows.append(self.store.append(out.logits[:c.scored], c.targets(i)))
            if self.has_head:
                self.hidden.append(out.hidden)
                self.greedy.append(out.logits.argmax(dim=-1).cpu().numpy())
            self.tick(advance=1)
        self.reference_acceptance = self.acceptance() if self.has_head else None

    @property
    def positions(self) -> int:
        return self.chunks.n_chunks * self.chunks.scored

    def _run(self, i: int, hidden: tuple[str, ...] = ()):
        return self.trunk.run(self.chunks.ids(i), self.chunks.first, hidden)

    def _drafter(self):
        return mtp_acceptance.head_drafter(self.trunk.head, self.chunks.ctx + self.k + 1, self.model)

    # ---- measurements ---------------------------------------------------------------------------
    def kld(self) -> MixScore:
        """The loaded model (with whatever is swapped in) against the reference's store."""
        c = self.chunks
        parts = []
        for i in range(c.n_chunks):
            out = self._run(i)
            parts.append(score_rows(self.rows[i], out.logits[:c.scored], c.targets(i)))
            self.tick(advance=1)
        return _score(RowScores.concat(parts))

    @property
    def mtp_stride(self) -> int:
        """Rounds at every stride-th position: about MTP_ROUNDS rounds per measurement at most."""
        c = self.chunks
        return max(1, c.n_chunks * (c.ctx - self.k + 1 - c.first) // MTP_ROUNDS)

    def acceptance(self) -> SpecStats:
        """The head's acceptance by draft position, teacher-forced on the reference trunk."""
        c = self.chunks
        stats = SpecStats(self.k)
        drafter = self._drafter()
        for i in range(c.n_chunks):
            mtp_acceptance.teacher_forced(drafter, c.ids(i), self.hidden[i], self.greedy[i], c.first, self.k, stats,
                                          self.mtp_stride)
        self.tick(advance=c.n_chunks)
        return stats

    @contextlib.contextmanager
    def swapped(self, types: Mapping[str, GGMLQuantizationType]):
        """The model with these tensors encoded at these types (the reference's elsewhere)."""
        weights = self.model.weights
        saved = {}
        try:
            for name, ggml_type in types.items():
                if name not in weights:  # a tensor no graph of this file reads
                    continue
                old = weights[name]
                saved[name] = old
                weights[name] = self._encoded(name, old, ggml_type)
            yield self
        finally:
            weights.update(saved)

    def _encoded(self, name: str, old: StoredWeight, ggml_type: GGMLQuantizationType) -> StoredWeight:
        shape = tuple(int(d) for d in old.shape)
        values = old.dense(torch.float32).cpu().numpy()
        data = encode_tensor(values, ggml_type, self.weights_for(name, shape, ggml_type))
        raw = torch.from_numpy(data).reshape(*shape[:-1], row_bytes(ggml_type, shape[-1]))
        return StoredWeight(raw.to(old.raw.device), ggml_type, shape, old.dtype, old.device, old.counter)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.trunk.close()
        self.model = None
