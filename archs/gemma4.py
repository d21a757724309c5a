"""Gemma 4 text models -> GGUF arch `gemma4`, and the Gemma 4 MTP assistant -> `gemma4-assistant`
(docs/reference/gguf-layout.md §7.6, §7.7).

Gemma 4 (`Gemma4ForConditionalGeneration`, text under `model.language_model.`; `Gemma4ForCausalLM`):
plain RMSNorm weights (no +1), the embedding trimmed to the tokenizer's real size (the √H scale is
applied by the runtime), tied head, per-layer head dims and KV-head counts (sliding layers use
`head_dim` / `num_key_value_heads`; full layers `global_head_dim` / `num_global_key_value_heads` in
Hub configs, or `per_layer_config` in transformers-5 saves), K/V-sharing tail layers without
k/v tensors, `attention_k_eq_v` (no v_proj on full layers), per-layer inputs (PLE), the layer output
scalar, a synthesised `rope_freqs` that turns llama.cpp's full NEOX rope into proportional rope, and
the MoE variant (router with its scale and per-expert scale, fused experts, the extra norms).

The assistant (`Gemma4AssistantForCausalLM`) is always its own file: every layer is a draft layer
(`nextn_predict_layers = block_count`), it has no K/V tensors (it reads the target's), its own
embedding is the tied LM head, and `embedding_length_out` carries the backbone (target) width.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import ClassVar

from gguf import GGUFValueType, Keys

from . import names, register
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, MetaKV, Role, embedding_rows
from .errors import SpecconvError
from .gemma4_hparams import FULL, Gemma4AssistantHParams, Gemma4HParams
from .metadata import MetadataWriter
from .plan_tools import RolePlan, text_model_name
from .tensor_table import Block, Hook, TensorSpec, TensorTable, read_by, swiglu_specs

ROPE_FREQS = "rope_freqs.weight"
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
           "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")


def checkpoint_vocab_size(checkpoint: Checkpoint) -> int:
    """The vocabulary a file gets: the embedding's rows, trimmed to the tokenizer's real size."""
    rows = embedding_rows(checkpoint)
    real = real_vocab_size(checkpoint.source_dir)
    return min(rows, real) if real else rows


def real_vocab_size(model_dir: str | Path | None) -> int | None:
    """Tokens the tokenizer really has (ids of tokenizer.json's vocab and added tokens), or None."""
    if model_dir is None:
        return None
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids = set(int(i) for i in (data.get("model") or {}).get("vocab", {}).values())
        ids |= {int(t["id"]) for t in data.get("added_tokens") or []}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SpecconvError(f"tokenizer.json cannot be read ({exc})") from None
    return max(ids) + 1 if ids else None


def _one_or_list(values: list[int]) -> int | list[int]:
    """A per-block key as one value when every block has it (llama.cpp reads either form)."""
    return list(values) if len(set(values)) > 1 else values[0]


def _normalize(raw: str):
    return text_model_name(raw, _TOWERS, "vision/audio tower (belongs in an mmproj file)")


def block_sizes(s: Gemma4HParams, bid: int) -> Gemma4HParams:
    """One block's hparams: its head size, KV-head count and FFN width."""
    return replace(s, head_dim=s.head_dim[bid], num_key_value_heads=s.num_key_value_heads[bid],
                   intermediate_size=s.intermediate_size[bid])


def block_tags(s: Gemma4HParams, bid: int) -> frozenset[str]:
    """K/V-owning blocks hold k (and v); trunk blocks hold the per-layer inputs and the MoE branch."""
    tags = {"kv"} if s.owns_kv(bid) else set()
    if bid < s.num_hidden_layers:
        tags |= ({"ple"} if s.hidden_size_per_layer_input else set()) | ({"moe"} if s.num_experts else set())
    return frozenset(tags)


def global_tags(s: Gemma4HParams) -> frozenset[str]:
    return frozenset({"ple"} if s.hidden_size_per_layer_input else set())


def _norm(gguf: str, hf: str | None, dim=lambda s: (s.hidden_size,), on: str = "", **kw) -> TensorSpec:
    return TensorSpec(gguf, hf, dim, on, f32=True, **kw)  # plain RMSNorm weights, kept F32


def _ple_all(s: Gemma4HParams) -> int:
    """Width of every trunk layer's per-layer input side by side."""
    return s.num_hidden_layers * s.hidden_size_per_layer_input


_ATTN, _MLP = "{p}self_attn.", "{p}mlp."
BLOCK_SPECS = (
    _norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
    TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.hidden_size)),
    _norm("blk.{bid}.attn_q_norm.weight", _ATTN + "q_norm.weight", lambda s: (s.head_dim,)),
    TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.hidden_size), "kv"),
    # absent on the full layers of attention_k_eq_v models (v is k there): the plugin's hook decides
    TensorSpec("blk.{bid}.attn_v.weight", None, lambda s: (s.kv, s.hidden_size), "kv", optional=True, hook="attn_v"),
    _norm("blk.{bid}.attn_k_norm.weight", _ATTN + "k_norm.weight", lambda s: (s.head_dim,), "kv"),
    TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.hidden_size, s.q)),
    _norm("blk.{bid}.post_attention_norm.weight", "{p}post_attention_layernorm.weight"),
    _norm("blk.{bid}.ffn_norm.weight", "{p}pre_feedforward_layernorm.weight"),
    _norm("blk.{bid}.post_ffw_norm.weight", "{p}post_feedforward_layernorm.weight"),
    *swiglu_specs(_MLP),
    TensorSpec("blk.{bid}.layer_output_scale.weight", "{p}layer_scalar", lambda s: (1,), f32=True),
    TensorSpec("blk.{bid}.inp_gate.weight", "{p}per_layer_input_gate.weight",
               lambda s: (s.hidden_size_per_layer_input, s.hidden_size), "ple"),
    TensorSpec("blk.{bid}.proj.weight", "{p}per_layer_projection.weight",
               lambda s: (s.hidden_size, s.hidden_size_per_layer_input), "ple"),
    _norm("blk.{bid}.post_norm.weight", "{p}post_per_layer_input_norm.weight", on="ple"),
    TensorSpec("blk.{bid}.ffn_gate_inp.weight", "{p}router.proj.weight", lambda s: (s.num_experts, s.hidden_size),
               "moe", f32=True),
    TensorSpec("blk.{bid}.ffn_gate_inp.scale", "{p}router.scale", lambda s: (s.hidden_size,), "moe", f32=True),
    TensorSpec("blk.{bid}.ffn_down_exps.scale", "{p}router.per_expert_scale", lambda s: (s.num_experts,), "moe",
               f32=True),
    # fused gate|up as the checkpoint has them; split gate and up only in other converters' files
    TensorSpec("blk.{bid}.ffn_gate_up_exps.weight", "{p}experts.gate_up_proj",
               lambda s: (s.num_experts, 2 * s.moe_intermediate_size, s.hidden_size), "moe", optional=True),
    TensorSpec("blk.{bid}.ffn_gate_exps.weight", None,
               lambda s: (s.num_experts, s.moe_intermediate_size, s.hidden_size), "moe", optional=True),
    TensorSpec("blk.{bid}.ffn_up_exps.weight", None,
               lambda s: (s.num_experts, s.moe_intermediate_size, s.hidden_size), "moe", optional=True),
    TensorSpec("blk.{bid}.ffn_down_exps.weight", "{p}experts.down_proj",
               lambda s: (s.num_experts, s.hidden_size, s.moe_intermediate_size), "moe"),
    _norm("blk.{bid}.pre_ffw_norm_2.weight", "{p}pre_feedforward_layernorm_2.weight", on="moe"),
    _norm("blk.{bid}.post_ffw_norm_1.weight", "{p}post_feedforward_layernorm_1.weight", on="moe"),
    _norm("blk.{bid}.post_ffw_norm_2.weight", "{p}post_feedforward_layernorm_2.weight", on="moe"),
)
# the embedding, trimmed to the tokenizer's real size, is the tied head (the plugin's hook)
_EMBEDDING = TensorSpec(names.TOKEN_EMBD, None, lambda s: (s.vocab_dim, s.hidden_size), hook="embedding",
                        role=Role.TRUNK)
