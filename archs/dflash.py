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

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from gguf import GGUFValueType, Keys

from . import names, plugin_class_for, register
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .metadata import MetadataWriter
from .plan_tools import RolePlan
from .tensor_table import AttentionWidths, Block, TensorSpec, TensorTable, read_by

_PRE_BY_MODEL_TYPE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


@dataclass(frozen=True)
class Sizes(AttentionWidths):
    """The dimensions of the DFlash table: the plugin's from config.json, the graph's from GGUF metadata
    (runtime/graphs/dflash.py, V = "V")."""

    num_hidden_layers: int
    E: int  # hidden size (the target's)
    V: int | str  # vocabulary
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn: int
    E_in: int  # fc's input: the k target layers' rows, concatenated
    v2: bool = False  # DFlash2: dynamic convolutions and the candidate selector
    conv_kernel: int = 0
    conv_group: int = 0
    selector_rank: int = 0

    @property
    def conv_proj(self) -> int:
        return 2 * self.conv_kernel * (self.E // self.conv_group)


def _tags(s: Sizes, bid: int | None = None) -> frozenset[str]:
    return frozenset({"v2"} if s.v2 else ())


def _norm(gguf: str, hf: str, dim=lambda s: (s.E,), **kw) -> TensorSpec:
    return TensorSpec(gguf, hf, dim, f32=True, **kw)  # plain RMSNorm weights, kept F32


def _own(gguf: str, hf: str, shape, on: str = "", f32: bool = False) -> TensorSpec:
    """A tensor of the drafter's decoder (the runtime's MTP graph)."""
    return TensorSpec(gguf, hf, shape, on, f32=f32, role=Role.TRUNK, graph="mtp")


def _conv(side: str, hf: str) -> tuple[TensorSpec, ...]:
    """DFlash2's dynamic convolution around attention or MLP: base kernels [2, K, H] (F32, no `.weight`
    suffix, as upstream names them) and the kernel projection [2·K·H/group, H]."""
    return (TensorSpec(f"blk.{{bid}}.{side}_conv_base", f"{{p}}{hf}.base_kernel", lambda s: (2, s.conv_kernel, s.E),
                       "v2", f32=True, graph="mtp"),
            TensorSpec(f"blk.{{bid}}.{side}_conv_proj.weight", f"{{p}}{hf}.kernel_projection.weight",
                       lambda s: (s.conv_proj, s.E), "v2", graph="mtp"))


_ATTN, _MLP = "{p}self_attn.", "{p}mlp."
_SEL = "candidate_selector."
# A trunk file (Role.TRUNK) the runtime runs as a drafter (its MTP graph); embedding and head are the
# target's unless the checkpoint has its own.
DFLASH_TABLE = TensorTable((
    TensorSpec(names.TOKEN_EMBD, None, lambda s: (s.V, s.E), optional=True, hook="embedding", role=Role.TRUNK),
    _own(names.EAGLE3_FC, "fc.weight", lambda s: (s.E, s.E_in)),
    _own(names.ENC_OUTPUT_NORM, "hidden_norm.weight", lambda s: (s.E,), f32=True),
    _own(names.OUTPUT_NORM, "norm.weight", lambda s: (s.E,), f32=True),
    _own("selector_predecessor.weight", _SEL + "predecessor_codebook", lambda s: (s.V, s.selector_rank), "v2"),
    _own("selector_successor.weight", _SEL + "successor_codebook", lambda s: (s.V, s.selector_rank), "v2"),
    _own("selector_hidden.weight", _SEL + "hidden_projection.weight", lambda s: (s.selector_rank, s.E), "v2"),
    TensorSpec(names.OUTPUT, None, lambda s: (s.V, s.E), optional=True, hook="head", role=Role.TRUNK),
    *read_by("mtp", (
        _norm("blk.{bid}.attn_norm.weight", "{p}input_layernorm.weight"),
        TensorSpec("blk.{bid}.attn_q.weight", _ATTN + "q_proj.weight", lambda s: (s.q, s.E)),
        TensorSpec("blk.{bid}.attn_k.weight", _ATTN + "k_proj.weight", lambda s: (s.kv, s.E)),
        TensorSpec("blk.{bid}.attn_v.weight", _ATTN + "v_proj.weight", lambda s: (s.kv, s.E)),
        TensorSpec("blk.{bid}.attn_output.weight", _ATTN + "o_proj.weight", lambda s: (s.E, s.q)),
        _norm("blk.{bid}.attn_q_norm.weight", _ATTN + "q_norm.weight", lambda s: (s.head_dim,)),
        _norm("blk.{bid}.attn_k_norm.weight", _ATTN + "k_norm.weight", lambda s: (s.head_dim,)),
        _norm("blk.{bid}.ffn_norm.weight", "{p}post_attention_layernorm.weight"),
        TensorSpec("blk.{bid}.ffn_gate.weight", _MLP + "gate_proj.weight", lambda s: (s.ffn, s.E)),
        TensorSpec("blk.{bid}.ffn_up.weight", _MLP + "up_proj.weight", lambda s: (s.ffn, s.E)),
        TensorSpec("blk.{bid}.ffn_down.weight", _MLP + "down_proj.weight", lambda s: (s.E, s.ffn)),
    )),
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
        cfg = self.cfg = ConfigReader(checkpoint.config)
        self.dcfg = cfg.section("dflash_config")
        # DFlash2: per-layer dynamic convolutions and a candidate selector (converted; not run by the runtime)
        self.v2 = "DFlash2DraftModel" in cfg.strings("architectures", default=[]) or self.dcfg.has("conv_kernel_size")
        if checkpoint.source_dir and (Path(checkpoint.source_dir) / "mask_embedding.pt").exists():
            raise SpecconvError("mask_embedding.pt (a draft that patches the target's embedding) is not supported")
        if checkpoint.target_config is None:
            raise SpecconvError("a DFlash drafter needs its target model: give --target TARGET_DIR (the target's "
                                "config.json and tokenizer)")
        self.target = target = ConfigReader(checkpoint.target_config, file="the target's config.json").text_model()
        self.H, self.L = cfg.integer("hidden_size", min=1), cfg.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        self.num_attention_heads = cfg.integer("num_attention_heads", min=1)
        self.n_kv = cfg.integer("num_key_value_heads", default=self.num_attention_heads, min=1)
        self.hd = cfg.integer("head_dim", default=self.H // self.num_attention_heads, min=1)
        self.F = cfg.integer("intermediate_size", min=1)
        self.V, self.L_target = target.integer("vocab_size", min=1), target.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        target_h = target.integer("hidden_size", min=1)
        if target_h != self.H:
            raise SpecconvError(f"the DFlash drafter's hidden size {self.H} differs from the target's "
                                f"{target_h}: wrong --target (fc reads k target rows of its own width)")
        own_vocab = cfg.integer("vocab_size", default=None)
        if own_vocab is not None and own_vocab != self.V:
            raise SpecconvError(f"the DFlash drafter was trained for a vocabulary of {own_vocab} tokens, the "
                                f"target has {self.V}: wrong --target")
        if self.num_attention_heads % self.n_kv:
            raise SpecconvError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.n_kv}")
        if cfg.string("hidden_act", default="silu") != "silu" or cfg.flag("attention_bias", default=False):
            raise SpecconvError("this DFlash drafter uses another activation than silu or attention biases, which "
                                "llama.cpp's dflash graph does not have")
        if self.v2:
            self.conv = {k: self.dcfg.integer(k, min=1) for k in ("conv_kernel_size", "conv_group_size",
                                                                  "selector_rank", "selector_top_k")}
            if self.H % self.conv["conv_group_size"]:
                raise SpecconvError(f"DFlash2 hidden size {self.H} is not a multiple of conv_group_size "
                                    f"{self.conv['conv_group_size']}")
        self.block_size = self.dcfg.integer("block_size", default=cfg.integer("block_size", default=16))
        if self.block_size < 2:
            raise SpecconvError(f"DFlash block_size {self.block_size} must be ≥ 2 (the anchor and one mask)")
        mask = self.dcfg.integer("mask_token_id", default=None, min=None)
        if mask is None or not 0 <= mask < self.V:
            raise SpecconvError(f"dflash_config.mask_token_id {mask!r} is missing or outside the vocabulary [0, {self.V})")
        self.mask_token_id = mask
        self.target_layers = self._target_layers()
        self.tokenizer_dir = checkpoint.target_dir
        self.tokenizer_pre = self._target_tokenizer_pre(checkpoint.target_config)

    def _target_layers(self) -> list[int]:
        """Layer inputs of the target (llama.cpp's convention): the config's output ids + 1."""
        override = self.checkpoint.target_layers
        if override is not None:
            layers, source = [int(i) for i in override], "--target-layers (layer inputs)"
        else:
            ids = self.dcfg.integers("target_layer_ids", default=self.cfg.integers("target_layer_ids", default=None))
            if not ids:
                raise SpecconvError("the DFlash config has no dflash_config.target_layer_ids; give --target-layers "
                                    "(layer inputs)")
            layers, source = [i + 1 for i in ids], f"dflash_config.target_layer_ids {ids} (layer outputs) + 1"
        bad = [j for j in layers if not 0 <= j <= self.L_target]
        if bad:
            raise SpecconvError(f"target layer input {bad[0]} (from {source}) is outside 0..{self.L_target}: the "
                                f"target has {self.L_target} layers; wrong --target?")
        self.notices = [f"dflash.target_layers {layers} (layer inputs) from {source}"]
        return layers

    @staticmethod
    def _target_tokenizer_pre(target_config: Mapping[str, Any]) -> str:
        try:
            return plugin_class_for(target_config).tokenizer_pre
        except SpecconvError:
            target = ConfigReader(target_config, file="the target's config.json")
            model_type = target.text_model().string("model_type", default=None) or target.string("model_type", default=None)
            return _PRE_BY_MODEL_TYPE.get(model_type, "default")

    def _opt(self, name: str) -> float | None:
        """A DFlash number from dflash_config, else the top level (as upstream reads them)."""
        return self.dcfg.number(name, default=self.cfg.number(name, default=None))

    def _target_uses_mrope(self) -> bool:
        rope = self.target.section("rope_parameters")
        if not rope.data:
            rope = self.target.section("rope_scaling")
        return "mrope_section" in rope.data

    # ------------------------------------------------------------------ naming

    @classmethod
    def normalize_name(cls, raw_name: str):
        if raw_name.endswith("rotary_emb.inv_freq"):
            return (None, "rotary inv_freq buffer (recomputed from the config)")
        return raw_name[len("model."):] if raw_name.startswith("model.") else raw_name

    @property
    def n_trunk_layers(self) -> int:
        return self.L

    @property
    def n_mtp_layers(self) -> int:
        return 0

    def vocab_size(self) -> int:
        return self.V  # the GGUF carries the target's vocabulary

    # ------------------------------------------------------------------ tensors

    table: ClassVar[TensorTable] = DFLASH_TABLE

    def sizes(self) -> Sizes:
        conv = self.conv if self.v2 else {}
        return Sizes(num_hidden_layers=self.L, E=self.H, V=self.V, num_attention_heads=self.num_attention_heads, num_key_value_heads=self.n_kv, head_dim=self.hd,
                     ffn=self.F, E_in=len(self.target_layers) * self.H, v2=self.v2,
                     conv_kernel=conv.get("conv_kernel_size", 0), conv_group=conv.get("conv_group_size", 0),
                     selector_rank=conv.get("selector_rank", 0))

    def tensor_plan(self) -> list[TensorPlan]:
        plan = RolePlan(self.checkpoint.tensors)
        blocks = [Block(i, f"layers.{i}.", Role.TRUNK) for i in range(self.L)]
        self.table.plan(plan, self.sizes(), blocks, {"embedding": self._embedding, "head": self._head})
        return plan.finish(self.gguf_arch)

    def _embedding(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        if plan.has("embed_tokens.weight"):  # else the target's
            plan.add(names.TOKEN_EMBD, [plan.source("embed_tokens.weight", (s.V, s.E))], (s.V, s.E), role)

    def _head(self, plan: RolePlan, s: Sizes, bid: None, p: str, role: Role) -> None:
        if plan.has("lm_head.weight"):  # else the target's
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", (s.V, s.E))], (s.V, s.E), role)

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        cfg, arch = self.cfg, self.gguf_arch
        # llama.cpp's TextModel keys (its Qwen3Model base), then DFlashModel's own
        w = MetadataWriter(arch)
        w.text_model(self.L, cfg.integer("max_position_embeddings", default=None), self.H, self.F, self.num_attention_heads,
                     self.n_kv)
        is_causal = cfg.flag("is_causal", default=None)
        early_causal = is_causal is False  # TextModel writes it here; DFlashModel rewrites it in place
        if early_causal:
            w.flag(names.causal_key(arch), False)
        rope = cfg.with_rope()
        kind = rope.string("rope_type", default=None) or cfg.section("rope_scaling").string("type", default=None)
        if kind not in (None, "default"):
            raise SpecconvError(f"DFlash rope scaling {kind!r} is not supported (default rope only)")
        w.f32(Keys.Rope.FREQ_BASE, rope.number("rope_theta", default=None))
        w.f32(Keys.Attention.LAYERNORM_RMS_EPS, cfg.number("rms_norm_eps", default=1e-6))
        if cfg.has("head_dim"):
            w.head_sizes(self.hd)
        if (prf := rope.number("partial_rotary_factor", default=None)) is not None:
            w.u32(Keys.Rope.DIMENSION_COUNT, int(self.hd * prf))
        w.f32("{arch}.attention.value_scale", self.dcfg.number("attention_value_scale", default=None))
        w.u32(names.block_size_key(arch), self.block_size)
        if self.v2:
            for key, value in self.conv.items():
                w.u32("{arch}." + key, value)
        for key, value in (("logit_scale", self._opt("output_multiplier")),
                           ("final_logit_softcapping", self._opt("final_logit_softcapping")),
                           ("embedding_scale", self._opt("input_embedding_scale"))):
            if value is not None and (key != "final_logit_softcapping" or value > 0):
                w.f32("{arch}." + key, value)
        w.array(names.target_layers_key(arch), self.target_layers, GGUFValueType.INT32)
        swa_all = self.dcfg.flag("use_swa", default=False)
        window = self.dcfg.integer("swa_window_size", default=None) or cfg.integer("sliding_window", default=None)
        if (cfg.flag("use_sliding_window", default=False) or swa_all) and window:
            pattern = ([True] * self.L if swa_all else
                       [t == "sliding_attention" for t in cfg.strings("layer_types", default=None) or []])
            w.u32(Keys.Attention.SLIDING_WINDOW, window)
            w.array(Keys.Attention.SLIDING_WINDOW_PATTERN, pattern, GGUFValueType.BOOL)
        causal = is_causal if is_causal is not None else self.dcfg.flag("causal", default=None)
        if not early_causal:
            w.flag(names.causal_key(arch), causal)
        if self._target_uses_mrope():  # M-RoPE target (Qwen3.5): the draft ropes on the temporal section only
            w.array(Keys.Rope.DIMENSION_SECTIONS, [self.hd // 2, 0, 0, 0], GGUFValueType.INT32)
        # upstream writes it after the tokenizer (set_vocab); the engine appends the tokenizer after these
        w.u32(names.MASK_TOKEN_ID_KEY, self.mask_token_id)
        return w.kv
