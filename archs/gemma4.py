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
from functools import partial
from pathlib import Path
from typing import ClassVar

from gguf import GGMLQuantizationType, GGUFValueType, Keys

from . import names, register
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import CheckedPlan, text_model_name

F32 = GGMLQuantizationType.F32
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
        self.n_head = cfg.integer("num_attention_heads", min=1)
        self.hd_swa = cfg.integer("head_dim", default=256, min=1) or 256
        self.nkv_swa = cfg.integer("num_key_value_heads", default=self.n_head, min=1)
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
            if self.n_head % nkv:
                raise SpecconvError(f"layer {i}: {self.n_head} heads are not a multiple of {nkv} KV heads")
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
        n_rot = int(self.hd_full * self.rope_factor / 2)
        return (1.0,) * n_rot + (1e30,) * (half - n_rot)


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


class PlanBuilder(CheckedPlan):
    """Checked sources; every Gemma 4 output belongs to the one file (no MTP routing)."""

    def add(self, gguf_name, sources, shape, transform=tf.identity, force=None) -> None:
        self.plans.append(TensorPlan(gguf_name, tuple(sources), tuple(shape), Role.TRUNK, transform, force))


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

    # ---- shared tensor plan pieces --------------------------------------------------------
    def _embedding(self, plan: PlanBuilder, width: int) -> None:
        V = self.vocab_size()
        info = self.checkpoint.tensors.get("model.embed_tokens.weight")
        rows = int(info.shape[0]) if info is not None else V
        src = plan.source("model.embed_tokens.weight", (rows, width))
        plan.add(names.TOKEN_EMBD, [src], (V, width), partial(tf.slice_axis, dim=0, start=0, stop=V))
        if plan.has("lm_head.weight"):  # tied: the loader duplicates token_embd as the head
            plan.used.add("lm_head.weight")

    def _norm(self, plan: PlanBuilder, gguf: str, hf: str, width: int) -> None:
        plan.add(gguf, [plan.source(hf, (width,))], (width,))

    def _layer(self, plan: PlanBuilder, i: int, with_kv: bool) -> None:
        hp, H = self.hp, self.hp.H
        p, hd, nkv = f"model.layers.{i}.", hp.hd[i], hp.nkv[i]
        q, kv = hp.n_head * hd, nkv * hd
        self._norm(plan, names.blk(i, "attn_norm"), p + "input_layernorm.weight", H)
        plan.add(names.blk(i, "attn_q"), [plan.source(p + "self_attn.q_proj.weight", (q, H))], (q, H))
        self._norm(plan, names.blk(i, "attn_q_norm"), p + "self_attn.q_norm.weight", hd)
        if with_kv:
            plan.add(names.blk(i, "attn_k"), [plan.source(p + "self_attn.k_proj.weight", (kv, H))], (kv, H))
            if not (hp.k_eq_v and hp.types[i] == FULL):
                plan.add(names.blk(i, "attn_v"), [plan.source(p + "self_attn.v_proj.weight", (kv, H))], (kv, H))
            self._norm(plan, names.blk(i, "attn_k_norm"), p + "self_attn.k_norm.weight", hd)
        plan.add(names.blk(i, "attn_output"), [plan.source(p + "self_attn.o_proj.weight", (H, q))], (H, q))
        self._norm(plan, names.blk(i, "post_attention_norm"), p + "post_attention_layernorm.weight", H)
        self._norm(plan, names.blk(i, "ffn_norm"), p + "pre_feedforward_layernorm.weight", H)
        self._norm(plan, names.blk(i, "post_ffw_norm"), p + "post_feedforward_layernorm.weight", H)
        F = hp.ffn_width(i)
        for part, shape in (("gate", (F, H)), ("up", (F, H)), ("down", (H, F))):
            plan.add(names.blk(i, f"ffn_{part}"), [plan.source(f"{p}mlp.{part}_proj.weight", shape)], shape)
        plan.add(names.blk(i, "layer_output_scale"), [plan.source(p + "layer_scalar", (1,))], (1,), force=F32)

    def _rope_freqs(self, plan: PlanBuilder) -> None:
        values = self.hp.rope_freq_factors()
        plan.add(ROPE_FREQS, ["model.norm.weight"], (len(values),), partial(tf.constant, values=values), F32)

    # ---- metadata -------------------------------------------------------------------------
    def _kv(self, arch: str, n_vocab: int) -> list[MetaKV]:
        hp = self.hp
        w = MetadataWriter(arch)
        ffn = [hp.ffn_width(i) for i in range(hp.N)] if hp.double_wide and hp.n_shared else hp.F
        w.text_model(hp.N, hp.context_length, hp.H, ffn, hp.n_head,
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
    family: ClassVar[str] = "gemma4"

    @property
    def gguf_arch(self) -> str:
        return names.GEMMA4

    @classmethod
    def normalize_name(cls, raw_name: str):
        return _normalize(raw_name)

    @property
    def n_trunk_layers(self) -> int:
        return self.hp.N

    @property
    def n_mtp_layers(self) -> int:
        return 0

    def tensor_plan(self):
        plan, hp, H = PlanBuilder(self.checkpoint.tensors), self.hp, self.hp.H
        self._embedding(plan, H)
        if hp.P:
            NP = hp.N * hp.P
            v_ple = int(self.checkpoint.tensors["model.embed_tokens_per_layer.weight"].shape[0]) \
                if "model.embed_tokens_per_layer.weight" in self.checkpoint.tensors else hp.V_ple
            V = self.vocab_size()
            if v_ple < V:
                raise SpecconvError(f"the per-layer embedding has {v_ple} rows, fewer than the {V} tokens")
            # llama.cpp sizes this table by the vocabulary too: trimmed like token_embd
            plan.add("per_layer_token_embd.weight", [plan.source("model.embed_tokens_per_layer.weight", (v_ple, NP))],
                     (V, NP), partial(tf.slice_axis, dim=0, start=0, stop=V))
            plan.add("per_layer_model_proj.weight", [plan.source("model.per_layer_model_projection.weight", (NP, H))],
                     (NP, H))
            self._norm(plan, "per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight", hp.P)
        for i in range(hp.N):
            self._layer(plan, i, with_kv=hp.owns_kv(i))
            p = f"model.layers.{i}."
            if not hp.owns_kv(i):  # transformers drops these on load; a checkpoint may still carry them
                for extra in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
                    if plan.has(p + "self_attn." + extra):
                        plan.used.add(p + "self_attn." + extra)
            if hp.P:
                plan.add(names.blk(i, "inp_gate"), [plan.source(p + "per_layer_input_gate.weight", (hp.P, H))], (hp.P, H))
                plan.add(names.blk(i, "proj"), [plan.source(p + "per_layer_projection.weight", (H, hp.P))], (H, hp.P))
                self._norm(plan, names.blk(i, "post_norm"), p + "post_per_layer_input_norm.weight", H)
            if hp.moe:
                self._moe(plan, i)
        self._norm(plan, names.OUTPUT_NORM, "model.norm.weight", H)
        self._rope_freqs(plan)
        return plan.finish(self.gguf_arch)

    def _moe(self, plan: PlanBuilder, i: int) -> None:
        hp, H, p = self.hp, self.hp.H, f"model.layers.{i}."
        E, Fe = hp.E, hp.Fe
        plan.add(names.blk(i, "ffn_gate_inp"), [plan.source(p + "router.proj.weight", (E, H))], (E, H), force=F32)
        plan.add(names.blk(i, "ffn_gate_inp", "scale"), [plan.source(p + "router.scale", (H,))], (H,), force=F32)
        plan.add(names.blk(i, "ffn_down_exps", "scale"), [plan.source(p + "router.per_expert_scale", (E,))], (E,),
                 force=F32)
        plan.add(names.blk(i, "ffn_gate_up_exps"), [plan.source(p + "experts.gate_up_proj", (E, 2 * Fe, H))],
                 (E, 2 * Fe, H))
        plan.add(names.blk(i, "ffn_down_exps"), [plan.source(p + "experts.down_proj", (E, H, Fe))], (E, H, Fe))
        self._norm(plan, names.blk(i, "pre_ffw_norm_2"), p + "pre_feedforward_layernorm_2.weight", H)
        self._norm(plan, names.blk(i, "post_ffw_norm_1"), p + "post_feedforward_layernorm_1.weight", H)
        self._norm(plan, names.blk(i, "post_ffw_norm_2"), p + "post_feedforward_layernorm_2.weight", H)

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        return self._kv(self.gguf_arch, self.vocab_size())


@register
class Gemma4Assistant(_Gemma4Base):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Gemma4AssistantForCausalLM",)
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

    @property
    def gguf_arch(self) -> str:
        return names.GEMMA4_ASSISTANT

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

    def tensor_plan(self):
        plan, hp, H, Hb = PlanBuilder(self.checkpoint.tensors), self.hp, self.hp.H, self.Hb
        self._embedding(plan, H)
        plan.add(names.NEXTN_PRE_PROJECTION, [plan.source("pre_projection.weight", (H, 2 * Hb))], (H, 2 * Hb))
        plan.add(names.NEXTN_POST_PROJECTION, [plan.source("post_projection.weight", (Hb, H))], (Hb, H))
        for i in range(hp.N):
            self._layer(plan, i, with_kv=False)
        self._norm(plan, names.OUTPUT_NORM, "model.norm.weight", H)
        self._rope_freqs(plan)
        return plan.finish(self.gguf_arch)

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        w = MetadataWriter(self.gguf_arch, self._kv(self.gguf_arch, self.vocab_size()))
        w.u32(Keys.LLM.EMBEDDING_LENGTH_OUT, self.Hb)
        w.nextn(self.hp.N)  # the whole assistant is one drafter of N blocks
        return w.kv
