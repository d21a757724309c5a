"""GGUF tensor names, KV keys and arch strings that the PyPI `gguf` 0.19.0 wheel lacks.

The wheel lags llama.cpp: it has no `recurrent_layers` key, no nextn tensors for the Qwen/DeepSeek
arches in its name map, and no EAGLE-3 / Gemma 4 assistant arches (docs/reference/gguf-layout.md §8). The writer
does not validate names, so specconv formats them itself from this one table. The strings are the
ones of the pinned llama.cpp tree (gguf-py/gguf/constants.py at commit 0c1e5709).

This module has no dependencies beyond the standard library, because the runtime may import it
(and only it) from `archs`.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------- arch strings

QWEN35 = "qwen35"
QWEN35MOE = "qwen35moe"
QWEN3NEXT = "qwen3next"
GLM4MOE = "glm4moe"
DEEPSEEK2 = "deepseek2"
GEMMA4 = "gemma4"
EAGLE3 = "eagle3"  # not in the wheel
GEMMA4_ASSISTANT = "gemma4-assistant"  # not in the wheel; note the hyphen


# ------------------------------------------------------------------------------- KV keys


def arch_key(arch: str, suffix: str) -> str:
    """`{arch}.{suffix}`, the form of every architecture-scoped key."""
    return f"{arch}.{suffix}"


def recurrent_layers_key(arch: str) -> str:
    """bool[block_count]: True where a block is recurrent (Gated DeltaNet), False for attention and MTP."""
    return arch_key(arch, "attention.recurrent_layers")


def nextn_predict_layers_key(arch: str) -> str:
    """u32: MTP/nextn blocks appended after the trunk (absent in trunk-only files)."""
    return arch_key(arch, "nextn_predict_layers")


def full_attention_interval_key(arch: str) -> str:
    return arch_key(arch, "full_attention_interval")


def block_count_key(arch: str) -> str:
    return arch_key(arch, "block_count")


# EAGLE-3 (arch "eagle3")
def target_layers_key(arch: str = EAGLE3) -> str:
    return arch_key(arch, "target_layers")  # i32[3]


def target_hidden_size_key(arch: str = EAGLE3) -> str:
    return arch_key(arch, "target_hidden_size")  # u32


def norm_before_residual_key(arch: str = EAGLE3) -> str:
    return arch_key(arch, "norm_before_residual")  # bool


def norm_before_fc_key(arch: str = EAGLE3) -> str:
    return arch_key(arch, "norm_before_fc")  # bool


# `{arch}.expert_gating_func` values; the wheel's enum stops at SIGMOID.
EXPERT_GATING_SOFTMAX = 1
EXPERT_GATING_SIGMOID = 2
EXPERT_GATING_SQRT_SOFTPLUS = 4


# ------------------------------------------------------------------------------- tensor names

# Per-MTP-block extras: blk.{bid}.nextn.<part>.weight (docs/reference/gguf-layout.md §4.1).
NEXTN_EH_PROJ = "eh_proj"  # {2H, H}: projection of concat(enorm(emb), hnorm(h)), embedding first
NEXTN_ENORM = "enorm"
NEXTN_HNORM = "hnorm"
NEXTN_SHARED_HEAD_NORM = "shared_head_norm"  # optional: falls back to output_norm
NEXTN_EMBED_TOKENS = "embed_tokens"  # optional: falls back to token_embd
NEXTN_SHARED_HEAD_HEAD = "shared_head_head"  # optional: falls back to output
NEXTN_PARTS = (NEXTN_EH_PROJ, NEXTN_EMBED_TOKENS, NEXTN_ENORM, NEXTN_HNORM,
               NEXTN_SHARED_HEAD_HEAD, NEXTN_SHARED_HEAD_NORM)


def nextn(bid: int, part: str, suffix: str = "weight") -> str:
    """`blk.{bid}.nextn.{part}.weight` for one of NEXTN_PARTS."""
    if part not in NEXTN_PARTS:
        raise ValueError(f"unknown nextn tensor part {part!r}")
    return f"blk.{bid}.nextn.{part}.{suffix}"


def blk(bid: int, base: str, suffix: str | None = "weight") -> str:
    """`blk.{bid}.{base}[.{suffix}]`; suffix None gives names without one (e.g. `blk.3.ssm_a`)."""
    return f"blk.{bid}.{base}" if suffix is None else f"blk.{bid}.{base}.{suffix}"


# Global tensors the wheel does not name.
EAGLE3_FC = "fc.weight"  # {3·Ht, H}
EAGLE3_D2T = "d2t"  # I64 {Vd}: absolute target ids
NEXTN_PRE_PROJECTION = "nextn.pre_projection.weight"  # gemma4-assistant {2Hb, Ha}
NEXTN_POST_PROJECTION = "nextn.post_projection.weight"  # gemma4-assistant {Ha, Hb}
MASKED_EMBD_CENTROIDS = "masked_embd_centroids.weight"
MASKED_EMBD_ORDERING = "masked_embd_ordering"

# Global tensors common to all arches (in the wheel too; repeated here so the runtime needs no map).
TOKEN_EMBD = "token_embd.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"
SHARED_TENSORS = (TOKEN_EMBD, OUTPUT_NORM, OUTPUT)  # the ones an MTP sidecar carries besides blk.N+

# Chained-MTP families (llama.cpp 0c1e570 src/llama-arch.cpp); hy_v3 is not in the wheel.
HY_V3 = "hy_v3"
STEP35 = "step35"
MIMO2 = "mimo2"

# DFlash block-diffusion drafters (llama.cpp 0c1e570: arch "dflash", gguf-py constants.py).
DFLASH = "dflash"
MASK_TOKEN_ID_KEY = "tokenizer.ggml.mask_token_id"  # u32: the token that fills a draft block
ENC_OUTPUT_NORM = "enc.output_norm.weight"  # DFlash: RMSNorm after fc (the checkpoint's hidden_norm)


def block_size_key(arch: str = DFLASH) -> str:
    return arch_key(arch, "block_size")  # u32: the trained block (anchor + masks)


def causal_key(arch: str) -> str:
    return arch_key(arch, "attention.causal")  # bool

# DeepSeek Sparse Attention families (llama.cpp 0c1e570 src/llama-arch.cpp; docs/dsa.md).
GLM_DSA = "glm-dsa"
DEEPSEEK32 = "deepseek32"  # not in the wheel


def indexer_types_key(arch: str) -> str:
    return arch_key(arch, "attention.indexer.types")  # bool[n_layer]: True where a block runs its own indexer
