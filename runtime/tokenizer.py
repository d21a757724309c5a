"""A tokenizer built from GGUF metadata with the `tokenizers` library (no hand-written BPE).

`tokenizer.ggml.model = gpt2` is byte-level BPE: the vocabulary is `tokenizer.ggml.tokens` (ids are
positions), the merges are `tokenizer.ggml.merges`, and `tokenizer.ggml.pre` names the split regex.
Tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, as the
converter derived them from the HF added tokens.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from specconv.archs.errors import SpecconvError

_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's CHATGLM4 (GLM-4.5 "glm4") and DEEPSEEK3_LLM ("deepseek-v3": three splits in a row)
_GLM4 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split regex, NFC normalisation); names as llama.cpp's llama-vocab.cpp accepts them
PRE_TOKENIZERS: dict[str, tuple[str | tuple[str, ...], bool]] = {
    "glm4": (_GLM4, False),
    "deepseek-v3": (_DEEPSEEK3, False),
    "hy_v4": (_DEEPSEEK3, False),  # llama.cpp's HY_V4 splits are DEEPSEEK3_LLM's (Hy3 / Hy4 tokenizer)
    "qwen35": (_QWEN35, True),
    "qwen2": (_QWEN2, True),
    "deepseek-r1-qwen": (_QWEN2, True),
    "llama-bpe": (_LLAMA3, False),
    "llama3": (_LLAMA3, False),
    "llama-v3": (_LLAMA3, False),
    "gpt2": (_GPT2, False),
    "default": (_GPT2, False),
}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def _gemma4_tokenizer(tokens: list[str], merges, unk_id) -> Tokenizer:
    """Gemma's BPE with byte fallback: spaces become '▁', pieces split after each '▁' run, unknown
    characters fall back to <0xXX> byte tokens (docs/reference/peers.md §2.9)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_previous")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tk


SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "separator", "padding", "mask", "cls", "fim_pre",
                   "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_tokenizer_kv(kv: Mapping[str, Any], supported: bool = True) -> None:
    """The tokenizer arrays are well-typed and of one length, special ids lie in the vocabulary and
    every merge is two tokens of the vocabulary (what the tokenizers library would fail on).
    `supported=False` (at load): a tokenizer kind the runtime cannot build (SentencePiece 'llama',
    an unknown pre-tokenizer) is not an error yet — a model given token ids runs without it; the
    error comes when text has to be tokenized."""
    model = kv.get("tokenizer.ggml.model")
    if not isinstance(model, str):
        raise SpecconvError(f"KV tokenizer.ggml.model must be a string, found {model!r}"[:200])
    tokens = kv.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise SpecconvError("KV tokenizer.ggml.tokens must be a non-empty array of strings")
    n = len(tokens)
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        v = kv.get(key)
        if v is not None and (not isinstance(v, list) or len(v) != n):
            found = f"{len(v)} entries" if isinstance(v, list) else type(v).__name__
            raise SpecconvError(f"KV {key} must be an array of {n} entries (one per token), found {found}")
    types = kv.get("tokenizer.ggml.token_type")
    if types is not None and not all(_is_int(t) for t in types):
        raise SpecconvError("KV tokenizer.ggml.token_type must be an array of integers")
    for name in SPECIAL_ID_KEYS:
        key = f"tokenizer.ggml.{name}_token_id"
        v = kv.get(key)
        if v is not None and not (_is_int(v) and 0 <= v < n):
            raise SpecconvError(f"KV {key} = {v!r} is not a token id of the {n}-token vocabulary"[:200])
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        v = kv.get(key)
        if v is not None and not isinstance(v, bool):
            raise SpecconvError(f"KV {key} must be a boolean, found {v!r}"[:200])
    if not supported:
        if model == "gpt2":
            _parse_merges(kv, set(tokens))
        return
    if model not in ("gpt2", "gemma4"):
        raise SpecconvError(f"KV tokenizer.ggml.model: tokenizer model {model!r} is not supported by the runtime "
                            "(byte-level BPE 'gpt2', byte-fallback BPE 'gemma4')"[:300])
    pre = kv.get("tokenizer.ggml.pre")
    if pre is not None and not isinstance(pre, str):
        raise SpecconvError(f"KV tokenizer.ggml.pre must be a string, found {pre!r}"[:200])
    if model == "gpt2" and (pre or "default") not in PRE_TOKENIZERS:
        raise SpecconvError(f"KV tokenizer.ggml.pre: pre-tokenizer {pre!r} is not known to the runtime tokenizer "
                            f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"[:300])
    _parse_merges(kv, set(tokens))


def _parse_merges(kv: Mapping[str, Any], vocab: set[str]) -> list[tuple[str, str]]:
    merges = kv.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise SpecconvError("KV tokenizer.ggml.merges must be an array of strings")
    out = []
    for i, m in enumerate(merges):
        parts = m.split(" ", 1)
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise SpecconvError(f"KV tokenizer.ggml.merges[{i}] = {m!r} is not two tokens separated by a space"[:200])
        a, b = parts
        for piece in (a, b, a + b):
            if piece not in vocab:
                raise SpecconvError(f"KV tokenizer.ggml.merges[{i}] = {m!r}: {piece!r} is not in "
                                    f"tokenizer.ggml.tokens"[:200])
        out.append((a, b))
    return out


class GGUFTokenizer:
    """encode(text) -> ids, decode(ids) -> text, plus the special ids the file declares."""

    def __init__(self, kv: Mapping[str, Any]):
        model = kv.get("tokenizer.ggml.model")
        if model is None:
            raise SpecconvError("the GGUF file has no tokenizer (tokenizer.ggml.model is absent)")
        if model not in ("gpt2", "gemma4"):
            raise SpecconvError(f"tokenizer model {model!r} is not supported by the runtime "
                                "(byte-level BPE 'gpt2', byte-fallback BPE 'gemma4')"[:300])
        check_tokenizer_kv(kv)
        try:
            self._build(kv, model)
        except SpecconvError:
            raise
        except Exception as exc:  # the tokenizers library's own complaint, about this file's tokenizer KV
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise SpecconvError(f"KV tokenizer.ggml.tokens/merges: the tokenizer cannot be built ({detail})"[:300]) \
                from None

    def _build(self, kv: Mapping[str, Any], model: str) -> None:
        tokens: list[str] = kv["tokenizer.ggml.tokens"]
        types: Sequence[int] = kv.get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = _parse_merges(kv, set(tokens))
        if model == "gemma4":
            tk = _gemma4_tokenizer(tokens, merges, kv.get("tokenizer.ggml.unknown_token_id"))
            self._finish(kv, tk, tokens, types)
            return
        pre = kv.get("tokenizer.ggml.pre") or "default"  # llama.cpp: an empty name is the default
        if pre not in PRE_TOKENIZERS:
            raise SpecconvError(f"KV tokenizer.ggml.pre: pre-tokenizer {pre!r} is not known to the runtime tokenizer "
                                f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"[:300])
        regex, nfc = PRE_TOKENIZERS[pre]

        vocab = {tok: i for i, tok in enumerate(tokens)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        if nfc:
            tk.normalizer = normalizers.NFC()
        splits = [regex] if isinstance(regex, str) else list(regex)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        self._finish(kv, tk, tokens, types)

    def _finish(self, kv, tk: Tokenizer, tokens: list[str], types: Sequence[int]) -> None:
        added = [AddedToken(tokens[i], special=(t == TOKEN_TYPE_CONTROL), normalized=False)
                 for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
        if added:
            tk.add_tokens(added)
        self._tk = tk
        self.vocab_size = len(tokens)
        self.special_ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
        self.bos_id = kv.get("tokenizer.ggml.bos_token_id")
        self.eos_id = kv.get("tokenizer.ggml.eos_token_id")
        self.eot_id = kv.get("tokenizer.ggml.eot_token_id")
        self.add_bos = bool(kv.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template = kv.get("tokenizer.chat_template")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        try:
            ids = self._tk.encode(text, add_special_tokens=False).ids
        except Exception as exc:  # the library's complaint about this file's vocabulary
            raise SpecconvError(f"KV tokenizer.ggml.tokens: the tokenizer cannot encode the text ({exc})"[:300]) from None
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        try:
            return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special)
        except Exception as exc:
            raise SpecconvError(f"KV tokenizer.ggml.tokens: the tokenizer cannot decode ids ({exc})"[:300]) from None

    def is_end_of_generation(self, token: int) -> bool:
        return token in {t for t in (self.eos_id, self.eot_id) if t is not None}
