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
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import ClassVar

from gguf import GGUFValueType, Keys

from . import names, register
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import RolePlan, text_model_name
from .tensor_table import Block, TensorSpec, TensorTable, read_by

ROPE_FREQS = "rope_freqs.weight"
SLIDING, FULL = "sliding_attention", "full_attention"
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
           "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")


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


class Gemma4Hparams:
    """Per-layer structure of a Gemma 4 text config, from either config form."""

    def __init__(self, cfg: ConfigReader):
        self.H = cfg.integer("hidden_size", min=1)
        self.F = cfg.integer("intermediate_size")
        self.N = cfg.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        self.num_attention_heads = cfg.integer("num_attention_heads", min=1)
        self.hd_swa = cfg.integer("head_dim", default=256, min=1) or 256
        self.nkv_swa = cfg.integer("num_key_value_heads", default=self.num_attention_heads, min=1)
        types = cfg.strings("layer_types", default=None)
        if not types:
            types = [SLIDING if (i + 1) % 6 else FULL for i in range(self.N)]  # transformers' default 5:1
        if len(types) != self.N or any(t not in (SLIDING, FULL) for t in types):
            raise SpecconvError(f"config.json layer_types must list {self.N} of {SLIDING!r} / {FULL!r}")
        self.types = list(types)
        self.k_eq_v = cfg.flag("attention_k_eq_v", default=False)
        per_layer = _per_layer_config(cfg.section("per_layer_config"))
        hd_full = cfg.integer("global_head_dim", default=None, min=1)
        # transformers' gate
        nkv_full = cfg.integer("num_global_key_value_heads", default=None, min=1) if self.k_eq_v else None
        self.hd, self.nkv = [], []
        none = ConfigReader({})
        for i, t in enumerate(self.types):
            over = per_layer.get(i, none)
            if t == FULL:
                hd = over.integer("head_dim", default=None, min=1) or hd_full or (512 if not per_layer else self.hd_swa)
                nkv = over.integer("num_key_value_heads", default=None, min=1) or nkv_full or self.nkv_swa
            else:
                hd = over.integer("head_dim", default=None, min=1) or self.hd_swa
                nkv = over.integer("num_key_value_heads", default=None, min=1) or self.nkv_swa
            if self.num_attention_heads % nkv:
                raise SpecconvError(f"layer {i}: {self.num_attention_heads} heads are not a multiple of {nkv} KV heads")
            self.hd.append(hd)
            self.nkv.append(nkv)
        full = [i for i, t in enumerate(self.types) if t == FULL]
        self.hd_full = self.hd[full[0]] if full else self.hd_swa
        self.nkv_full = self.nkv[full[0]] if full else self.nkv_swa
        if any(self.hd[i] != self.hd_full for i in full) or any(self.nkv[i] != self.nkv_full for i in full):
            raise SpecconvError("full-attention layers with different head dims or KV heads are not supported")
        self.n_shared = cfg.integer("num_kv_shared_layers", default=0)
        if not 0 <= self.n_shared <= self.N:
            raise SpecconvError(f"num_kv_shared_layers {self.n_shared} is outside 0..{self.N}")
        self.P = cfg.integer("hidden_size_per_layer_input", default=0)
        self.V_ple = cfg.integer("vocab_size_per_layer_input", default=0)
        self.double_wide = cfg.flag("use_double_wide_mlp", default=False)
        self.moe = cfg.flag("enable_moe_block", default=False)
        if self.moe:
            if not cfg.has("num_experts") or not cfg.has("top_k_experts") or \
                    not cfg.has("moe_intermediate_size", "expert_intermediate_size"):
                raise SpecconvError("a Gemma 4 MoE config needs num_experts, top_k_experts and "
                                    "moe_intermediate_size")
            self.E, self.k_used = cfg.integer("num_experts", min=1), cfg.integer("top_k_experts", min=1)
            self.Fe = cfg.integer("moe_intermediate_size", "expert_intermediate_size", min=1)
        rope = cfg.section("rope_parameters")
        full_rope, swa_rope = rope.section(FULL), rope.section(SLIDING)
        if full_rope.data:
            kind = full_rope.string("rope_type", default="default")
            self.rope_theta = full_rope.number("rope_theta", default=1_000_000.0)
            self.rope_factor = full_rope.number("partial_rotary_factor", default=1.0)
        else:  # transformers' default: proportional rope over a quarter of the head
            kind, self.rope_theta, self.rope_factor = "proportional", 1_000_000.0, 0.25
        if kind not in ("default", "proportional"):
            raise SpecconvError(f"full-attention rope type {kind!r} is not supported")
        self.rope_theta_swa = swa_rope.number("rope_theta", default=10_000.0)
        self.rope_factor_swa = swa_rope.number("partial_rotary_factor", default=1.0)
        if cfg.has("attn_logit_softcapping"):
            raise SpecconvError("attn_logit_softcapping is not supported by the gemma4 GGUF layout")
        if cfg.raw("use_bidirectional_attention") == "all":
            raise SpecconvError("use_bidirectional_attention='all' models are not causal language models")
        self.context_length = cfg.integer("max_position_embeddings", default=131072, min=1) or 131072
        self.rms_eps = cfg.number("rms_norm_eps", default=1e-6)
        self.final_softcap = cfg.number("final_logit_softcapping", default=None) or None
        self.sliding_window = cfg.integer("sliding_window", default=512, min=1) or 512

    def owns_kv(self, i: int) -> bool:
        return i < self.N - self.n_shared

    def ffn_width(self, i: int) -> int:
        return self.F * (2 if self.double_wide and not self.owns_kv(i) else 1)

    def rope_freq_factors(self) -> tuple[float, ...]:
        """1 for the rotated pairs of a full layer, 1e30 (θ → 0) for the rest (docs/reference/gguf-layout.md §7.6)."""
        half = self.hd_full // 2
        rotary_dim = int(self.hd_full * self.rope_factor / 2)
        return (1.0,) * rotary_dim + (1e30,) * (half - rotary_dim)


