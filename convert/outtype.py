"""Storage types: which GGML type each output tensor gets, and encoding float32 values into it.

The rules are llama.cpp's converter's (docs/reference/gguf-layout.md §2, `prepare_tensors` of the pinned tree):
a plugin's forced type first; then 1-D tensors, `*_norm.weight`, routers, conv kernels and every
tensor whose name does not end in `.weight` are F32; everything else follows `--outtype`. A
quantized type whose block does not divide the row length falls back to F16, as upstream does.

The K-quant file types (q2_k ... q6_k, convert/quant_rules.py) are llama.cpp's quantize tool's, not
its converter's: each tensor's type is the one that tool gives it when quantizing our lossless file
(`lossless_type`: BF16 for a BF16 checkpoint, F16 for F16, else F32), which is also the type of the
tensors it leaves unquantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

from specconv.archs.errors import SpecconvError

from .quant_rules import KQUANT_FILE_TYPES

Q = GGMLQuantizationType

KQUANT_CHOICES = tuple(KQUANT_FILE_TYPES)
OUTTYPE_CHOICES = ("f32", "f16", "bf16", "q8_0", "q4_0", *KQUANT_CHOICES, "auto")
_BY_NAME = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
_FILE_TYPES = {Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16, Q.BF16: LlamaFileType.MOSTLY_BF16,
               Q.Q8_0: LlamaFileType.MOSTLY_Q8_0, Q.Q4_0: LlamaFileType.MOSTLY_Q4_0}

# GGUF names llama.cpp's converter always stores as F32 (its MODEL_TENSOR list in prepare_tensors).
_F32_BLOCK_PARTS = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d", "shortconv.conv", "time_mix_first",
                    "time_mix_w1", "time_mix_w2", "time_mix_decay_w1", "time_mix_decay_w2", "time_mix_lerp_fused",
                    "altup_correct_coef", "altup_predict_coef", "ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v",
                    "indexer.proj")
_F32_PATTERN = re.compile(
    r"^(?:blk\.\d+\.(?:" + "|".join(re.escape(p) for p in _F32_BLOCK_PARTS) + r")"
    r"|posnet\.\d+\.norm[12]|position_embd|token_types|v\.position_embd|a\.position_embd)\.weight$")


@dataclass(frozen=True)
class KQuantFileType:
    """A K-quant `--outtype` (a file type of llama.cpp's quantize tool, e.g. Q4_K_M)."""
    key: str  # "q4_k_m"
    file_type: LlamaFileType
    default: GGMLQuantizationType  # the tool's type for tensors no rule singles out

    @property
    def name(self) -> str:
        return self.key.upper()


def resolve_outtype(name: str, first_matrix_dtype: str | None) -> GGMLQuantizationType | KQuantFileType:
    """The requested storage type; `auto` follows the first 2-D+ source tensor (BF16, F16, else F16)."""
    name = name.lower()
    if name in KQUANT_FILE_TYPES:
        return KQuantFileType(name, *KQUANT_FILE_TYPES[name])
    if name == "auto":
        return Q.BF16 if first_matrix_dtype == "BF16" else Q.F16
    if name not in _BY_NAME:
        raise SpecconvError(f"unknown --outtype {name!r}; choose one of {', '.join(OUTTYPE_CHOICES)}")
    return _BY_NAME[name]


def lossless_type(outtype, first_matrix_dtype: str | None) -> GGMLQuantizationType:
    """The storage type the K-quant rules start from (the file llama.cpp's quantize would be given):
    the checkpoint's own precision, BF16 or F16, else F32. Other outtypes are their own."""
    if not isinstance(outtype, KQuantFileType):
        return outtype
    return {"BF16": Q.BF16, "F16": Q.F16}.get(first_matrix_dtype or "", Q.F32)


def file_type(outtype) -> int:
    """`general.file_type` for a file written with this --outtype."""
    if isinstance(outtype, KQuantFileType):
        return int(outtype.file_type)
    return int(_FILE_TYPES[outtype])


def type_label(outtype) -> str:
    """The encoding part of file names: F32, F16, BF16, Q8_0, Q4_0, Q4_K_M (as `LlamaFileType` names end)."""
    return LlamaFileType(file_type(outtype)).name.partition("_")[2]


def is_forced_f32(name: str, n_dims: int) -> bool:
    return n_dims <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or bool(_F32_PATTERN.match(name))


@dataclass(frozen=True)
class StorageChoice:
    ggml_type: GGMLQuantizationType
    note: str = ""  # why it differs from --outtype, when it does


def choose_storage(name: str, shape: tuple[int, ...], outtype: GGMLQuantizationType,
                   forced: GGMLQuantizationType | None = None) -> StorageChoice:
    """The GGML type of one tensor (`shape` in torch order)."""
    generic = _generic_storage(name, shape, outtype)
    if forced is not None and forced != generic.ggml_type:
        return StorageChoice(forced, f"{forced.name} forced by the architecture")
    return generic


def _generic_storage(name: str, shape: tuple[int, ...], outtype: GGMLQuantizationType) -> StorageChoice:
    if is_forced_f32(name, len(shape)):
        return StorageChoice(Q.F32, "" if outtype == Q.F32 else "F32 rule (1-D, norm, router, conv, non-weight)")
    block = GGML_QUANT_SIZES[outtype][0]
    if block > 1 and (not shape or shape[-1] % block):
        # gguf.quants raises QuantError here; upstream then stores F16.
        return StorageChoice(Q.F16, f"F16 fallback: rows of {shape[-1] if shape else 0} are not a multiple of "
                                    f"{block} ({outtype.name})")
    return StorageChoice(outtype)


def nbytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // block * size


INTEGER_TYPES = {Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}


def encode_integer(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Integer values -> the bytes of an integer GGUF tensor (plugins force these types, e.g. d2t I64)."""
    if values.dtype.kind not in "iu":
        raise SpecconvError(f"internal: an {ggml_type.name} tensor needs integer values, got {values.dtype}")
    return np.ascontiguousarray(values.astype(INTEGER_TYPES[ggml_type])).reshape(-1).view(np.uint8)


def encode(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """float32 values (torch order) -> the bytes GGUF stores for `ggml_type`, as a flat uint8 array."""
    from gguf import quants

    values = np.ascontiguousarray(values, dtype=np.float32)
    if ggml_type == Q.F32:
        out = values
    elif ggml_type == Q.F16:
        out = values.astype(np.float16)
    else:
        try:
            out = quants.quantize(values, ggml_type)
        except quants.QuantError as exc:  # choose_storage should have routed this tensor to F16
            raise SpecconvError(f"cannot store a tensor of shape {list(values.shape)} as {ggml_type.name}: {exc}") from None
    return np.ascontiguousarray(out).reshape(-1).view(np.uint8)
