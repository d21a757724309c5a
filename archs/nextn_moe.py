"""What GLM-4.5 (`glm4moe`) and DeepSeek-V3 (`deepseek2`) share: sigmoid-routed MoE with a
correction bias and expert groups, leading dense blocks, and nextn (MTP) layers stored as ordinary
`model.layers.{N+j}.*` blocks plus their `eh_proj / enorm / hnorm / shared_head.* / embed_tokens`
extras (docs/reference/gguf-layout.md §4.1, §6, §7.4, §7.5).

Subclasses supply their hyperparameters (a `NextnMoeHParams`, archs/nextn_moe_hparams.py), their table
(`nextn_moe_table` of their attention tensors and FFN-input norm, whose shapes read those
hyperparameters) and the arch-specific metadata; everything else (names, MTP count, FFN/MoE tensors,
nextn extras, common KV) lives here.
"""

from __future__ import annotations

from typing import ClassVar

from gguf import Keys

from . import names
from .base import ArchPlugin, Checkpoint, Role
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import (
    RolePlan, output_head, routed_experts, text_model_name, trunk_indexed_mtp_count,
)
from .nextn_moe_hparams import NextnMoeHParams
from .tensor_table import Hook, TensorSpec, TensorTable, expert_specs, swiglu_specs

_TOWERS = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.")
# HF nextn copies -> GGUF nextn part (docs/reference/gguf-layout.md §4.1)
NEXTN_OPTIONAL = (("embed_tokens", names.NEXTN_EMBED_TOKENS), ("shared_head.head", names.NEXTN_SHARED_HEAD_HEAD))


# ---------------------------------------------------------------------- the tensor table


def block_tags(s: NextnMoeHParams, bid: int) -> frozenset[str]:
    """dense below first_k_dense_replace, else moe (+ shared with shared experts); nextn for the MTP
    blocks; the family's attention variant (`attention_tags`)."""
    moe = s.is_moe_block(bid)
    tags = {"moe" if moe else "dense"} | s.attention_tags(bid)
    tags |= {t for t, on in (("shared", moe and s.n_shared_experts), ("nextn", bid >= s.num_hidden_layers)) if on}
    return frozenset(tags)


def norm(gguf: str, hf: str, on: str = "", dim=lambda s: (s.hidden_size,), optional: bool = False) -> TensorSpec:
    """A plain-weight RMSNorm (no +1 in these families), kept F32."""
    return TensorSpec(gguf, hf, dim, on, optional=optional, f32=True)


_MLP = "{p}mlp."
_VOCAB_ROWS = lambda s: (s.vocab_dim, s.hidden_size)  # noqa: E731  (the embedding, the head and their copies)


def nextn_moe_table(attention: tuple[TensorSpec, ...], post_attention_norm: str) -> TensorTable:
    """The table of a nextn-MoE family from its attention tensors and its FFN-input norm's GGUF name."""
    return TensorTable((
        TensorSpec(names.TOKEN_EMBD, "model.embed_tokens.weight", _VOCAB_ROWS),
        norm(names.OUTPUT_NORM, "model.norm.weight"),
        TensorSpec(names.OUTPUT, None, _VOCAB_ROWS, optional=True, hook="output_head"),  # absent when tied
        norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
        *attention,
        norm(f"blk.{{bid}}.{post_attention_norm}.weight", "{p}post_attention_layernorm.weight"),
        *swiglu_specs(_MLP, "dense"),
        TensorSpec("blk.{bid}.ffn_gate_inp.weight", _MLP + "gate.weight", lambda s: (s.num_experts, s.hidden_size),
                   "moe", f32=True),
        TensorSpec("blk.{bid}.exp_probs_b.bias", _MLP + "gate.e_score_correction.bias", lambda s: (s.num_experts,),
                   "moe", f32=True),
        *expert_specs(),
        *swiglu_specs(_MLP + "shared_experts.", "moe shared", lambda s: s.shared_intermediate_size, "_shexp"),
        # the nextn extras of every MTP block (docs/reference/gguf-layout.md §4.1); eh_proj's input is the
        # embedding half first, as in HF and llama.cpp
        TensorSpec("blk.{bid}.nextn.eh_proj.weight", "{p}eh_proj.weight", lambda s: (s.hidden_size, 2 * s.hidden_size),
                   "nextn"),
        norm("blk.{bid}.nextn.enorm.weight", "{p}enorm.weight", "nextn"),
        norm("blk.{bid}.nextn.hnorm.weight", "{p}hnorm.weight", "nextn"),
        norm("blk.{bid}.nextn.shared_head_norm.weight", "{p}shared_head.norm.weight", "nextn", optional=True),
        # copies GLM-4.5 and DeepSeek-V3 ship (GLM-4.6 does not), kept as they are when present: llama.cpp
        # prefers them over token_embd / output
        TensorSpec("blk.{bid}.nextn.embed_tokens.weight", None, _VOCAB_ROWS, "nextn", optional=True,
                   hook="nextn_copies"),
        TensorSpec("blk.{bid}.nextn.shared_head_head.weight", None, _VOCAB_ROWS, "nextn", optional=True,
                   hook="nextn_copies"),
    ), block_tags)


