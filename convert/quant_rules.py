"""Which GGML type llama.cpp's quantize tool gives each tensor of a file, for the K-quant file types.

specconv writes a K-quant file in one pass; to equal what `llama-quantize IN.gguf OUT.gguf Q4_K_M`
makes of our lossless file (F32, or BF16 from a BF16 checkpoint), this module replays the tool's
decisions (src/llama-quant.cpp of the pinned llama.cpp, importance-matrix-free path, default
parameters) on the file's own tensor list and KV:

* only tensors of 2+ dimensions (trailing sizes of 1 not counted: [H, 1] is 1-D) whose name ends in `weight` are quantized, minus a list of names
  (norms, routers `ffn_gate_inp`, conv kernels, positional embeddings, small per-arch tensors);
  every other tensor keeps the type it has in the lossless file;
* tensors are visited in llama.cpp's loader order (layer number, then name; non-layer tensors
  first), and that order drives its counters: attention-V-like tensors (`attn_v`, `attn_qkv`,
  `attn_kv_b`) get more bits by their rank among all of them, `ffn_down` by its layer (counted in
  visiting order for dense models, read from the name for MoE), out of `block_count` layers, which
  includes MTP / nextn layers: an MTP block is just the last layer to these rules;
* `output.weight` (and `token_embd.weight` when the embeddings are tied) becomes Q6_K, or Q8_0
  when its rows do not hold 256-element blocks; 8 experts give attn_v/attn_k Q8_0 and attn_output
  Q5_K; Q2_K gives attn_v Q4_K when head_count / head_count_kv >= 4;
* a type whose block does not divide the row length falls back (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0), and to F16 when even 32 does not divide it.
The file keeps the lossless file's KV with `general.quantization_version` and `general.file_type`
moved to the end, as the tool rewrites them, and its tensors in the tool's order, so the whole file
is the tool's output byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from gguf import GGMLQuantizationType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

from specconv.archs.base import MetaKV
from specconv.archs.errors import SpecconvError

Q = GGMLQuantizationType
FT = LlamaFileType

# --outtype name -> (file type, the tool's default tensor type for it)
KQUANT_FILE_TYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "q2_k": (FT.MOSTLY_Q2_K, Q.Q2_K), "q3_k_s": (FT.MOSTLY_Q3_K_S, Q.Q3_K), "q3_k_m": (FT.MOSTLY_Q3_K_M, Q.Q3_K),
    "q3_k_l": (FT.MOSTLY_Q3_K_L, Q.Q3_K), "q4_k_s": (FT.MOSTLY_Q4_K_S, Q.Q4_K), "q4_k_m": (FT.MOSTLY_Q4_K_M, Q.Q4_K),
    "q5_k_s": (FT.MOSTLY_Q5_K_S, Q.Q5_K), "q5_k_m": (FT.MOSTLY_Q5_K_M, Q.Q5_K), "q6_k": (FT.MOSTLY_Q6_K, Q.Q6_K),
    "q2_k_s": (FT.MOSTLY_Q2_K_S, Q.Q2_K),  # needs an importance matrix (requires_imatrix)
    "iq4_nl": (FT.MOSTLY_IQ4_NL, Q.IQ4_NL), "iq4_xs": (FT.MOSTLY_IQ4_XS, Q.IQ4_XS),
}
IQ4_TYPES = frozenset({Q.IQ4_NL, Q.IQ4_XS})  # encoded by the weighted encoders, with or without weights
# File types that llama.cpp's quantize only makes with an importance matrix, and those specconv has no
# encoder for (the IQ and ternary types): named in refusals.
NEEDS_IMATRIX = ("q2_k_s", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs")
NOT_ENCODED = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m",
               "tq1_0", "tq2_0", "mxfp4_moe", "q1_0", "q2_0")

# Substrings (or exact names) whose tensors the tool never quantizes, whatever their shape.
_NEVER_PARTS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
                "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
                "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
                "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
                "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
                "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
                "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
_NEVER_NAMES = ("position_embd.weight", "token_types.weight")
# Architectures whose layer count makes the tool's model type "70B" (attn_v gets Q5_K over Q3_K/Q4_K).
_SEVENTY_B_LAYERS = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}
_LAYER = re.compile(r"^blk\.(-?\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order; ne[0] (the row length) is the last entry
    lossless: GGMLQuantizationType  # its type in the lossless file


@dataclass(frozen=True)
class Hparams:
    arch: str
    num_hidden_layers: int  # block_count, MTP layers included
    num_experts: int
    num_attention_heads: int  # of layer 0
    num_key_value_heads: int

    @classmethod
    def from_kv(cls, arch: str, kv: Sequence[MetaKV]) -> "Hparams":
        values = {e.key: e.value for e in kv}

        def first(key, default):
            v = values.get(f"{arch}.{key}", default)
            return int(v[0] if isinstance(v, (list, tuple)) else v)

        num_attention_heads = first("attention.head_count", 0)
        return cls(arch, first("block_count", 0), first("expert_count", 0), num_attention_heads,
                   first("attention.head_count_kv", num_attention_heads))

    @property
    def n_gqa(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads if self.num_key_value_heads else 0

    @property
    def is_70b(self) -> bool:
        if self.num_hidden_layers != _SEVENTY_B_LAYERS.get(self.arch):
            return False
        return self.arch != "llama" or self.num_attention_heads != self.num_key_value_heads  # llama: equal heads is "65B"


def loader_order(names: Sequence[str]) -> list[str]:
    """llama.cpp's tensor order: by the number after `blk.` (-1 without one), then by name."""
    def key(name: str):
        m = _LAYER.match(name)
        return (int(m.group(1)) if m else -1, name.encode())
    return sorted(names, key=key)