def _per_layer_config(section: ConfigReader) -> dict[int, ConfigReader]:
    """`per_layer_config` (transformers' form): layer number -> that layer's overrides."""
    out = {}
    for key in section.data:
        try:
            layer = int(key)
        except ValueError:
            raise section.error(key, "is not a layer number") from None
        out[layer] = section.section(key)
    return out


def _normalize(raw: str):
    return text_model_name(raw, _TOWERS, "vision/audio tower (belongs in an mmproj file)")


@dataclass(frozen=True)
class Sizes:
    """The dimensions of the Gemma 4 tables: the plugins' from config.json, the graphs' from GGUF
    metadata (runtime/graphs/gemma4.py, V = "V"). Head sizes, KV heads and FFN widths are per block;
    `block_sizes` gives a block its own (`head_dim`, `n_head_kv`, `ffn`)."""

    num_hidden_layers: int  # trunk blocks (0 for the assistant, whose blocks all draft)
    E: int  # hidden size
    V: int | str  # vocabulary
    num_attention_heads: int
    head_dims: tuple[int, ...]  # per block
    kv_heads: tuple[int, ...]
    ffns: tuple[int, ...]
    owns_kv: tuple[bool, ...]  # the block has its own K/V (not a sharing tail layer, not the assistant)
    rope_half: int | str  # rope_freqs entries: half the full-attention head ("R" in a file without full layers)
    P: int = 0  # per-layer input (PLE) width
    Vp: int | str = 0  # per-layer embedding rows
    num_experts: int = 0
    expert_ffn: int = 0
    Eo: int = 0  # assistant: the target's hidden size
    head_dim: int = 0  # of one block (block_sizes)
    num_key_value_heads: int = 0
    ffn: int = 0


def block_sizes(s: Sizes, bid: int) -> Sizes:
    return replace(s, head_dim=s.head_dims[bid], num_key_value_heads=s.kv_heads[bid], ffn=s.ffns[bid])