_OUTPUT_NORM = _norm(names.OUTPUT_NORM, "model.norm.weight", role=Role.TRUNK)
# synthesised: proportional rope for llama.cpp's full NEOX rope (docs/reference/gguf-layout.md §7.6)
_ROPE_FREQS = TensorSpec(ROPE_FREQS, None, lambda s: (s.rope_freqs_length,), f32=True, hook="rope_freqs",
                         role=Role.TRUNK)

GEMMA4_TABLE = TensorTable((  # one file, every tensor Role.TRUNK (no MTP routing)
    _EMBEDDING,
    TensorSpec(names.OUTPUT, None, lambda s: (s.vocab_dim, s.hidden_size), optional=True,
               role=Role.TRUNK),  # other converters'
    TensorSpec("per_layer_token_embd.weight", None, lambda s: (s.per_layer_vocab_dim, _ple_all(s)), "ple",
               hook="ple_embedding", role=Role.TRUNK),  # trimmed to the vocabulary, as llama.cpp sizes it
    TensorSpec("per_layer_model_proj.weight", "model.per_layer_model_projection.weight",
               lambda s: (_ple_all(s), s.hidden_size), "ple", role=Role.TRUNK),
    _norm("per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight",
          lambda s: (s.hidden_size_per_layer_input,), "ple", role=Role.TRUNK),
    _OUTPUT_NORM,
    _ROPE_FREQS,
) + BLOCK_SPECS, block_tags, global_tags, block_sizes)


