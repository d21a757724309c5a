"""The models compared, run one chunk at a time: a GGUF file through the runtime, or the source's
Hugging Face checkpoint through transformers.

A chunk is evaluated from an empty memory in two batches, as llama-perplexity evaluates it: positions
0..first − 1 without logits, then first..ctx − 1 with logits (rows first..ctx − 2 are scored; the last
row adds the target's greedy token for the draft positions of docs/compare.md §5). The hidden states a
drafter reads come for every position.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch

from specconv.errors import SpecconvError
from specconv.runtime import Context, GraphType, load_model


@dataclass
class ChunkOutput:
    logits: torch.Tensor  # [ctx − first, V]: rows of positions first..ctx − 1
    hidden: dict  # name -> [ctx, width], the hidden states asked for


SIDECAR_PREFIX = "mtp-"  # convert --mtp separate writes the head of X.gguf as mtp-X.gguf


def sibling_sidecar(path: Path) -> Path | None:
    sibling = Path(path).with_name(SIDECAR_PREFIX + Path(path).name)
    return sibling if sibling.is_file() else None


class GgufTrunk:
    """A GGUF model's trunk, and its MTP head when it has one: the sidecar `mtp_path`, else the embedded
    head, else mtp-<file name> next to the file."""

    def __init__(self, path: Path, ctx: int, device: str, dtype: str | None, mtp_path: Path | None = None):
        self.path = Path(path)
        self.model = load_model(self.path, device=device, dtype=dtype)
        self.model.require(GraphType.MAIN)
        self.head = None
        self.head_file = None
        if mtp_path is None and GraphType.MTP not in self.model.serves:
            mtp_path = sibling_sidecar(self.path)
        if mtp_path is not None:
            self.head = load_model(mtp_path, device=self.model.device, dtype=self.model.dtype, share_from=self.model)
            self.head.require(GraphType.MTP)
            self.head_file = Path(mtp_path)
        elif GraphType.MTP in self.model.serves:
            self.head, self.head_file = self.model, self.path
        self.vocab_size = self.model.vocab_size
        self.context = Context(self.model, GraphType.MAIN, n_ctx=ctx, n_rs_seq=0)

    def run(self, ids: list[int], first: int, hidden: tuple[str, ...] = ()) -> ChunkOutput:
        self.context.clear()
        head = self.context.decode(ids[:first], hidden=hidden, logits=None)
        tail = self.context.decode(ids[first:], hidden=hidden, logits="all")
        return ChunkOutput(tail.logits, {n: torch.cat([head.hidden[n], tail.hidden[n]]) for n in hidden})

    def close(self) -> None:
        self.context = self.model = self.head = None
        release()


class HfTrunk:
    """The source checkpoint through transformers (verify's reference loader: accelerate's device map,
    a temporary offload folder), its logits cut to the GGUF vocabulary (Gemma's is trimmed)."""

    head = None
    head_file = None

    def __init__(self, folder: Path, arch: str, vocab_size: int, dtype: torch.dtype):
        from specconv.verify import parity

        self.path, self.vocab_size, self._parity = Path(folder), vocab_size, parity
        self._session = parity.reference_model(self.path, arch, dtype)
        self.model, bad = self._session.__enter__()
        if bad:
            self.close()
            raise SpecconvError(f"{folder}: transformers could not load the checkpoint completely ({bad})")
        if self.model.config.get_text_config().vocab_size < vocab_size:
            self.close()
            raise SpecconvError(f"{folder}: a vocabulary of {self.model.config.get_text_config().vocab_size}, "
                                f"smaller than the GGUF files' {vocab_size}")

    @torch.no_grad()
    def run(self, ids: list[int], first: int, hidden: tuple[str, ...] = ()) -> ChunkOutput:
        p = self._parity
        with p.reference_precision(self.model):
            out = self.model(torch.tensor([ids], device=p.input_device(self.model)), use_cache=False)
        return ChunkOutput(out.logits[0, first:, :self.vocab_size].cpu(), {})

    def close(self) -> None:
        if self._session is not None:
            self.model = None
            self._session.__exit__(None, None, None)
            self._session = None
        release()


def release() -> None:
    """Give a closed model's memory back before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