class NextnMoePlugin(ArchPlugin):
    """Base of the glm4moe and deepseek2 plugins."""

    mtp_as_trunk_layers: ClassVar[bool] = True  # nextn block j is model.layers.{N+j} (verify's MTP reference)
    HParams: ClassVar[type[NextnMoeHParams]]  # the family's, built from config.json (self.hp)

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.hp = self.HParams.from_config(checkpoint.config)
        self._k = self._count_mtp_layers()
        if self._k and self.hp.first_k_dense_replace > self.hp.num_hidden_layers:
            raise SpecconvError(f"config.json: first_k_dense_replace ({self.hp.first_k_dense_replace}) exceeds "
                                f"num_hidden_layers ({self.hp.num_hidden_layers}); the nextn block must be an MoE block")

    # ------------------------------------------------------------------ naming

    @classmethod
    def normalize_name(cls, raw_name: str) -> str | tuple[None, str]:
        name = text_model_name(raw_name, _TOWERS, "vision tower (belongs in a separate mmproj file)")
        if isinstance(name, str) and name.endswith("e_score_correction_bias"):
            name = name[: -len("_bias")] + ".bias"  # docs/reference/gguf-layout.md §6: -> exp_probs_b.bias
        return name

    # ------------------------------------------------------------------ structure

    @property
    def n_mtp_layers(self) -> int:
        return self._k  # the checkpoint's nextn blocks (config.json's count may name stripped ones)

    def _count_mtp_layers(self) -> int:
        """k = the layers `model.layers.{N..}` present; they must be the config's count, contiguous.

        A checkpoint without any nextn tensors converts without MTP even when config.json declares
        some: transformers' configs default to num_nextn_predict_layers=1 and its save_pretrained
        drops the nextn weights, so that config value alone does not mean they were ever there.
        """
        n = self.hp.num_hidden_layers
        k = trunk_indexed_mtp_count(self.checkpoint, n)
        configured = self.hp.num_nextn_predict_layers
        if k and k != configured:
            raise SpecconvError(f"config.json says num_nextn_predict_layers={configured}, but the checkpoint holds "
                                f"{k} nextn layer(s) (model.layers.{n}..{n + k - 1})")
        return k

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable]  # the family's (archs/glm4moe.py, deepseek2.py, dsa.py)

    def hooks(self) -> dict[str, Hook]:
        return {"output_head": output_head, "experts": routed_experts("n_routed_experts"),
                "nextn_copies": self._nextn_copies}

    def _nextn_copies(self, plan: RolePlan, s: NextnMoeHParams, bid: int, p: str, role: Role) -> None:
        shape = (s.vocab_dim, s.hidden_size)
        for hf, part in NEXTN_OPTIONAL:
            if plan.has(f"{p}{hf}.weight"):
                plan.add(names.nextn(bid, part), [plan.source(f"{p}{hf}.weight", shape)], shape, Role.MTP)

    # ------------------------------------------------------------------ metadata

    def _common_head_kv(self, w: MetadataWriter, keep_mtp: bool, num_key_value_heads: int) -> None:
        hp = self.hp
        w.text_model(hp.num_hidden_layers + (self._k if keep_mtp else 0), hp.max_position_embeddings, hp.hidden_size,
                     hp.intermediate_size, hp.num_attention_heads, num_key_value_heads, rope_scaling=hp.rope_scaling,
                     rope_theta=hp.rope_theta, rms_norm_eps=hp.rms_norm_eps,
                     experts=(hp.num_experts, hp.num_experts_per_tok), expert_groups=(hp.n_group, hp.topk_group))

    def _common_moe_kv(self, w: MetadataWriter, keep_mtp: bool) -> None:
        hp = self.hp
        w.u32(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, hp.first_k_dense_replace)
        w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.moe_intermediate_size)
        w.u32(Keys.LLM.EXPERT_SHARED_COUNT, hp.n_shared_experts)
        # Always explicit: a missing key means softmax to llama.cpp's deepseek2 (docs/reference/gguf-layout.md §7.5).
        w.u32(Keys.LLM.EXPERT_GATING_FUNC, hp.expert_gating_func)
        w.f32(Keys.LLM.EXPERT_WEIGHTS_SCALE, hp.routed_scaling_factor)
        w.flag(Keys.LLM.EXPERT_WEIGHTS_NORM, hp.norm_topk_prob)
        w.nextn(self._k if keep_mtp else 0)