# The assistant: one file the runtime serves as MTP only, its blocks reading the target's K/V.
ASSISTANT_TABLE = TensorTable(read_by("mtp", (
    _EMBEDDING,
    TensorSpec(names.NEXTN_PRE_PROJECTION, "pre_projection.weight",
               lambda s: (s.hidden_size, 2 * s.backbone_hidden_size), role=Role.TRUNK),
    TensorSpec(names.NEXTN_POST_PROJECTION, "post_projection.weight",
               lambda s: (s.backbone_hidden_size, s.hidden_size), role=Role.TRUNK),
    _OUTPUT_NORM,
    _ROPE_FREQS,
) + BLOCK_SPECS), block_tags, global_tags, block_sizes)


class _Gemma4Base(ArchPlugin):
    tokenizer_model: ClassVar[str] = "gemma4"
    tokenizer_pre: ClassVar[str] = "gemma4"  # not written: llama.cpp forces it for this model
    HParams: ClassVar[type[Gemma4HParams]]
    table: ClassVar[TensorTable]

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        hp = self.HParams.from_config(checkpoint.config)
        self.hp = replace(hp, vocab_size=checkpoint_vocab_size(checkpoint))  # the tokenizer's, not config.json's

    def vocab_size(self) -> int:
        return self.hp.vocab_size

    # ---- the tables' hooks -----------------------------------------------------------------
    def blocks(self) -> list[Block]:
        """Every block in the one file (the assistant's draft blocks too): no trunk / MTP routing."""
        return [Block(i, self.block_prefix(i), Role.TRUNK) for i in range(self.hp.n_blocks)]

    def hooks(self) -> dict[str, Hook]:
        return {"embedding": self._embedding, "rope_freqs": self._rope_freqs, "attn_v": self._attn_v,
                "ple_embedding": self._ple_embedding}

    def ignored_sources(self) -> list[str]:
        # K/V-sharing layers' own k/v: transformers drops them on load; a checkpoint may still carry them
        return [f"{self.block_prefix(i)}self_attn.{extra}" for i in range(self.hp.n_blocks) if not self.hp.owns_kv(i)
                for extra in ("k_proj.weight", "v_proj.weight", "k_norm.weight")]

    def _embedding(self, plan: RolePlan, s: Gemma4HParams, bid: None, p: str, role: Role) -> None:
        info = self.checkpoint.tensors.get("model.embed_tokens.weight")
        rows = int(info.shape[0]) if info is not None else s.vocab_size
        src = plan.source("model.embed_tokens.weight", (rows, s.hidden_size))
        plan.add(names.TOKEN_EMBD, [src], (s.vocab_size, s.hidden_size), role,
                 partial(tf.slice_axis, dim=0, start=0, stop=s.vocab_size))
        if plan.has("lm_head.weight"):  # tied: the loader duplicates token_embd as the head
            plan.used.add("lm_head.weight")

    def _rope_freqs(self, plan: RolePlan, s: Gemma4HParams, bid: None, p: str, role: Role) -> None:
        values = s.rope_freq_factors()
        plan.add(ROPE_FREQS, ["model.norm.weight"], (len(values),), role, partial(tf.constant, values=values), f32=True)

    def _attn_v(self, plan: RolePlan, s: Gemma4HParams, bid: int, p: str, role: Role) -> None:
        if not (s.attention_k_eq_v and s.layer_types[bid] == FULL):
            kv = (s.kv, s.hidden_size)
            plan.add(names.blk(bid, "attn_v"), [plan.source(p + "self_attn.v_proj.weight", kv)], kv, role)

    def _ple_embedding(self, plan: RolePlan, s: Gemma4HParams, bid: None, p: str, role: Role) -> None:
        hf, width = "model.embed_tokens_per_layer.weight", _ple_all(s)
        info = self.checkpoint.tensors.get(hf)
        rows = int(info.shape[0]) if info is not None else s.vocab_size  # absent: plan.source names it
        if rows < s.vocab_size:
            raise SpecconvError(f"the per-layer embedding has {rows} rows, fewer than the {s.vocab_size} tokens")
        plan.add("per_layer_token_embd.weight", [plan.source(hf, (rows, width))], (s.per_layer_vocab_dim, width),
                 role, partial(tf.slice_axis, dim=0, start=0, stop=s.vocab_size))

    # ---- metadata -------------------------------------------------------------------------
    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        hp = self.hp
        w = MetadataWriter(self.gguf_arch)
        w.text_model(hp.n_blocks, hp.max_position_embeddings, hp.hidden_size, _one_or_list(hp.intermediate_size),
                     hp.num_attention_heads, _one_or_list(hp.num_key_value_heads), rope_theta=hp.rope_theta,
                     rope_theta_swa=hp.sliding_rope_theta, rms_norm_eps=hp.rms_norm_eps,
                     experts=(hp.num_experts, hp.num_experts_per_tok) if hp.num_experts else None)
        if hp.num_experts:  # before the head sizes, in the upstream converter's order
            w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.moe_intermediate_size)
        w.head_sizes(hp.global_head_dim)
        w.u32(Keys.Attention.KEY_LENGTH_SWA, hp.sliding_head_dim)
        w.u32(Keys.Attention.VALUE_LENGTH_SWA, hp.sliding_head_dim)
        w.f32(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, hp.final_logit_softcapping)
        w.u32(Keys.Attention.SLIDING_WINDOW, hp.sliding_window)
        w.u32(Keys.Attention.SHARED_KV_LAYERS, hp.num_kv_shared_layers)
        w.u32(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, hp.hidden_size_per_layer_input)
        w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, [hp.is_sliding(i) for i in range(hp.n_blocks)],
                GGUFValueType.BOOL)
        w.u32(Keys.Rope.DIMENSION_COUNT, hp.global_head_dim)
        w.u32(Keys.Rope.DIMENSION_COUNT_SWA, hp.sliding_rotary_dim)
        return w.kv