def ggml_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape (torch order) as the tool writes it: ggml's dimension count ignores trailing (in ggml
    order) sizes of 1, so [1, 64] in torch order is written as [64]."""
    lead = 0
    while lead < len(shape) - 1 and shape[lead] == 1:
        lead += 1
    return tuple(shape[lead:])


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the tool quantizes this tensor at all (with its default parameters)."""
    if len(ggml_shape(shape)) < 2 or not name.endswith("weight") or name in _NEVER_NAMES:
        return False
    return not any(part in name for part in _NEVER_PARTS)


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                      ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                      ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                      ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}


class _Chooser:
    def __init__(self, ftype: LlamaFileType, default: GGMLQuantizationType, hp: Hparams, names: Sequence[str],
                 has_imatrix: bool = False):
        self.ftype, self.default, self.hp, self.has_imatrix = ftype, default, hp, has_imatrix
        self.tied = "output.weight" not in names
        self.n_wv = sum(_category(n) == "attn_v" for n in names)
        self.i_wv = self.i_down = self.i_gate = self.i_up = 0

    def _layer(self, counter: int, name: str) -> tuple[int, int]:
        n = self.hp.num_hidden_layers
        if self.hp.num_experts <= 1:
            return counter, n
        m = _LAYER.match(name)
        if not m:
            raise SpecconvError(f"llama.cpp's quantize cannot find the layer of {name} (a MoE model)")
        i = int(m.group(1))
        if not 0 <= i < n:
            raise SpecconvError(f"llama.cpp's quantize refuses {name}: layer {i} is not in [0, {n})")
        return i, n

    def choose(self, t: TensorInfo) -> GGMLQuantizationType:
        new = self._mixture(t)
        return self._fit(new, t.shape[-1])

    def _mixture(self, t: TensorInfo) -> GGMLQuantizationType:
        f, hp, cat, new = self.ftype, self.hp, _category(t.name), self.default
        if cat == "output" or (self.tied and cat == "token_embd"):
            block = GGML_QUANT_SIZES[new][0]
            return Q.Q8_0 if t.shape[-1] % block else (Q.Q6_K if new != Q.Q8_0 else new)
        if cat == "attn_v":
            if f == FT.MOSTLY_Q2_K:
                new = Q.Q4_K if hp.n_gqa >= 4 else Q.Q3_K
            elif f == FT.MOSTLY_Q2_K_S and hp.n_gqa >= 4:
                new = Q.Q4_K
            elif f == FT.MOSTLY_Q3_K_M:
                new = Q.Q5_K if self.i_wv < 2 else Q.Q4_K
            elif f == FT.MOSTLY_Q3_K_L:
                new = Q.Q5_K
            elif f in (FT.MOSTLY_IQ4_NL, FT.MOSTLY_IQ4_XS) and hp.n_gqa >= 4:
                new = Q.Q5_K
            elif f in (FT.MOSTLY_Q4_K_M, FT.MOSTLY_Q5_K_M) and _more_bits(self.i_wv, self.n_wv):
                new = Q.Q6_K
            elif f == FT.MOSTLY_Q4_K_S and self.i_wv < 4:
                new = Q.Q5_K
            if hp.is_70b and new in (Q.Q3_K, Q.Q4_K):
                new = Q.Q5_K
            if hp.num_experts == 8:
                new = Q.Q8_0
            self.i_wv += 1
        elif cat == "attn_k":
            if hp.num_experts == 8:
                new = Q.Q8_0
        elif cat == "ffn_down":
            i, n = self._layer(self.i_down, t.name)
            if f == FT.MOSTLY_Q2_K:
                new = Q.Q3_K
            elif f == FT.MOSTLY_Q2_K_S:
                new = Q.Q4_K if i < n // 8 else new
            elif f == FT.MOSTLY_Q3_K_M:
                new = Q.Q5_K if i < n // 16 else Q.Q4_K
            elif f == FT.MOSTLY_Q3_K_L:
                new = Q.Q5_K
            elif f == FT.MOSTLY_Q4_K_M:
                new = Q.Q6_K if _more_bits(i, n) else new
            elif i < n // 8 and f in (FT.MOSTLY_IQ4_NL, FT.MOSTLY_IQ4_XS) and not self.has_imatrix:
                new = Q.Q5_K
            elif f == FT.MOSTLY_Q5_K_M:
                new = Q.Q6_K if _more_bits(i, n) else new
            elif f == FT.MOSTLY_Q4_K_S and i < n // 8:
                new = Q.Q5_K
            self.i_down += 1
        elif cat == "attn_output":
            if hp.num_experts == 8:
                if f in (FT.MOSTLY_Q2_K, FT.MOSTLY_Q3_K_S, FT.MOSTLY_Q3_K_M, FT.MOSTLY_Q4_K_S, FT.MOSTLY_Q4_K_M,
                         FT.MOSTLY_IQ4_NL, FT.MOSTLY_IQ4_XS):
                    new = Q.Q5_K
            else:
                new = {FT.MOSTLY_Q2_K: Q.Q3_K, FT.MOSTLY_Q3_K_M: Q.Q4_K, FT.MOSTLY_Q3_K_L: Q.Q5_K}.get(f, new)
        elif cat in ("ffn_gate", "ffn_up"):
            self._layer(self.i_gate if cat == "ffn_gate" else self.i_up, t.name)  # it refuses unknown layers
            if cat == "ffn_gate":
                self.i_gate += 1
            else:
                self.i_up += 1
        return new

    @staticmethod
    def _fit(new: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
        block = GGML_QUANT_SIZES[new][0]
        if row % block == 0:
            return new
        new = _FALLBACK.get(new, new)
        return new if row % GGML_QUANT_SIZES[new][0] == 0 else Q.F16


def choose_types(file_type: str, hp: Hparams, tensors: Sequence[TensorInfo],
                 has_imatrix: bool = False,
                 overrides: Mapping[str, GGMLQuantizationType] | None = None) -> dict[str, GGMLQuantizationType]:
    """name -> GGML type for every tensor of one file, as llama.cpp's quantize decides it (with an
    importance matrix the IQ4 types keep the first FFN-down layers at IQ4 instead of Q5_K).

    `overrides` (name -> type, e.g. a measured mix, convert/auto_mix.py) replaces the tool's type of
    those quantizable tensors, with the tool's fallback where the type's block does not divide the
    row; the counters still see every tensor, so the others keep the tool's types."""
    ftype, default = KQUANT_FILE_TYPES[file_type]
    by_name = {t.name: t for t in tensors}
    order = loader_order(list(by_name))
    chooser = _Chooser(ftype, default, hp, order, has_imatrix)
    overrides = overrides or {}
    types = {}
    for name in order:
        t = by_name[name]
        types[name] = chooser.choose(t) if quantizable(name, t.shape) else t.lossless
        if name in overrides:
            if not quantizable(name, t.shape):
                raise SpecconvError(f"internal: {name} is not quantized by llama.cpp's rules; it cannot take a type")
            types[name] = fitted_type(overrides[name], t.shape[-1])
    return types


def fitted_type(ggml_type: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
    """`ggml_type`, or the tool's fallback when its block does not divide a row of `row` values."""
    return _Chooser._fit(ggml_type, row)


def requires_imatrix(file_type: str, name: str, new_type: GGMLQuantizationType) -> bool:
    """Whether the tool refuses to make this tensor without importance weights: in a Q2_K_S file, the
    Q2_K tensors other than the embedding and the output (the IQ1/IQ2/IQ3_XXS types, which specconv
    does not encode, always)."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    return new_type == Q.Q2_K and file_type == "q2_k_s"


def requantized_kv(kv: Sequence[MetaKV]) -> list[MetaKV]:
    """The tool rewrites `general.quantization_version` and then `general.file_type`: both move to the end."""
    moved = ("general.quantization_version", "general.file_type")
    return [e for e in kv if e.key not in moved] + [e for key in moved for e in kv if e.key == key]
