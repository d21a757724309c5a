"""DFlash block-diffusion drafters (z-lab `DFlashDraftModel`) -> GGUF arch `dflash` (docs/dflash.md).

What llama.cpp 0c1e570 loads and its converter (`DFlashModel`, a `Qwen3Model`) writes:
* tensors: Qwen3 decoder layers `blk.{i}.*` (q/k norms per head), `fc.weight` [H, k·H] over the k
  target layers, `enc.output_norm.weight` (the checkpoint's `hidden_norm`, applied after fc),
  `output_norm.weight`; `token_embd` / `output` only when the checkpoint has its own (z-lab's share
  the target's, which llama.cpp takes from the target context);
* keys: Qwen3's (`dflash.*`), then `dflash.block_size`, `dflash.target_layers` (i32, layer INPUTS:
  the checkpoint's `dflash_config.target_layer_ids` name layer outputs and are written + 1, as
  llama.cpp's converter does), `tokenizer.ggml.mask_token_id`; the tokenizer is the target's.
`--target-layers` (layer inputs) overrides the config's ids. The one look at the folder: a
`mask_embedding.pt` next to the checkpoint (drafts that patch the target's embedding) is refused.
DFlash2 (`DFlash2DraftModel`: per-layer dynamic convolutions `blk.i.{attn,ffn}_conv_{base,proj}`,
a candidate selector `selector_*`, conv/selector keys, logit scale and soft-capping, sliding
windows) converts as upstream writes it; llama.cpp and specconv's runtime run it.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from gguf import GGUFValueType, Keys

from . import names, register
from .base import ArchPlugin, Checkpoint, MetaKV, Role
from .config_reader import ConfigReader
from .dflash_hparams import DFlashHParams, target_layers_of
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import RolePlan, own_embedding, target_tokenizer_pre
from .qwen3 import QWEN3_ATTENTION
from .tensor_table import Hook, TensorSpec, TensorTable, read_by, swiglu_specs



def _tags(s: DFlashHParams, bid: int | None = None) -> frozenset[str]:
    return frozenset({"v2"} if s.v2 else ())


def _own(gguf: str, hf: str, shape, on: str = "", f32: bool = False) -> TensorSpec:
    """A tensor of the drafter's decoder (the runtime's MTP graph)."""
    return TensorSpec(gguf, hf, shape, on, f32=f32, role=Role.TRUNK, graph="mtp")


def _conv(side: str, hf: str) -> tuple[TensorSpec, ...]:
    """DFlash2's dynamic convolution around attention or MLP: base kernels [2, K, H] (F32, no `.weight`
    suffix, as upstream names them) and the kernel projection [2·K·H/group, H]."""
    return (TensorSpec(f"blk.{{bid}}.{side}_conv_base", f"{{p}}{hf}.base_kernel",
                       lambda s: (2, s.conv_kernel_size, s.hidden_size), "v2", f32=True, graph="mtp"),
            TensorSpec(f"blk.{{bid}}.{side}_conv_proj.weight", f"{{p}}{hf}.kernel_projection.weight",
                       lambda s: (s.conv_proj, s.hidden_size), "v2", graph="mtp"))


_SEL = "candidate_selector."
# A trunk file (Role.TRUNK) the runtime runs as a drafter (its MTP graph); embedding and head are the
# target's unless the checkpoint has its own.
DFLASH_TABLE = TensorTable((
    TensorSpec(names.TOKEN_EMBD, None, lambda s: (s.vocab_dim, s.hidden_size), optional=True, hook="embedding",
               role=Role.TRUNK),
    _own(names.EAGLE3_FC, "fc.weight", lambda s: (s.hidden_size, s.input_width)),
    _own(names.ENC_OUTPUT_NORM, "hidden_norm.weight", lambda s: (s.hidden_size,), f32=True),
    _own(names.OUTPUT_NORM, "norm.weight", lambda s: (s.hidden_size,), f32=True),
    _own("selector_predecessor.weight", _SEL + "predecessor_codebook", lambda s: (s.vocab_dim, s.selector_rank), "v2"),
    _own("selector_successor.weight", _SEL + "successor_codebook", lambda s: (s.vocab_dim, s.selector_rank), "v2"),
    _own("selector_hidden.weight", _SEL + "hidden_projection.weight", lambda s: (s.selector_rank, s.hidden_size), "v2"),
    TensorSpec(names.OUTPUT, None, lambda s: (s.vocab_dim, s.hidden_size), optional=True, hook="head", role=Role.TRUNK),
    *read_by("mtp", QWEN3_ATTENTION + swiglu_specs("{p}mlp.")),  # Qwen3 decoder layers
    *_conv("attn", "attention_conv"),
    *_conv("ffn", "mlp_conv"),
), _tags, global_tags=_tags)


@register
class DFlash(ArchPlugin):
    hf_architectures: ClassVar[tuple[str, ...]] = ("DFlashDraftModel", "DFlash2DraftModel")
    gguf_arch: ClassVar[str] = names.DFLASH
    family: ClassVar[str] = "dflash"
    uses_target: ClassVar[bool] = True  # tokenizer, vocabulary and layer count come from --target
    tokenizer_model: ClassVar[str] = "gpt2"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        if checkpoint.source_dir and (Path(checkpoint.source_dir) / "mask_embedding.pt").exists():
            raise SpecconvError("mask_embedding.pt (a draft that patches the target's embedding) is not supported")
        if checkpoint.target_config is None:
            raise SpecconvError("a DFlash drafter needs its target model: give --target TARGET_DIR (the target's "
                                "config.json and tokenizer)")
        self.hp = DFlashHParams.from_config(checkpoint.config, checkpoint.target_config, checkpoint.target_layers)
        self.cfg = ConfigReader(checkpoint.config)  # where is_causal sits decides where its key is written
        target_layer_count = ConfigReader(checkpoint.target_config).text_model().integer("num_hidden_layers")
        layers, source = target_layers_of(self.cfg, target_layer_count, checkpoint.target_layers)
        self.notices = [f"dflash.target_layers {layers} (layer inputs) from {source}"]
        self.tokenizer_dir = checkpoint.target_dir
        self.tokenizer_pre = target_tokenizer_pre(checkpoint.target_config)


    # ------------------------------------------------------------------ naming

    @classmethod
    def normalize_name(cls, raw_name: str):
        if raw_name.endswith("rotary_emb.inv_freq"):
            return (None, "rotary inv_freq buffer (recomputed from the config)")
        return raw_name[len("model."):] if raw_name.startswith("model.") else raw_name

    def vocab_size(self) -> int:
        return self.hp.vocab_size  # the GGUF carries the target's vocabulary

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = DFLASH_TABLE

    def block_prefix(self, bid: int) -> str:
        return f"layers.{bid}."

    def hooks(self) -> dict[str, Hook]:
        return {"embedding": own_embedding, "head": self._head}

    def _head(self, plan: RolePlan, s: DFlashHParams, bid: None, p: str, role: Role) -> None:
        if plan.has("lm_head.weight"):  # else the target's
            shape = (s.vocab_size, s.hidden_size)
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", shape)], shape, role)

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        hp, arch = self.hp, self.gguf_arch
        # llama.cpp's TextModel keys (its Qwen3Model base), then DFlashModel's own
        w = MetadataWriter(arch)
        # a top-level is_causal false is written by TextModel, any other causality after the window
        early_causal = self.cfg.flag("is_causal", default=None) is False
        w.text_model(hp.num_hidden_layers, hp.max_position_embeddings or None, hp.hidden_size, hp.intermediate_size,
                     hp.num_attention_heads, hp.num_key_value_heads, causal=False if early_causal else None,
                     rope_theta=hp.rope_theta, rms_norm_eps=hp.rms_norm_eps,
                     key_length=hp.head_dim if hp.states_head_dim else None)
        if hp.states_rotary_dim:
            w.u32(Keys.Rope.DIMENSION_COUNT, hp.rotary_dim)
        w.f32("{arch}.attention.value_scale", hp.attention_value_scale)
        w.u32(names.block_size_key(arch), hp.block_size)
        if hp.v2:
            for key, value in hp.conv_sizes().items():
                w.u32("{arch}." + key, value)
        w.f32("{arch}.logit_scale", hp.output_multiplier)
        w.f32("{arch}.final_logit_softcapping", hp.final_logit_softcapping)
        w.f32("{arch}.embedding_scale", hp.input_embedding_scale)
        w.array(names.target_layers_key(arch), hp.target_layers, GGUFValueType.INT32)
        if hp.sliding_window:
            w.u32(Keys.Attention.SLIDING_WINDOW, hp.sliding_window)
            w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, hp.sliding_window_pattern, GGUFValueType.BOOL)
        if not early_causal:
            w.flag(names.causal_key(arch), hp.causal)
        if hp.target_mrope:  # M-RoPE target (Qwen3.5): the draft ropes on the temporal section only
            w.array(Keys.Rope.DIMENSION_SECTIONS, [hp.head_dim // 2, 0, 0, 0], GGUFValueType.INT32)
        # upstream writes it after the tokenizer (set_vocab); the engine appends the tokenizer after these
        w.u32(names.MASK_TOKEN_ID_KEY, hp.mask_token_id)
        return w.kv