def block_tags(s: Sizes, bid: int) -> frozenset[str]:
    """K/V-owning blocks hold k (and v); trunk blocks hold the per-layer inputs and the MoE branch."""
    tags = {"kv"} if s.owns_kv[bid] else set()
    if bid < s.num_hidden_layers:
        tags |= ({"ple"} if s.P else set()) | ({"moe"} if s.num_experts else set())
    return frozenset(tags)


def global_tags(s: Sizes) -> frozenset[str]:
    return frozenset({"ple"} if s.P else set())


def _norm(gguf: str, hf: str | None, dim=lambda s: (s.E,), on: str = "", **kw) -> TensorSpec:
    return TensorSpec(gguf, hf, dim, on, f32=True, **kw)  # plain RMSNorm weights, kept F32


_ATTN, _MLP = "{p}self_attn.", "{p}mlp."
BLOCK_SPECS = (
    _norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
    TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.num_attention_heads * s.head_dim, s.E)),
    _norm("blk.{bid}.attn_q_norm.weight", _ATTN + "q_norm.weight", lambda s: (s.head_dim,)),
    TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.num_key_value_heads * s.head_dim, s.E), "kv"),
    # absent on the full layers of attention_k_eq_v models (v is k there): the plugin's hook decides
    TensorSpec("blk.{bid}.attn_v.weight", None, lambda s: (s.num_key_value_heads * s.head_dim, s.E), "kv", optional=True,
               hook="attn_v"),
    _norm("blk.{bid}.attn_k_norm.weight", _ATTN + "k_norm.weight", lambda s: (s.head_dim,), "kv"),
    TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.E, s.num_attention_heads * s.head_dim)),
    _norm("blk.{bid}.post_attention_norm.weight", "{p}post_attention_layernorm.weight"),
    _norm("blk.{bid}.ffn_norm.weight", "{p}pre_feedforward_layernorm.weight"),
    _norm("blk.{bid}.post_ffw_norm.weight", "{p}post_feedforward_layernorm.weight"),
    TensorSpec("blk.{bid}.ffn_gate.weight", _MLP + "gate_proj.weight", lambda s: (s.ffn, s.E)),
    TensorSpec("blk.{bid}.ffn_up.weight", _MLP + "up_proj.weight", lambda s: (s.ffn, s.E)),
    TensorSpec("blk.{bid}.ffn_down.weight", _MLP + "down_proj.weight", lambda s: (s.E, s.ffn)),
    TensorSpec("blk.{bid}.layer_output_scale.weight", "{p}layer_scalar", lambda s: (1,), f32=True),
    TensorSpec("blk.{bid}.inp_gate.weight", "{p}per_layer_input_gate.weight", lambda s: (s.P, s.E), "ple"),
    TensorSpec("blk.{bid}.proj.weight", "{p}per_layer_projection.weight", lambda s: (s.E, s.P), "ple"),
    _norm("blk.{bid}.post_norm.weight", "{p}post_per_layer_input_norm.weight", on="ple"),
    TensorSpec("blk.{bid}.ffn_gate_inp.weight", "{p}router.proj.weight", lambda s: (s.num_experts, s.E), "moe",
               f32=True),
    TensorSpec("blk.{bid}.ffn_gate_inp.scale", "{p}router.scale", lambda s: (s.E,), "moe", f32=True),
    TensorSpec("blk.{bid}.ffn_down_exps.scale", "{p}router.per_expert_scale", lambda s: (s.num_experts,), "moe",
               f32=True),
    # fused gate|up as the checkpoint has them; split gate and up only in other converters' files
    TensorSpec("blk.{bid}.ffn_gate_up_exps.weight", "{p}experts.gate_up_proj",
               lambda s: (s.num_experts, 2 * s.expert_ffn, s.E), "moe", optional=True),
    TensorSpec("blk.{bid}.ffn_gate_exps.weight", None, lambda s: (s.num_experts, s.expert_ffn, s.E), "moe",
               optional=True),
    TensorSpec("blk.{bid}.ffn_up_exps.weight", None, lambda s: (s.num_experts, s.expert_ffn, s.E), "moe",
               optional=True),
    TensorSpec("blk.{bid}.ffn_down_exps.weight", "{p}experts.down_proj", lambda s: (s.num_experts, s.E, s.expert_ffn),
               "moe"),
    _norm("blk.{bid}.pre_ffw_norm_2.weight", "{p}pre_feedforward_layernorm_2.weight", on="moe"),
    _norm("blk.{bid}.post_ffw_norm_1.weight", "{p}post_feedforward_layernorm_1.weight", on="moe"),
    _norm("blk.{bid}.post_ffw_norm_2.weight", "{p}post_feedforward_layernorm_2.weight", on="moe"),
)
# the embedding, trimmed to the tokenizer's real size, is the tied head (the plugin's hook)
_EMBEDDING = TensorSpec(names.TOKEN_EMBD, None, lambda s: (s.V, s.E), hook="embedding", role=Role.TRUNK)
_OUTPUT_NORM = _norm(names.OUTPUT_NORM, "model.norm.weight", role=Role.TRUNK)
# synthesised: proportional rope for llama.cpp's full NEOX rope (docs/reference/gguf-layout.md §7.6)
_ROPE_FREQS = TensorSpec(ROPE_FREQS, None, lambda s: (s.rope_half,), f32=True, hook="rope_freqs", role=Role.TRUNK)

