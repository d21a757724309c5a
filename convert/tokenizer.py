"""Tokenizer export (docs/reference/gguf-layout.md §3): byte-level BPE vocabulary, merges, special ids, chat template.

The vocabulary is read with gguf-py's `BpeVocab` and the rest with `SpecialVocab`, the readers
llama.cpp's converter uses. Token types follow the converter: added tokens that are `special` (or
look like `<|...|>`) are CONTROL, other added tokens USER_DEFINED, and ids the tokenizer lacks up to
the embedding's row count become `[PAD{i}]` entries of type UNUSED. The pre-tokenizer name comes
from the plugin (tiny self-trained tokenizers have no hash llama.cpp would recognise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from gguf import GGUFWriter, TokenType
from gguf.vocab import BpeVocab, LlamaHfVocab, SpecialVocab

from huggingface_hub.errors import StrictDataclassError

from specconv.archs.base import MetaKV
from specconv.archs.config_reader import ConfigReader
from specconv.archs.errors import SpecconvError

from .checkpoint import read_config
from .kv import captured_kv


def _added_token_flags(model_dir: Path) -> dict[str, bool]:
    """content -> `special` flag of every added token (tokenizer.json, else tokenizer_config.json)."""
    flags: dict[str, bool] = {}
    tok_json = model_dir / "tokenizer.json"
    if tok_json.is_file():
        for item in json.loads(tok_json.read_text(encoding="utf-8")).get("added_tokens") or []:
            flags[item["content"]] = bool(item.get("special", False))
    cfg = model_dir / "tokenizer_config.json"
    if not flags and cfg.is_file():
        decoder = json.loads(cfg.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
        for item in decoder.values():
            flags[item["content"]] = bool(item.get("special", False))
    return flags


def _looks_special(text: str) -> bool:
    # Some releases mark control tokens as non-special; llama.cpp's converter treats these as CONTROL.
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>")) or (text.startswith("<unused") and text.endswith(">")))


def vocabulary(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, token types), padded to `n_vocab` entries."""
    try:
        vocab = BpeVocab(model_dir)
    except FileNotFoundError:
        raise SpecconvError(f"no byte-level BPE tokenizer (tokenizer.json or vocab.json) in {model_dir}") from None
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise SpecconvError(f"tokenizer in {model_dir} cannot be read: {exc}") from None
    flags = _added_token_flags(model_dir)
    tokens: list[str] = []
    types: list[int] = []
    for text, _score, _type in vocab.all_tokens():
        text = text.decode("utf-8") if isinstance(text, bytes) else text
        tokens.append(text)
        if text in flags:
            types.append(int(TokenType.CONTROL if flags[text] or _looks_special(text) else TokenType.USER_DEFINED))
        else:
            types.append(int(TokenType.NORMAL))
    if len(tokens) > vocab_size:
        raise SpecconvError(f"the tokenizer has {len(tokens)} tokens but the token embedding has only {vocab_size} rows")
    padding = range(len(tokens), vocab_size)
    tokens.extend([f"[PAD{i}]" for i in padding])
    types.extend([int(TokenType.UNUSED)] * len(padding))
    return tokens, types


# Gemma 4 tool/channel markers that stay visible (USER_DEFINED) so chat parsers can read them.
_GEMMA4_VISIBLE = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                   "<tool_response|>", '<|"|>'}


def gemma4_tokenizer_kv(model_dir: Path, vocab_size: int) -> list[MetaKV]:
    """`tokenizer.ggml.model = gemma4`: BPE with byte fallback, read with gguf-py's LlamaHfVocab, with
    scores, token types and merges; no `pre` (llama.cpp forces it), add_bos on, no space prefix."""
    # gguf-py builds this tokenizer with transformers, which reads config.json through its config class:
    # the fields every config class reads are checked first, so a wrong type is named here
    config = ConfigReader(read_config(model_dir))
    for part in (config, config.text_model()):
        part.string("model_type", default=None), part.string("dtype", "torch_dtype", default=None)
        part.section("rope_parameters"), part.section("rope_scaling"), part.strings("layer_types", default=None)
    try:
        vocab = LlamaHfVocab(model_dir)
    except FileNotFoundError:
        raise SpecconvError(f"no Gemma-style BPE tokenizer with byte fallback (tokenizer.json) in {model_dir}") from None
    except StrictDataclassError as exc:  # a field of the wrong type, named by transformers' config class
        raise SpecconvError(f"config.json: {' '.join(str(exc).split())}") from None
    except Exception as exc:  # noqa: BLE001 - transformers' own reading of config.json or the tokenizer files
        raise SpecconvError(f"transformers cannot build the Gemma tokenizer of {model_dir} from its config.json and "
                            f"tokenizer files ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    tokens, scores, types = [], [], []
    for text, score, toktype in vocab.all_tokens():
        text = text.decode("utf-8") if isinstance(text, bytes) else text
        tokens.append(text)
        scores.append(float(score))
        types.append(int(TokenType.USER_DEFINED if text in _GEMMA4_VISIBLE else toktype))
    if len(tokens) != vocab_size:
        raise SpecconvError(f"the tokenizer has {len(tokens)} tokens but the token embedding keeps {vocab_size} rows")
    writer = GGUFWriter(None, "capture")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = special_vocab(model_dir, vocab_size)
    if not special.merges:
        raise SpecconvError(f"the Gemma tokenizer in {model_dir} has no merges (llama.cpp requires them)")
    special.add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    return captured_kv(writer)


def _added_token_ids(model_dir: Path) -> dict[str, int]:
    """content -> id of every added token (tokenizer.json)."""
    tok_json = model_dir / "tokenizer.json"
    if not tok_json.is_file():
        return {}
    items = json.loads(tok_json.read_text(encoding="utf-8")).get("added_tokens") or []
    return {item["content"]: int(item["id"]) for item in items}


_SPECIAL_KINDS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask", "eot")  # what gguf-py's SpecialVocab reads


def special_vocab(model_dir: Path, vocab_size: int) -> SpecialVocab:
    """gguf-py's SpecialVocab, after the `*_token_id` values it reads from config.json (top level, else
    `text_config`) are checked: an integer id or a list of them (a negative id stops it with a ValueError)."""
    config = ConfigReader(read_config(model_dir))
    for kind in _SPECIAL_KINDS:
        key = f"{kind}_token_id"
        part = config if config.has(key) else config.text_model()
        if isinstance(part.raw(key), list):
            part.integers(key)
        else:
            part.integer(key, default=None)
    return SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)


def tokenizer_kv(model_dir: str | Path, vocab_size: int, model: str, pre: str,
                 special_tokens: Mapping[str, str] | None = None) -> list[MetaKV]:
    """The `tokenizer.*` KV pairs for a vocabulary of `n_vocab` entries (the embedding's rows).

    `special_tokens` (kind -> added token text): ids an architecture fixes, set only where the
    tokenizer's config left that kind unset (a token the tokenizer lacks is skipped)."""
    model_dir = Path(model_dir)
    if model == "gemma4":
        return gemma4_tokenizer_kv(model_dir, vocab_size)
    tokens, types = vocabulary(model_dir, vocab_size)
    writer = GGUFWriter(None, "capture")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = special_vocab(model_dir, vocab_size)
    if model == "gpt2" and not special.merges:
        raise SpecconvError(f"the BPE tokenizer in {model_dir} has no merges")
    added = _added_token_ids(model_dir) if special_tokens else {}
    for kind, text in (special_tokens or {}).items():
        if text in added:
            special._set_special_token(kind, added[text])
    special.add_to_gguf(writer, quiet=True)
    return captured_kv(writer)