@register
class Gemma4(_Gemma4Base):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM")
    gguf_arch: ClassVar[str] = names.GEMMA4
    hf_reference: ClassVar[dict[str, str]] = {  # a release in its own class: Gemma4ForCausalLM would
        "Gemma4ForConditionalGeneration": "Gemma4ForConditionalGeneration",  # random-initialise it
        "Gemma4ForCausalLM": "Gemma4ForCausalLM"}  # (docs/reference/peers.md §2.5)
    family: ClassVar[str] = "gemma4"
    HParams: ClassVar[type[Gemma4HParams]] = Gemma4HParams
    table: ClassVar[TensorTable] = GEMMA4_TABLE

    @classmethod
    def normalize_name(cls, raw_name: str):
        return _normalize(raw_name)



@register
class Gemma4Assistant(_Gemma4Base):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Gemma4AssistantForCausalLM",)
    gguf_arch: ClassVar[str] = names.GEMMA4_ASSISTANT
    family: ClassVar[str] = "gemma4-assistant"
    standalone_drafter: ClassVar[bool] = True  # the whole file drafts: no trunk/MTP split, no notice about it
    HParams: ClassVar[type[Gemma4HParams]] = Gemma4AssistantHParams
    table: ClassVar[TensorTable] = ASSISTANT_TABLE

    @classmethod
    def normalize_name(cls, raw_name: str):
        if raw_name.startswith("masked_embedding."):
            return (None, "ordered-embedding centroids (llama.cpp scores the full vocabulary)")
        return _normalize(raw_name)

    @property
    def n_mtp_layers(self) -> int:
        return 0  # the whole file is the drafter (its hparams' num_hidden_layers is 0); there is no trunk/MTP split to route

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        w = MetadataWriter(self.gguf_arch, super().metadata(keep_mtp))
        w.u32(Keys.LLM.EMBEDDING_LENGTH_OUT, self.hp.backbone_hidden_size)
        w.nextn(self.hp.num_nextn_predict_layers)  # the whole assistant is one drafter of N blocks
        return w.kv