GEMMA4_TABLE = TensorTable((  # one file, every tensor Role.TRUNK (no MTP routing)
    _EMBEDDING,
    TensorSpec(names.OUTPUT, None, lambda s: (s.V, s.E), optional=True, role=Role.TRUNK),  # other converters'
    TensorSpec("per_layer_token_embd.weight", None, lambda s: (s.Vp, s.num_hidden_layers * s.P), "ple", hook="ple_embedding",
               role=Role.TRUNK),  # trimmed to the vocabulary, as llama.cpp sizes it
    TensorSpec("per_layer_model_proj.weight", "model.per_layer_model_projection.weight",
               lambda s: (s.num_hidden_layers * s.P, s.E), "ple", role=Role.TRUNK),
    _norm("per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight", lambda s: (s.P,), "ple",
          role=Role.TRUNK),
    _OUTPUT_NORM,
    _ROPE_FREQS,
) + BLOCK_SPECS, block_tags, global_tags, block_sizes)


# The assistant: one file the runtime serves as MTP only, its blocks reading the target's K/V.
ASSISTANT_TABLE = TensorTable(read_by("mtp", (
    _EMBEDDING,
    TensorSpec(names.NEXTN_PRE_PROJECTION, "pre_projection.weight", lambda s: (s.E, 2 * s.Eo), role=Role.TRUNK),
    TensorSpec(names.NEXTN_POST_PROJECTION, "post_projection.weight", lambda s: (s.Eo, s.E), role=Role.TRUNK),
    _OUTPUT_NORM,
    _ROPE_FREQS,
) + BLOCK_SPECS), block_tags, global_tags, block_sizes)


