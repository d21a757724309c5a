"""The token stream and its chunks, laid out as llama-perplexity lays them (docs/compare.md §2).

* `--text FILE` is tokenized with the GGUF tokenizer, a BOS first when the vocabulary adds one
  (llama.cpp's `common_tokenize(ctx, text, add_special = true)`); `--tokens FILE` gives the ids
  (whitespace-, comma-separated, or a JSON list).
* The stream is cut into n = ⌊len / ctx⌋ chunks of ctx tokens (`--chunks` takes the first n); the
  rest is left out. When the vocabulary adds a BOS, each chunk's first token is replaced by BOS.
* Each chunk is evaluated from an empty memory; of its logits, rows first = ⌊ctx/2⌋ .. ctx − 2 are
  scored (row j predicts token j + 1): ctx − 1 − first positions per chunk.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from specconv.errors import SpecconvError

MIN_CTX = 4


def read_token_file(path: Path, vocab_size: int) -> list[int]:
    text = Path(path).read_text(encoding="utf-8").strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(t) for t in re.split(r"[\s,]+", text) if t]
    except ValueError:
        raise SpecconvError(f"--tokens {path}: not a list of integer token ids (whitespace, commas or a JSON list)") \
            from None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise SpecconvError(f"--tokens {path}: not a list of integer token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SpecconvError(f"--tokens {path}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def read_stream(tokenizer, vocab_size: int, text: Path | None = None, tokens: Path | None = None) -> list[int]:
    if (text is None) == (tokens is None):
        raise SpecconvError("give the evaluation text as --text FILE or --tokens FILE (one of them)")
    if tokens is not None:
        return read_token_file(tokens, vocab_size)
    try:
        content = Path(text).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecconvError(f"--text {text}: not UTF-8 text") from None
    return tokenizer.encode(content)


@dataclass(frozen=True)
class Chunks:
    tokens: tuple[int, ...]
    ctx: int
    n_chunks: int
    bos: int | None  # replaces each chunk's first token (vocabularies that add a BOS)

    @classmethod
    def plan(cls, tokens: list[int], ctx: int, bos: int | None, limit: int | None = None) -> "Chunks":
        if ctx < MIN_CTX:
            raise SpecconvError(f"--ctx must be at least {MIN_CTX}")
        n = len(tokens) // ctx
        if n == 0:
            raise SpecconvError(f"the text has {len(tokens)} tokens: --ctx {ctx} needs at least {ctx} "
                                f"(one chunk); give more text or a smaller --ctx")
        if limit is not None:
            n = min(n, limit)
        return cls(tuple(tokens[:n * ctx]), ctx, n, bos)

    @property
    def first(self) -> int:
        return self.ctx // 2

    @property
    def scored(self) -> int:
        """Scored positions per chunk."""
        return self.ctx - 1 - self.first

    def ids(self, i: int) -> list[int]:
        out = list(self.tokens[i * self.ctx:(i + 1) * self.ctx])
        if self.bos is not None:
            out[0] = self.bos
        return out

    def targets(self, i: int) -> list[int]:
        """The next tokens of the scored rows of chunk i."""
        start = i * self.ctx
        return list(self.tokens[start + self.first + 1:start + self.ctx])
