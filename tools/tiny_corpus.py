"""Text and tokenizer for the bundled tiny model: Python's own standard-library sources.

Why this corpus: it exists on every machine with CPython, needs no network, and code is
predictable enough that a model of a few million parameters learns a useful MTP head.

The split is by file and deterministic: the top-level `*.py` files of the stdlib, sorted by name;
a file is HELD OUT when the first byte of sha256(file name) is below HELDOUT_BYTE_LIMIT (~1 in 8).
Hashing the name (not the position in the listing) keeps the split stable across Python versions
that add or drop modules. The benchmark measures acceptance on the held-out files only.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# Qwen3.5's pre-tokenizer regex (Qwen2's plus \p{M} in the letter classes).
QWEN35_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"  # separates files in training, as in base-model pretraining
# Qwen-style ChatML template (no tools or thinking blocks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HELDOUT_BYTE_LIMIT = 32  # of 256: about 1/8 of the files


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(name: str) -> bool:
    return hashlib.sha256(name.encode("utf-8")).digest()[0] < HELDOUT_BYTE_LIMIT


def split_files(lib: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), both sorted by name."""
    lib = lib or stdlib_dir()
    files = sorted(p for p in lib.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no *.py files found in {lib}")
    train = [p for p in files if not is_heldout(p.name)]
    held = [p for p in files if is_heldout(p.name)]
    return train, held


def read_text(path: Path) -> str:
    # A few stdlib files carry latin-1 bytes in comments; replace rather than fail.
    return path.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(files: list[Path], vocab_size: int):
    """A Qwen-style byte-level BPE (NFC, Qwen3.5 split regex, ByteLevel) with `vocab_size` entries in all."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in files], trainer)
    # Specials go after the learned vocabulary, as in real Qwen releases.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, wanted {vocab_size}")
    return tok


def save_hf_tokenizer(tok, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out_dir))


def encode_files(tok, files: list[Path]) -> list[list[int]]:
    """Token ids per file, each followed by the end-of-text token."""
    eos = tok.token_to_id(EOS_TOKEN)
    return [tok.encode(read_text(p)).ids + [eos] for p in files]