class _Gemma4Base(ArchPlugin):
    tokenizer_model: ClassVar[str] = "gemma4"
    tokenizer_pre: ClassVar[str] = "gemma4"  # not written: llama.cpp forces it for this model

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.cfg = ConfigReader(checkpoint.config).text_model()
        self.hp = Gemma4Hparams(self.cfg)

    def vocab_size(self) -> int:
        info = self.checkpoint.tensors.get("model.embed_tokens.weight")
        if info is None:
            raise SpecconvError("checkpoint lacks tensor model.embed_tokens.weight")
        rows = int(info.shape[0])
        real = real_vocab_size(self.checkpoint.source_dir)
        return min(rows, real) if real else rows

    # ---- the tables' hooks -----------------------------------------------------------------
    def sizes(self, num_hidden_layers: int, owns_kv) -> Sizes:
        hp = self.hp
        moe = hp.moe and num_hidden_layers
        return Sizes(num_hidden_layers=num_hidden_layers, E=hp.H, V=self.vocab_size(), num_attention_heads=hp.num_attention_heads, head_dims=tuple(hp.hd),
                     kv_heads=tuple(hp.nkv), ffns=tuple(hp.ffn_width(i) for i in range(hp.N)),
                     owns_kv=tuple(owns_kv(i) for i in range(hp.N)), rope_half=hp.hd_full // 2, P=hp.P,
                     Vp=self.vocab_size(), num_experts=hp.E if moe else 0, expert_ffn=hp.Fe if moe else 0)

    def _plan(self, table: TensorTable, s: Sizes, **hooks) -> list[TensorPlan]:
        plan = RolePlan(self.checkpoint.tensors)
        blocks = [Block(i, f"model.layers.{i}.", Role.TRUNK) for i in range(self.hp.N)]
        table.plan(plan, s, blocks, {"embedding": self._embedding, "rope_freqs": self._rope_freqs, **hooks})
        for i in range(self.hp.N):
            if not s.owns_kv[i]:  # transformers drops these on load; a checkpoint may still carry them
                for extra in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
                    if plan.has(f"model.layers.{i}.self_attn.{extra}"):
                        plan.used.add(f"model.layers.{i}.self_attn.{extra}")
        return plan.finish(self.gguf_arch)

    def _embedding(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        info = self.checkpoint.tensors.get("model.embed_tokens.weight")
        rows = int(info.shape[0]) if info is not None else s.V
        src = plan.source("model.embed_tokens.weight", (rows, s.E))
        plan.add(names.TOKEN_EMBD, [src], (s.V, s.E), role, partial(tf.slice_axis, dim=0, start=0, stop=s.V))
        if plan.has("lm_head.weight"):  # tied: the loader duplicates token_embd as the head
            plan.used.add("lm_head.weight")

    def _rope_freqs(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        values = self.hp.rope_freq_factors()
        plan.add(ROPE_FREQS, ["model.norm.weight"], (len(values),), role, partial(tf.constant, values=values), f32=True)

    # ---- metadata -------------------------------------------------------------------------
    def _kv(self, arch: str, vocab_size: int) -> list[MetaKV]:
        hp = self.hp
        w = MetadataWriter(arch)
        ffn = [hp.ffn_width(i) for i in range(hp.N)] if hp.double_wide and hp.n_shared else hp.F
        w.text_model(hp.N, hp.context_length, hp.H, ffn, hp.num_attention_heads,
                     list(hp.nkv) if len(set(hp.nkv)) > 1 else hp.nkv[0])
        w.f32(Keys.Rope.FREQ_BASE, hp.rope_theta)
        w.f32(Keys.Rope.FREQ_BASE_SWA, hp.rope_theta_swa)
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, hp.rms_eps)
        if hp.moe:
            w.experts(hp.E, hp.k_used)
            w.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, hp.Fe)
        w.head_sizes(hp.hd_full)
        w.u32(Keys.Attention.KEY_LENGTH_SWA, hp.hd_swa)
        w.u32(Keys.Attention.VALUE_LENGTH_SWA, hp.hd_swa)
        if hp.final_softcap:
            w.f32(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, hp.final_softcap)
        w.u32(Keys.Attention.SLIDING_WINDOW, hp.sliding_window)
        w.u32(Keys.Attention.SHARED_KV_LAYERS, hp.n_shared)
        w.u32(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, hp.P)
        w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, [t == SLIDING for t in hp.types], GGUFValueType.BOOL)
        w.u32(Keys.Rope.DIMENSION_COUNT, hp.hd_full)
        w.u32(Keys.Rope.DIMENSION_COUNT_SWA, int(hp.hd_swa * hp.rope_factor_swa))
        return w.kv


