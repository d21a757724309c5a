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
DFlash2 (`DFlash2DraftModel`: per-layer
dynamic convolutions and a candidate selector) is refused with a message: neither the conversion of
its extra tensors nor its runtime is implemented here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping

from gguf import GGUFValueType, Keys

from . import names, plugin_class_for, register
from . import transforms as tf
from .base import ArchPlugin, Checkpoint, MetaKV, Role, TensorPlan, config_field, text_config
from .errors import SpecconvError
from .plan_tools import RolePlan

_PRE_BY_MODEL_TYPE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


def _int(cfg: Mapping[str, Any], name: str, default: int | None = None) -> int:
    if cfg.get(name) is not None:
        return int(cfg[name])
    if default is None:
        raise SpecconvError(f"DFlash config.json lacks {name}")
    return default


@register
class DFlash(ArchPlugin):
    hf_architectures: ClassVar[tuple[str, ...]] = ("DFlashDraftModel", "DFlash2DraftModel")
    family: ClassVar[str] = "dflash"
    uses_target: ClassVar[bool] = True  # tokenizer, vocabulary and layer count come from --target
    tokenizer_model: ClassVar[str] = "gpt2"

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        cfg = checkpoint.config
        if "DFlash2DraftModel" in (cfg.get("architectures") or []) or "conv_kernel_size" in (cfg.get("dflash_config") or {}):
            raise SpecconvError("DFlash2 drafters (dynamic convolutions and a candidate selector) are not supported "
                                "yet; DFlashDraftModel checkpoints are")
        if checkpoint.source_dir and (Path(checkpoint.source_dir) / "mask_embedding.pt").exists():
            raise SpecconvError("mask_embedding.pt (a draft that patches the target's embedding) is not supported")
        if checkpoint.target_config is None:
            raise SpecconvError("a DFlash drafter needs its target model: give --target TARGET_DIR (the target's "
                                "config.json and tokenizer)")
        target = text_config(checkpoint.target_config)
        self.dcfg = dict(cfg.get("dflash_config") or {})
        self.H, self.L = _int(cfg, "hidden_size"), _int(cfg, "num_hidden_layers")
        self.n_head = _int(cfg, "num_attention_heads")
        self.n_kv = _int(cfg, "num_key_value_heads", self.n_head)
        self.hd = _int(cfg, "head_dim", self.H // self.n_head)
        self.F = _int(cfg, "intermediate_size")
        self.V, self.L_target = int(target["vocab_size"]), int(target["num_hidden_layers"])
        if int(target["hidden_size"]) != self.H:
            raise SpecconvError(f"the DFlash drafter's hidden size {self.H} differs from the target's "
                                f"{target['hidden_size']}: wrong --target (fc reads k target rows of its own width)")
        if cfg.get("vocab_size") is not None and int(cfg["vocab_size"]) != self.V:
            raise SpecconvError(f"the DFlash drafter was trained for a vocabulary of {cfg['vocab_size']} tokens, the "
                                f"target has {self.V}: wrong --target")
        if self.n_head % self.n_kv:
            raise SpecconvError(f"num_attention_heads {self.n_head} is not a multiple of num_key_value_heads {self.n_kv}")
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias") or cfg.get("use_sliding_window"):
            raise SpecconvError("this DFlash drafter uses gelu, attention biases or sliding windows, which are not "
                                "supported (silu, no biases, full attention)")
        self.block_size = int(self.dcfg.get("block_size", cfg.get("block_size", 16)))
        if self.block_size < 2:
            raise SpecconvError(f"DFlash block_size {self.block_size} must be ≥ 2 (the anchor and one mask)")
        mask = self.dcfg.get("mask_token_id")
        if mask is None or not 0 <= int(mask) < self.V:
            raise SpecconvError(f"dflash_config.mask_token_id {mask!r} is missing or outside the vocabulary [0, {self.V})")
        self.mask_token_id = int(mask)
        self.target_layers = self._target_layers()
        self.tokenizer_dir = checkpoint.target_dir
        self.tokenizer_pre = self._target_tokenizer_pre(checkpoint.target_config)

    def _target_layers(self) -> list[int]:
        """Layer inputs of the target (llama.cpp's convention): the config's output ids + 1."""
        override = self.checkpoint.target_layers
        if override is not None:
            layers, source = [int(i) for i in override], "--target-layers (layer inputs)"
        else:
            ids = self.dcfg.get("target_layer_ids", self.checkpoint.config.get("target_layer_ids"))
            if not ids:
                raise SpecconvError("the DFlash config has no dflash_config.target_layer_ids; give --target-layers "
                                    "(layer inputs)")
            layers, source = [int(i) + 1 for i in ids], f"dflash_config.target_layer_ids {list(ids)} (layer outputs) + 1"
        bad = [j for j in layers if not 1 <= j <= self.L_target]
        if bad:
            raise SpecconvError(f"target layer input {bad[0]} (from {source}) is outside 1..{self.L_target}: the "
                                f"target has {self.L_target} layers; wrong --target?")
        self.notices = [f"dflash.target_layers {layers} (layer inputs) from {source}"]
        return layers

    @staticmethod
    def _target_tokenizer_pre(target_config: Mapping[str, Any]) -> str:
        try:
            return plugin_class_for(target_config).tokenizer_pre
        except SpecconvError:
            model_type = text_config(target_config).get("model_type") or target_config.get("model_type")
            return _PRE_BY_MODEL_TYPE.get(model_type, "default")

    def _target_uses_mrope(self) -> bool:
        tc = text_config(self.checkpoint.target_config or {})
        rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        return isinstance(rope, Mapping) and "mrope_section" in rope

    # ------------------------------------------------------------------ naming

    @property
    def gguf_arch(self) -> str:
        return names.DFLASH

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

    def tensor_plan(self) -> list[TensorPlan]:
        plan, H, F, V, k = RolePlan(self.checkpoint.tensors), self.H, self.F, self.V, len(self.target_layers)
        trunk, q, kv = Role.TRUNK, self.n_head * self.hd, self.n_kv * self.hd
        if plan.has("embed_tokens.weight"):
            plan.add(names.TOKEN_EMBD, [plan.source("embed_tokens.weight", (V, H))], (V, H), trunk)
        plan.add(names.EAGLE3_FC, [plan.source("fc.weight", (H, k * H))], (H, k * H), trunk)
        plan.add(names.ENC_OUTPUT_NORM, [plan.source("hidden_norm.weight", (H,))], (H,), trunk, tf.identity, True)
        for i in range(self.L):
            p = f"layers.{i}."
            plan.add(names.blk(i, "attn_norm"), [plan.source(p + "input_layernorm.weight", (H,))], (H,), trunk,
                     tf.identity, True)
            for part, hf, shape in (("attn_q", "q_proj", (q, H)), ("attn_k", "k_proj", (kv, H)),
                                    ("attn_v", "v_proj", (kv, H)), ("attn_output", "o_proj", (H, q))):
                plan.add(names.blk(i, part), [plan.source(f"{p}self_attn.{hf}.weight", shape)], shape, trunk)
            for part, hf in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
                plan.add(names.blk(i, part), [plan.source(f"{p}self_attn.{hf}.weight", (self.hd,))], (self.hd,),
                         trunk, tf.identity, True)
            plan.add(names.blk(i, "ffn_norm"), [plan.source(p + "post_attention_layernorm.weight", (H,))], (H,),
                     trunk, tf.identity, True)
            for part, shape in (("gate", (F, H)), ("up", (F, H)), ("down", (H, F))):
                plan.add(names.blk(i, f"ffn_{part}"), [plan.source(f"{p}mlp.{part}_proj.weight", shape)], shape, trunk)
        plan.add(names.OUTPUT_NORM, [plan.source("norm.weight", (H,))], (H,), trunk, tf.identity, True)
        if plan.has("lm_head.weight"):
            plan.add(names.OUTPUT, [plan.source("lm_head.weight", (V, H))], (V, H), trunk)
        return plan.finish(self.gguf_arch)

    # ------------------------------------------------------------------ metadata

    def metadata(self, keep_mtp: bool) -> list[MetaKV]:
        cfg, arch = self.checkpoint.config, self.gguf_arch
        u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
        kv: list[MetaKV] = []

        def put(fmt: str, value: Any, vtype: GGUFValueType, sub: GGUFValueType | None = None) -> None:
            kv.append(MetaKV(fmt.format(arch=arch), value, vtype, sub))

        # llama.cpp's TextModel keys (its Qwen3Model base), then DFlashModel's own
        put(Keys.LLM.BLOCK_COUNT, self.L, u32)
        if cfg.get("max_position_embeddings") is not None:
            put(Keys.LLM.CONTEXT_LENGTH, int(cfg["max_position_embeddings"]), u32)
        put(Keys.LLM.EMBEDDING_LENGTH, self.H, u32)
        put(Keys.LLM.FEED_FORWARD_LENGTH, self.F, u32)
        put(Keys.Attention.HEAD_COUNT, self.n_head, u32)
        put(Keys.Attention.HEAD_COUNT_KV, self.n_kv, u32)
        kind = config_field(cfg, "rope_type") or (cfg.get("rope_scaling") or {}).get("type")
        if kind not in (None, "default"):
            raise SpecconvError(f"DFlash rope scaling {kind!r} is not supported (default rope only)")
        if (theta := config_field(cfg, "rope_theta")) is not None:
            put(Keys.Rope.FREQ_BASE, float(theta), f32)
        put(Keys.Attention.LAYERNORM_RMS_EPS, float(cfg.get("rms_norm_eps", 1e-6)), f32)
        if cfg.get("head_dim") is not None:
            put(Keys.Attention.KEY_LENGTH, self.hd, u32)
            put(Keys.Attention.VALUE_LENGTH, self.hd, u32)
        put(names.block_size_key(arch), self.block_size, u32)
        put(names.target_layers_key(arch), list(self.target_layers), GGUFValueType.ARRAY, GGUFValueType.INT32)
        causal = cfg.get("is_causal", self.dcfg.get("causal"))
        if causal is not None:
            put(names.causal_key(arch), bool(causal), GGUFValueType.BOOL)
        if self._target_uses_mrope():  # M-RoPE target (Qwen3.5): the draft ropes on the temporal section only
            put(Keys.Rope.DIMENSION_SECTIONS, [self.hd // 2, 0, 0, 0], GGUFValueType.ARRAY, GGUFValueType.INT32)
        # upstream writes it after the tokenizer (set_vocab); the engine appends the tokenizer after these
        put(names.MASK_TOKEN_ID_KEY, self.mask_token_id, u32)
        return kv
