"""EAGLE-3 draft heads (GGUF arch `eagle3`), docs/reference/gguf-layout.md §7.8 and docs/reference/model-math.md §9.

Accepted layouts:
* `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM` (the EAGLE authors' checkpoints): flat config,
  tensors `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, optionally `embed_tokens`;
* speculators-style (`Eagle3Speculator`, `Eagle3DraftModel`): the LLaMA layer config nested in
  `transformer_layer_config`, the layer named `layers.0.*` (sometimes under `model.`).
Target layers (docs/eagle3.md, "Two conventions"): `eagle3.target_layers` names layer INPUTS, as
llama.cpp extracts them (id j = the input of target block j = transformers `hidden_states[j]`). The
checkpoint keys are read each in its own convention: the top-level `eagle_aux_hidden_state_layer_ids`
(EAGLE authors, vLLM, speculators) already names inputs; `eagle_config.eagle_aux_hidden_state_layer_ids`
(SpecForge, read by SGLang) and AngelSlim's `aux_hidden_states_layer_ids` name layer OUTPUTS and are
written + 1. `--target-layers` (layer inputs) overrides them all; without ids the default is
`[2, L//2, L-3]` (inputs, llama.cpp's and vLLM's default).

A head only makes sense with its target: the conversion needs the target's folder
(`Checkpoint.target_config` / `target_dir`), from which come the tokenizer (the GGUF carries the
target's full vocabulary), the target hidden size, the default target layers and the vocabulary
size that `d2t` must map into. `d2t` is written as absolute target ids (I64), checked in range and
unique; `t2d` (training only) is dropped; q/k rows get the LLaMA pair permutation.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from . import names, plugin_class_for, register
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .config_reader import MAX_LAYERS, ConfigReader
from .errors import SpecconvError
from .llama import (BLOCK_SPECS, ROPE_FREQS_SPEC, Sizes, _norm, add_rope_freqs, attention_shapes, block_tags, llama_kv,
                    rope_freqs_first)
from .metadata import MetadataWriter
from .plan_tools import RolePlan
from .tensor_table import Block, TensorSpec, TensorTable, read_by

I64 = GGMLQuantizationType.I64
INT_DTYPES = {"I64", "I32"}
# tokenizer.ggml.pre of targets whose plugin this project lacks (model_type -> name llama.cpp knows)
_PRE_BY_MODEL_TYPE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


# Where a head's config names its target layers, and whether that key names layer inputs (0) or
# layer outputs (+1 to make them inputs). Checked in this order; the first present wins.
LAYER_ID_KEYS = (
    (("eagle_config", "eagle_aux_hidden_state_layer_ids"), 1, "SpecForge / SGLang: layer outputs"),
    (("eagle_aux_hidden_state_layer_ids",), 0, "EAGLE / vLLM / speculators: layer inputs"),
    (("aux_hidden_states_layer_ids",), 1, "AngelSlim: layer outputs"),
)


def config_layer_ids(config: ConfigReader, path: tuple[str, ...]) -> list[int] | None:
    """The integer ids at `path` (keys into nested objects), or None when absent or empty."""
    node = config
    for key in path[:-1]:
        node = node.section(key)
    return node.integers(path[-1], default=None) or None


def resolve_target_layers(config: Mapping[str, Any], num_hidden_layers: int,
                          override: Sequence[int] | None = None) -> tuple[list[int], str, list[str]]:
    """(layer inputs for `eagle3.target_layers`, where they came from, notices) for a head's config.

    `config` is the head's config.json as saved (speculators' `transformer_layer_config` is not
    merged: the ids sit at its top level or in `eagle_config`). `override`: `--target-layers`."""
    config = ConfigReader(config)
    notices: list[str] = []
    if override is not None:
        layers, source = [int(i) for i in override], "--target-layers (layer inputs)"
    else:
        found = [(".".join(path), ids, shift, who) for path, shift, who in LAYER_ID_KEYS
                 if (ids := config_layer_ids(config, path)) is not None]
        if found:
            key, ids, shift, who = found[0]
            layers = [i + shift for i in ids]
            source = f"{key} {ids} ({who})" + (" + 1" if shift else "")
            for other_key, other_ids, other_shift, _ in found[1:]:
                if [i + other_shift for i in other_ids] != layers:
                    notices.append(f"{other_key} {other_ids} disagrees with {key} {ids}; using {key} "
                                   f"(layer inputs {layers}); give --target-layers if the head was trained otherwise")
        else:
            layers, source = [2, num_hidden_layers // 2, num_hidden_layers - 3], "default [2, L//2, L-3] (layer inputs)"
    if len(layers) != 3:
        raise SpecconvError(f"an EAGLE-3 head reads 3 target layers, {source} gives {layers}")
    bad = [j for j in layers if not 0 <= j <= num_hidden_layers]
    if bad:
        raise SpecconvError(f"target layer {bad[0]} (from {source}) is outside 0..{num_hidden_layers}: the target has {num_hidden_layers} "
                            f"layers (layer input {num_hidden_layers} is its final normed output)")
    return layers, source, notices


def angelslim_default_notice(num_hidden_layers: int) -> str:
    """AngelSlim trains a head without ids on ITS default, [1, (L+1)//2-1, L-3] as layer outputs (docs/eagle3.md);
    the config cannot tell an AngelSlim head from others named Eagle3LlamaForCausalLM, so this is only said."""
    inputs = [2, (num_hidden_layers + 1) // 2, num_hidden_layers - 2]
    return (f"no layer ids in config.json: if AngelSlim trained this head, it read layer inputs {inputs} (its default), "
            f"not [2, {num_hidden_layers // 2}, {num_hidden_layers - 3}]: give --target-layers {','.join(map(str, inputs))}")


def absolute_d2t(ts: list[np.ndarray], n_target_vocab: int) -> np.ndarray:
    """HF offsets (target id - draft id) -> absolute target ids, validated in range and unique."""
    offsets = ts[0].reshape(-1).astype(np.int64)
    ids = offsets + np.arange(offsets.size, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= n_target_vocab))
    if bad.size:
        i = int(bad[0])
        raise SpecconvError(f"d2t maps draft token {i} to target id {int(ids[i])}, outside the target vocabulary "
                            f"[0, {n_target_vocab}); the head does not belong to this target")
    if np.unique(ids).size != ids.size:
        raise SpecconvError("d2t maps two draft tokens to the same target id (a corrupt or mismatched d2t)")
    return ids


# The head is a trunk file (Role.TRUNK) that the runtime runs as two graphs: the ENCODER (fc over the
# target's features) and the decoder, served as MTP. Optional tensors a head may leave to its target
# (token_embd; output, which then spans the target vocabulary) or hold only for some configs.
EAGLE3_TABLE = TensorTable((
    TensorSpec(names.TOKEN_EMBD, None, lambda s: (s.V, s.E), optional=True, hook="embedding", role=Role.TRUNK,
               graph="mtp"),
    TensorSpec(names.EAGLE3_FC, "fc.weight", lambda s: (s.E, 3 * s.Ht), role=Role.TRUNK, graph="encoder"),
    _norm(names.ENC_OUTPUT_NORM, None, lambda s: (3 * s.Ht,), optional=True, hook="enc_norm", role=Role.TRUNK,
          graph="encoder"),  # written and read when norm_before_fc
    _norm(names.OUTPUT_NORM, "norm.weight", role=Role.TRUNK, graph="mtp"),
    TensorSpec(names.OUTPUT, None, lambda s: (s.Vd, s.E), optional=True, hook="head", role=Role.TRUNK, graph="mtp"),
    TensorSpec(names.EAGLE3_D2T, None, lambda s: (s.Vd,), optional=True, hook="head", role=Role.TRUNK, graph="mtp"),
    *read_by("mtp", (ROPE_FREQS_SPEC, *BLOCK_SPECS)),
    _norm("blk.{bid}.attn_norm_2.weight", "{p}hidden_norm.weight", graph="mtp"),
), block_tags)


@register
class Eagle3(ArchPlugin):
    hf_architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM",
                                                   "Eagle3Speculator", "Eagle3DraftModel")
    gguf_arch: ClassVar[str] = names.EAGLE3
    family: ClassVar[str] = "eagle3"
    uses_target: ClassVar[bool] = True  # the engine passes --target TARGET_DIR through the Checkpoint
    tokenizer_model: ClassVar[str] = "gpt2"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        if checkpoint.target_config is None:
            raise SpecconvError("an EAGLE-3 head needs its target model: give --target TARGET_DIR (the target's "
                                "config.json and tokenizer)")
        self.cfg = cfg = ConfigReader(checkpoint.config).merged("transformer_layer_config")
        self.target = target = ConfigReader(checkpoint.target_config, file="the target's config.json").text_model()
        self.num_attention_heads, self.n_kv, self.hd = attention_shapes(cfg)
        self.H, self.F = cfg.integer("hidden_size", min=1), cfg.integer("intermediate_size", min=1)
        self.V, self.L_target = target.integer("vocab_size", min=1), target.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        for key in ("fc_norm", "norm_output"):  # EAGLE-3.1 options (per-feature norms before fc, ...): not in the GGUF
            if cfg.flag(key, default=False):
                raise SpecconvError(f"config.json: {key}=true (an EAGLE-3.1 head) is not supported: llama.cpp's eagle3 "
                                    f"graph has no such norm")
        n_layers = cfg.integer("num_hidden_layers", default=1)
        if n_layers != 1:
            raise SpecconvError(f"an EAGLE-3 head has one decoder layer, config.json says {n_layers}")
        own_vocab = cfg.integer("vocab_size", default=None)
        if own_vocab is not None and own_vocab != self.V:
            raise SpecconvError(f"the EAGLE-3 head was trained for a vocabulary of {own_vocab} tokens, but the target "
                                f"has {self.V}: wrong --target")
        self.Vd = cfg.integer("draft_vocab_size", default=None, min=1) or self.V
        self.Ht = self._target_hidden_size()
        self.layers = self._target_layers()
        self.norm_before_residual = cfg.flag("norm_before_residual", default=False)
        self.norm_before_fc = cfg.flag("norm_before_fc", default=False)
        self.tokenizer_dir = checkpoint.target_dir
        self.tokenizer_pre = self._target_tokenizer_pre(checkpoint.target_config)

    def _target_hidden_size(self) -> int:
        target_h = self.target.integer("hidden_size", min=1)
        own = self.cfg.integer("target_hidden_size", default=None)
        if own is not None and own != target_h:
            raise SpecconvError(f"the EAGLE-3 head expects target hidden size {own}, but the target has {target_h}: "
                                f"wrong --target")
        return target_h

    def _target_layers(self) -> list[int]:
        layers, source, notices = resolve_target_layers(self.checkpoint.config, self.L_target,
                                                        self.checkpoint.target_layers)
        self.notices = [f"eagle3.target_layers {layers} (layer inputs) from {source}"] + notices
        if source.startswith("default") and "Eagle3LlamaForCausalLM" in self.cfg.strings("architectures", default=()):
            self.notices.append(angelslim_default_notice(self.L_target))
        return layers

    @staticmethod
    def _target_tokenizer_pre(target_config: Mapping[str, Any]) -> str:
        try:
            return plugin_class_for(target_config).tokenizer_pre
        except SpecconvError:
            target = ConfigReader(target_config, file="the target's config.json")
            model_type = target.text_model().string("model_type", default=None) or target.string("model_type", default=None)
            return _PRE_BY_MODEL_TYPE.get(model_type, "default")

    # ------------------------------------------------------------------ naming

    @classmethod
    def normalize_name(cls, raw_name: str):
        if raw_name == "t2d":
            return (None, "t2d (target-to-draft mask, used only in training)")
        if raw_name.endswith("rotary_emb.inv_freq"):
            return (None, "rotary inv_freq buffer (recomputed from the config)")
        name = raw_name[len("model."):] if raw_name.startswith("model.") else raw_name
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        return name

    @property
    def n_trunk_layers(self) -> int:
        return 1

    @property
    def n_mtp_layers(self) -> int:
        return 0

    def vocab_size(self) -> int:
        return self.V  # the GGUF carries the target's full vocabulary

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = EAGLE3_TABLE

    def sizes(self) -> Sizes:
        return Sizes(num_hidden_layers=1, E=self.H, V=self.V, num_attention_heads=self.num_attention_heads, num_key_value_heads=self.n_kv, head_dim=self.hd,
                     ffn=self.F, rotary_dim=self.hd, E_in=2 * self.H, Ht=self.Ht, Vd=self.Vd)

    def tensor_plan(self) -> list[TensorPlan]:
        plan = RolePlan(self.checkpoint.tensors)
        hooks = {"embedding": self._embedding, "enc_norm": self._enc_norm, "head": self._head,
                 "rope_freqs": self._rope_freqs}
        self.table.plan(plan, self.sizes(), [Block(0, "layers.0.", Role.TRUNK)], hooks)
        # d2t last, as llama.cpp's converter writes it (after every float tensor)
        return sorted(rope_freqs_first(plan.finish(self.gguf_arch)), key=lambda p: p.name == names.EAGLE3_D2T)

    def _embedding(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        if plan.has("embed_tokens.weight"):  # else the runtime takes the target's
            plan.add(names.TOKEN_EMBD, [plan.source("embed_tokens.weight", (s.V, s.E))], (s.V, s.E), role)

    def _enc_norm(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        if self.norm_before_fc:
            plan.add(names.ENC_OUTPUT_NORM, [plan.source("input_norm.weight", (3 * s.Ht,))], (3 * s.Ht,), role,
                     f32=True)

    def _head(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        """The head's own output matrix over the draft vocabulary, and d2t mapping it to target ids."""
        has_head = plan.has("lm_head.weight")
        if has_head:
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", (s.Vd, s.E))], (s.Vd, s.E), role)
        if plan.has("d2t"):
            if not has_head:
                raise SpecconvError("the head has d2t but no lm_head.weight: a reduced vocabulary needs its own head")
            d2t = plan.source("d2t", (s.Vd,), INT_DTYPES)
            plan.plans.append(TensorPlan(names.EAGLE3_D2T, (d2t,), (s.Vd,), role,
                                         partial(absolute_d2t, n_target_vocab=s.V), I64))
        elif s.Vd != s.V:
            raise SpecconvError(f"draft_vocab_size {s.Vd} differs from the vocabulary {s.V} but the checkpoint has no "
                                f"d2t mapping")

    def _rope_freqs(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        add_rope_freqs(plan, self.cfg, s.head_dim, "norm.weight")

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        arch = self.gguf_arch
        cfg = self.cfg.with_values({"head_dim": self.hd})  # key/value_length always written (llama.cpp's converter: when known)
        w = MetadataWriter(arch, llama_kv(arch, cfg, 1, self.V))
        w.array(names.target_layers_key(arch), self.layers, GGUFValueType.INT32)
        w.u32(names.target_hidden_size_key(arch), self.Ht)
        w.put(names.norm_before_residual_key(arch), self.norm_before_residual, GGUFValueType.BOOL)
        w.put(names.norm_before_fc_key(arch), self.norm_before_fc, GGUFValueType.BOOL)
        return w.kv