@register
class Gemma4(_Gemma4Base):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM")
    gguf_arch: ClassVar[str] = names.GEMMA4
    hf_reference: ClassVar[dict[str, str]] = {  # a release in its own class: Gemma4ForCausalLM would
        "Gemma4ForConditionalGeneration": "Gemma4ForConditionalGeneration",  # random-initialise it
        "Gemma4ForCausalLM": "Gemma4ForCausalLM"}  # (docs/reference/peers.md §2.5)
    family: ClassVar[str] = "gemma4"

    @classmethod
    def normalize_name(cls, raw_name: str):
        return _normalize(raw_name)

    @property
    def n_trunk_layers(self) -> int:
        return self.hp.N

    @property
    def n_mtp_layers(self) -> int:
        return 0

    table: ClassVar[TensorTable] = GEMMA4_TABLE

    def tensor_plan(self):
        s = self.sizes(self.hp.N, self.hp.owns_kv)
        return self._plan(self.table, s, attn_v=self._attn_v, ple_embedding=self._ple_embedding)

    def _attn_v(self, plan: RolePlan, s: Sizes, bid: int, p: str, role: Role) -> None:
        if not (self.hp.k_eq_v and self.hp.types[bid] == FULL):
            kv = (s.num_key_value_heads * s.head_dim, s.E)
            plan.add(names.blk(bid, "attn_v"), [plan.source(p + "self_attn.v_proj.weight", kv)], kv, role)

    def _ple_embedding(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        hf, NP = "model.embed_tokens_per_layer.weight", s.num_hidden_layers * s.P
        v_ple = int(self.checkpoint.tensors[hf].shape[0]) if hf in self.checkpoint.tensors else self.hp.V_ple
        if v_ple < s.V:
            raise SpecconvError(f"the per-layer embedding has {v_ple} rows, fewer than the {s.V} tokens")
        plan.add("per_layer_token_embd.weight", [plan.source(hf, (v_ple, NP))], (s.Vp, NP), role,
                 partial(tf.slice_axis, dim=0, start=0, stop=s.V))

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        return self._kv(self.gguf_arch, self.vocab_size())


@register
class Gemma4Assistant(_Gemma4Base):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Gemma4AssistantForCausalLM",)
    gguf_arch: ClassVar[str] = names.GEMMA4_ASSISTANT
    family: ClassVar[str] = "gemma4-assistant"
    standalone_drafter: ClassVar[bool] = True  # the whole file drafts: no trunk/MTP split, no notice about it

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.Hb = ConfigReader(checkpoint.config).integer("backbone_hidden_size", default=0)
        if not self.Hb:
            raise SpecconvError("config.json lacks backbone_hidden_size (the target's hidden size)")
        if self.Hb == self.hp.H:
            raise SpecconvError("backbone_hidden_size equals the assistant's hidden_size; llama.cpp needs them "
                                "to differ (embedding_length_out carries the backbone width)")
        if self.hp.n_shared not in (0, self.hp.N):
            raise SpecconvError("every assistant layer must read the target's K/V (num_kv_shared_layers = "
                                "num_hidden_layers)")
        if self.hp.P or self.hp.moe or self.hp.double_wide:
            raise SpecconvError("a Gemma 4 assistant has no per-layer inputs, MoE blocks or double-wide MLPs")
        self.hp.n_shared = self.hp.N  # the assistant config forces it

    @classmethod
    def normalize_name(cls, raw_name: str):
        if raw_name.startswith("masked_embedding."):
            return (None, "ordered-embedding centroids (llama.cpp scores the full vocabulary)")
        return _normalize(raw_name)

    @property
    def n_trunk_layers(self) -> int:
        return 0

    @property
    def n_mtp_layers(self) -> int:
        return 0  # the whole file is the drafter; there is no trunk/MTP split to route

    table: ClassVar[TensorTable] = ASSISTANT_TABLE

    def tensor_plan(self):
        s = replace(self.sizes(0, lambda i: False), Eo=self.Hb)  # every block reads the target's K/V
        return self._plan(self.table, s)

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        w = MetadataWriter(self.gguf_arch, self._kv(self.gguf_arch, self.vocab_size()))
        w.u32(Keys.LLM.EMBEDDING_LENGTH_OUT, self.Hb)
        w.nextn(self.hp.N)  # the whole assistant is one drafter of N blocks
        return w.kv
