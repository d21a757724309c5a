"""One writer of a plugin's GGUF metadata: the `{arch}.*` keys in the order they are written.

Each family writes its keys in the order of llama.cpp's converter for it (the file's bytes depend on
it), so a plugin's `metadata()` still lists its keys top to bottom; the pieces every family shares
are written here once: the opening keys of llama.cpp's TextModel (block count, context length,
embedding, feed-forward and head sizes), key / value head sizes, rope scaling (linear or YaRN),
expert counts and the MTP (nextn) block count. A value of None is not written.
"""

from __future__ import annotations

from typing import Any, Sequence

from gguf import GGUFValueType, Keys

from .base import MetaKV
from .rope_scaling import RopeScaling

U32, I32, F32 = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32
BOOL, ARRAY = GGUFValueType.BOOL, GGUFValueType.ARRAY


class MetadataWriter:
    """Appends `MetaKV`s to `kv` (a new list unless one is given); key names may hold `{arch}`."""

    def __init__(self, arch: str, kv: list[MetaKV] | None = None):
        self.arch = arch
        self.kv: list[MetaKV] = [] if kv is None else kv

    def put(self, key: str, value: Any, vtype: GGUFValueType, sub: GGUFValueType | None = None) -> None:
        self.kv.append(MetaKV(key.format(arch=self.arch), value, vtype, sub))

    def u32(self, key: str, value: int | None) -> None:
        if value is not None:
            self.put(key, value, U32)

    def f32(self, key: str, value: float | None) -> None:
        if value is not None:
            self.put(key, value, F32)

    def flag(self, key: str, value: bool | None) -> None:
        if value is not None:
            self.put(key, value, BOOL)

    def array(self, key: str, values: Sequence, sub: GGUFValueType) -> None:
        self.put(key, list(values), ARRAY, sub)

    def count(self, key: str, value: int | Sequence[int] | None, array_type: GGUFValueType = U32) -> None:
        """One value, or one per block (an array of `array_type`)."""
        if isinstance(value, (list, tuple)):
            self.array(key, value, array_type)
        else:
            self.u32(key, value)

    # ---- the shared pieces ---------------------------------------------------------------------

    def text_model(self, block_count: int, context_length: int | None, embedding_length: int,
                   feed_forward_length: int | Sequence[int] | None, head_count: int | Sequence[int],
                   head_count_kv: int | Sequence[int] | None, array_type: GGUFValueType = U32, *,
                   causal: bool | None = None, rope_scaling: RopeScaling | None = None,
                   rope_sections: Sequence[int] | None = None, rope_theta: float | None = None,
                   rope_theta_swa: float | None = None, rms_norm_eps: float | None = None,
                   experts: tuple[int, int] | None = None, expert_groups: tuple[int | None, int | None] | None = None,
                   expert_gating_func: int | None = None, key_length: int | None = None,
                   value_length: int | None = None) -> None:
        """The keys llama.cpp's TextModel.set_gguf_parameters writes, in its order: block count, context,
        widths and head counts, then what the family states of these (None: not written): a causal
        flag only when false, rope scaling and M-RoPE sections, rope bases, the RMS epsilon, expert
        (count, used) and group (count, used) counts, the gating function, the head sizes (value
        length = key length unless given). A family whose converter writes a key of its own in
        between stops here and writes the rest itself."""
        self.u32(Keys.LLM.BLOCK_COUNT, block_count)
        self.u32(Keys.LLM.CONTEXT_LENGTH, context_length)
        self.u32(Keys.LLM.EMBEDDING_LENGTH, embedding_length)
        self.count(Keys.LLM.FEED_FORWARD_LENGTH, feed_forward_length, array_type)
        self.count(Keys.Attention.HEAD_COUNT, head_count, array_type)
        self.count(Keys.Attention.HEAD_COUNT_KV, head_count_kv, array_type)
        if causal is False:
            self.flag(Keys.Attention.CAUSAL, False)
        self.rope_scaling(rope_scaling)
        if rope_sections is not None:
            self.array(Keys.Rope.DIMENSION_SECTIONS, rope_sections, I32)
        self.f32(Keys.Rope.FREQ_BASE, rope_theta)
        self.f32(Keys.Rope.FREQ_BASE_SWA, rope_theta_swa)
        self.f32(Keys.Attention.LAYERNORM_RMS_EPS, rms_norm_eps)
        if experts is not None:
            self.experts(*experts)
        if expert_groups is not None:
            self.expert_groups(*expert_groups)
        self.u32(Keys.LLM.EXPERT_GATING_FUNC, expert_gating_func)
        if key_length is not None:
            self.head_sizes(key_length, value_length)

    def head_sizes(self, key_length: int, value_length: int | None = None) -> None:
        """attention.key_length and value_length (equal unless given)."""
        self.u32(Keys.Attention.KEY_LENGTH, key_length)
        self.u32(Keys.Attention.VALUE_LENGTH, key_length if value_length is None else value_length)

    def rope_scaling(self, s: RopeScaling | None) -> None:
        if s is None:
            return
        self.put(Keys.Rope.SCALING_TYPE, s.kind, GGUFValueType.STRING)
        self.f32(Keys.Rope.SCALING_FACTOR, s.factor)
        if s.kind != "yarn":
            return
        self.u32(Keys.Rope.SCALING_ORIG_CTX_LEN, s.original_context)
        self.f32(Keys.Rope.SCALING_YARN_EXT_FACTOR, s.ext_factor)
        self.f32(Keys.Rope.SCALING_YARN_ATTN_FACTOR, s.attn_factor)
        self.f32(Keys.Rope.SCALING_YARN_BETA_FAST, s.beta_fast)
        self.f32(Keys.Rope.SCALING_YARN_BETA_SLOW, s.beta_slow)

    def experts(self, count: int, used: int) -> None:
        self.u32(Keys.LLM.EXPERT_COUNT, count)
        self.u32(Keys.LLM.EXPERT_USED_COUNT, used)

    def expert_groups(self, count: int | None, used: int | None) -> None:
        self.u32(Keys.LLM.EXPERT_GROUP_COUNT, count)
        self.u32(Keys.LLM.EXPERT_GROUP_USED_COUNT, used)

    def nextn(self, n_mtp: int) -> None:
        """nextn_predict_layers, written only for a file that holds MTP blocks."""
        if n_mtp:
            self.u32(Keys.LLM.NEXTN_PREDICT_LAYERS, n_mtp)
