"""MiMo-V2-Flash hyperparameters: `Mimo2HParams`, read from config.json by the plugin (archs/mimo2.py)
and from GGUF metadata by the graph (runtime/graphs/mimo2.py), checked once.

Field names are the release's config.json names (transformers' MiMoV2FlashConfig where it has the
field); config.json is read as the release writes it: transformers 5.23 does not read
`hybrid_layer_pattern`, `rope_theta` / `swa_rope_theta` or `partial_rotary_factor`, and their
transformers forms (`layer_types`, `rope_parameters` per layer type) are read when they are absent.
Per-block fields cover the trunk and the MTP blocks, which are sliding-window blocks (vLLM's
MiMoV2MTPLayer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from . import names
from .base import Checkpoint
from .chained_mtp import ChainedHParams, check_stated_count, kv_fields
from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError
from .hparams import HParamsReader

_MTP = re.compile(r"^model\.mtp\.layers\.(\d+)\.(.+)$")


@dataclass(kw_only=True)
class Mimo2HParams(ChainedHParams):
    num_attention_heads: int
    num_key_value_heads: list[int]  # per block: swa_num_key_value_heads on sliding-window blocks
    head_dim: int  # Q / K heads
    v_head_dim: int  # V heads (narrower)
    hybrid_layer_pattern: list[int]  # per block: 1 = sliding window
    sliding_window: int  # keys visible to a query: sliding_window_size + 1 (transformers' window)
    rope_theta: float
    swa_rope_theta: float
    rotary_dim: int  # head_dim * partial_rotary_factor
    attention_value_scale: float | None  # None: the output is not scaled
    expert_groups_stated: bool = False  # config.json states n_group / topk_group (the file then has their keys)

    @property
    def v(self) -> int:
        return self.num_key_value_heads * self.v_head_dim

    @property
    def o(self) -> int:
        return self.num_attention_heads * self.v_head_dim

    @property
    def cell_width(self) -> int:  # K and V cells share one width (the larger head; the other is padded)
        return max(self.head_dim, self.v_head_dim)

    def is_sliding(self, i: int) -> bool:
        return bool(self.hybrid_layer_pattern[i])

    @classmethod
    def from_config(cls, checkpoint: Checkpoint) -> "Mimo2HParams":
        """config.json, with what the checkpoint's tensor names say: k MTP layers under
        model.mtp.layers.{0..k-1} (the release states no count), the routed trunk layers."""
        cfg = ConfigReader(checkpoint.config)
        tc = cfg.text_model()
        n = tc.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
        stated_mtp = tc.integer("num_nextn_predict_layers", default=None)
        num_attention_heads = tc.integer("num_attention_heads", min=1)
        n_kv = tc.integer("num_key_value_heads", min=1)
        n_kv_swa = tc.integer("swa_num_key_value_heads", default=2 * n_kv, min=1)  # transformers' rule: twice
        head_dim, v_head_dim = tc.integer("head_dim", min=1), tc.integer("v_head_dim", min=1)
        for key, want in (("swa_num_attention_heads", num_attention_heads), ("swa_head_dim", head_dim),
                          ("swa_v_head_dim", v_head_dim)):
            got = tc.integer(key, default=want)
            if got != want:
                raise SpecconvError(f"config.json: {key} = {got} differs from the full layers' {want} "
                                    f"(llama.cpp's mimo2 has one value for both)")
        if num_attention_heads % n_kv or num_attention_heads % n_kv_swa:
            raise SpecconvError(f"config.json: {num_attention_heads} heads are not a multiple of {n_kv} / {n_kv_swa} KV heads")
        pattern = tc.integers("hybrid_layer_pattern", default=None)
        if pattern is None and tc.has("layer_types"):
            pattern = [int(t == "sliding_attention") for t in tc.strings("layer_types")]
        if pattern is None or len(pattern) < n:
            raise SpecconvError("config.json: hybrid_layer_pattern must list the N trunk layers (1 = sliding window)")
        window = tc.integer("sliding_window_size", default=None)
        # transformers' form (rope_parameters per layer type) when the release's fields are absent
        rp = tc.section("rope_parameters")
        full, swa = rp.section("full_attention"), rp.section("sliding_attention")
        rope_theta = tc.number("rope_theta", default=full.number("rope_theta", default=10000.0))
        hp = dict(
            arch=names.MIMO2, num_hidden_layers=n, mtp_layers_in_config=stated_mtp,
            hidden_size=tc.integer("hidden_size", min=1), vocab_size=tc.integer("vocab_size", min=1),
            intermediate_size=tc.integer("intermediate_size"), num_attention_heads=num_attention_heads,
            head_dim=head_dim, v_head_dim=v_head_dim,
            sliding_window=window + 1 if window is not None else tc.integer("sliding_window"),
            rope_theta=rope_theta,
            swa_rope_theta=tc.number("swa_rope_theta", default=swa.number("rope_theta", default=rope_theta)))
        rotary = int(head_dim * tc.number("partial_rotary_factor",
                                          default=full.number("partial_rotary_factor", default=1.0)))
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise SpecconvError(f"rotary dimension {rotary} (head_dim * partial_rotary_factor) must be even "
                                f"and within the head")
        hp.update(rotary_dim=rotary, attention_value_scale=tc.number("attention_value_scale", default=None),
                  num_experts=tc.integer("n_routed_experts", "num_local_experts", min=1),
                  num_experts_per_tok=tc.integer("num_experts_per_tok", min=1),
                  moe_intermediate_size=tc.integer("moe_intermediate_size"))
        if tc.string("scoring_func", default="sigmoid") != "sigmoid":
            raise SpecconvError("config.json: scoring_func must be sigmoid (llama.cpp's mimo2 router is)")
        if not tc.flag("norm_topk_prob", default=True):
            raise SpecconvError("config.json: norm_topk_prob=false is not supported (llama.cpp's mimo2 renormalises)")
        if (tc.number("routed_scaling_factor", default=1.0) or 1.0) != 1.0:
            raise SpecconvError("config.json: routed_scaling_factor ≠ 1 is not supported (llama.cpp's mimo2 "
                                "does not scale the routing weights)")
        moe_layer_freq = tc.per_layer("moe_layer_freq", "integer")  # one 0 / 1 per layer, or a number (no pattern)
        hp.update(rms_norm_eps=tc.number("layernorm_epsilon", "rms_norm_eps", default=1e-5),
                  tie_word_embeddings=cfg.flag("tie_word_embeddings",
                                               default=tc.flag("tie_word_embeddings", default=False)))
        if tc.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported for mimo2")
        n_group, topk_group = tc.integer("n_group", default=None), tc.integer("topk_group", default=None)
        hp.update(max_position_embeddings=tc.integer("max_position_embeddings", default=4096, min=1),
                  n_group=1 if n_group is None else n_group, topk_group=1 if topk_group is None else topk_group,
                  expert_groups_stated=n_group is not None or topk_group is not None)
        # the checkpoint: k MTP blocks, each a sliding-window block; the routed trunk layers
        seen = {int(m.group(1)) for m in map(_MTP.match, checkpoint.tensors) if m}
        k = max(seen) + 1 if seen else 0
        if seen and sorted(seen) != list(range(k)):
            raise SpecconvError(f"checkpoint holds MTP layers model.mtp.layers.{sorted(seen)}, not 0..{k - 1}")
        check_stated_count(stated_mtp, k, "model.mtp.layers.*")
        moe_layers = frozenset(i for i in range(n) if f"model.layers.{i}.mlp.gate.weight" in checkpoint.tensors)
        if isinstance(moe_layer_freq, list) and len(moe_layer_freq) >= n:
            wrong = [i for i in range(n) if bool(moe_layer_freq[i]) != (i in moe_layers)]
            if wrong:
                raise SpecconvError(f"config.json moe_layer_freq disagrees with the checkpoint at layer {wrong[0]}")
        sliding = [int(bool(x)) for x in pattern[:n]] + [1] * k
        return cls(**hp, num_nextn_predict_layers=k, moe_layers=moe_layers, hybrid_layer_pattern=sliding,
                   num_key_value_heads=[n_kv_swa if s else n_kv for s in sliding])

    @classmethod
    def from_kv(cls, kv: Mapping[str, Any]) -> "Mimo2HParams":
        """GGUF metadata (KV heads per block, as llama.cpp's get_key_or_arr reads them); the FFN widths
        are each block's tensors' (ChainedHParams)."""
        r = HParamsReader(kv)
        arch, key = r.arch, r.key
        total = sum(r.block_counts())
        num_attention_heads, head_dim = key("attention.head_count", type=int), key("attention.key_length", type=int)
        kvs = r.per_layer("attention.head_count_kv", total)
        for i, h in enumerate(kvs):
            if h < 1 or num_attention_heads % h:
                raise SpecconvError(f"{arch}: block {i}: {num_attention_heads} heads are not a multiple of {h} KV heads")
        theta = key("rope.freq_base", 10000.0, float)
        return cls(**kv_fields(r), num_attention_heads=num_attention_heads, num_key_value_heads=kvs, head_dim=head_dim,
                   v_head_dim=key("attention.value_length", head_dim, int),
                   hybrid_layer_pattern=[int(s) for s in r.per_layer("attention.sliding_window_pattern", total, False,
                                                                     bool)],
                   sliding_window=key("attention.sliding_window", 0, int),
                   rotary_dim=key("rope.dimension_count", head_dim, int), rope_theta=theta,
                   swa_rope_theta=key("rope.freq_base_swa", theta, float),
                   attention_value_scale=key("attention.value_scale", None, float) or None,
                   n_group=key("expert_group_count", 1, int) or 1, topk_group=key("expert_group_used_count", 1, int) or 1,
                   expert_groups_stated=r.has("expert_group_count") or r.has("expert_group_used_count"))
