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
from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from . import names, register
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .config_reader import ConfigReader
from .errors import SpecconvError
from .eagle3_hparams import Eagle3HParams, angelslim_default_notice, resolve_target_layers
from .llama import BLOCK_SPECS, ROPE_FREQS_SPEC, _norm, add_rope_freqs, block_tags, llama_kv, rope_freqs_first
from .metadata import MetadataWriter
from .plan_tools import RolePlan, own_embedding, target_tokenizer_pre
from .tensor_table import Hook, TensorSpec, TensorTable, read_by

I64 = GGMLQuantizationType.I64
INT_DTYPES = {"I64", "I32"}
# tokenizer.ggml.pre of targets whose plugin this project lacks (model_type -> name llama.cpp knows)


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
    TensorSpec(names.TOKEN_EMBD, None, lambda s: (s.vocab_dim, s.hidden_size), optional=True, hook="embedding",
               role=Role.TRUNK, graph="mtp"),
    TensorSpec(names.EAGLE3_FC, "fc.weight", lambda s: (s.hidden_size, 3 * s.target_hidden_size), role=Role.TRUNK,
               graph="encoder"),
    _norm(names.ENC_OUTPUT_NORM, None, lambda s: (3 * s.target_hidden_size,), optional=True, hook="enc_norm",
          role=Role.TRUNK, graph="encoder"),  # written and read when norm_before_fc
    _norm(names.OUTPUT_NORM, "norm.weight", role=Role.TRUNK, graph="mtp"),
    TensorSpec(names.OUTPUT, None, lambda s: (s.draft_vocab_dim, s.hidden_size), optional=True, hook="head",
               role=Role.TRUNK, graph="mtp"),
    TensorSpec(names.EAGLE3_D2T, None, lambda s: (s.draft_vocab_dim,), optional=True, hook="head", role=Role.TRUNK,
               graph="mtp"),
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
        self.hp = Eagle3HParams.from_config(checkpoint.config, checkpoint.target_config, checkpoint.target_layers)
        self.cfg = ConfigReader(checkpoint.config).merged("transformer_layer_config")  # rope_freqs, architectures
        self.notices = self._layer_notices(checkpoint)
        self.tokenizer_dir = checkpoint.target_dir
        self.tokenizer_pre = target_tokenizer_pre(checkpoint.target_config)

    def _layer_notices(self, checkpoint: Checkpoint) -> list[str]:
        """Where eagle3.target_layers came from, and what the config's ids leave open."""
        target_layer_count = ConfigReader(checkpoint.target_config).text_model().integer("num_hidden_layers")
        layers, source, notices = resolve_target_layers(checkpoint.config, target_layer_count, checkpoint.target_layers)
        notices = [f"eagle3.target_layers {layers} (layer inputs) from {source}"] + notices
        if source.startswith("default") and "Eagle3LlamaForCausalLM" in self.cfg.strings("architectures", default=()):
            notices.append(angelslim_default_notice(target_layer_count))
        return notices


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

    def vocab_size(self) -> int:
        return self.hp.vocab_size  # the GGUF carries the target's full vocabulary

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = EAGLE3_TABLE

    def block_prefix(self, bid: int) -> str:
        return f"layers.{bid}."  # its one decoder layer (`midlayer.` as normalize_name reads it)

    def hooks(self) -> dict[str, Hook]:
        return {"embedding": own_embedding, "enc_norm": self._enc_norm, "head": self._head,
                "rope_freqs": self._rope_freqs}

    def tensor_plan(self) -> list[TensorPlan]:
        # d2t last, as llama.cpp's converter writes it (after every float tensor)
        return sorted(rope_freqs_first(super().tensor_plan()), key=lambda p: p.name == names.EAGLE3_D2T)

    def _enc_norm(self, plan: RolePlan, s: Eagle3HParams, bid: None, p: str, role: Role) -> None:
        if s.norm_before_fc:
            shape = (3 * s.target_hidden_size,)
            plan.add(names.ENC_OUTPUT_NORM, [plan.source("input_norm.weight", shape)], shape, role, f32=True)

    def _head(self, plan: RolePlan, s: Eagle3HParams, bid: None, p: str, role: Role) -> None:
        """The head's own output matrix over the draft vocabulary, and d2t mapping it to target ids."""
        has_head = plan.has("lm_head.weight")
        if has_head:
            shape = (s.draft_vocab_size, s.hidden_size)
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", shape)], shape, role)
        if plan.has("d2t"):
            if not has_head:
                raise SpecconvError("the head has d2t but no lm_head.weight: a reduced vocabulary needs its own head")
            d2t = plan.source("d2t", (s.draft_vocab_size,), INT_DTYPES)
            plan.plans.append(TensorPlan(names.EAGLE3_D2T, (d2t,), (s.draft_vocab_size,), role,
                                         partial(absolute_d2t, n_target_vocab=s.vocab_size), I64))
        elif s.draft_vocab_size != s.vocab_size:
            raise SpecconvError(f"draft_vocab_size {s.draft_vocab_size} differs from the vocabulary {s.vocab_size} but "
                                f"the checkpoint has no d2t mapping")

    def _rope_freqs(self, plan: RolePlan, s: Eagle3HParams, bid: None, p: str, role: Role) -> None:
        add_rope_freqs(plan, self.cfg, s.head_dim, "norm.weight")

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        hp = self.hp
        w = MetadataWriter(hp.arch, llama_kv(hp))
        w.array(names.target_layers_key(hp.arch), hp.target_layers, GGUFValueType.INT32)
        w.u32(names.target_hidden_size_key(hp.arch), hp.target_hidden_size)
        w.put(names.norm_before_residual_key(hp.arch), hp.norm_before_residual, GGUFValueType.BOOL)
        w.put(names.norm_before_fc_key(hp.arch), hp.norm_before_fc, GGUFValueType.BOOL)
        return w.kv
