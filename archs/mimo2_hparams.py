"""MiMo-V2-Flash hyperparameters read from config.json, checked once (archs/mimo2.py converts them).

Field names are the release's config.json names (transformers' MiMoV2FlashConfig where it has the
field); config.json is read as the release writes it: transformers 5.23 does not read
`hybrid_layer_pattern`, `rope_theta` / `swa_rope_theta` or `partial_rotary_factor`, and their
transformers forms (`layer_types`, `rope_parameters` per layer type) are read when they are absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config_reader import ConfigReader, MAX_LAYERS
from .errors import SpecconvError


@dataclass(frozen=True)
class Mimo2Hparams:
    num_hidden_layers: int  # trunk layers (the MTP blocks are counted from the checkpoint's names)
    num_nextn_predict_layers: int | None  # as config.json states it (None: not stated)
    hidden_size: int
    vocab_size: int
    intermediate_size: int  # the dense layers' MLP
    num_attention_heads: int
    num_key_value_heads: int  # full-attention layers
    swa_num_key_value_heads: int  # sliding-window layers (and the MTP blocks)
    head_dim: int  # Q / K heads
    v_head_dim: int  # V heads (narrower)
    hybrid_layer_pattern: tuple[int, ...]  # one per trunk layer: 1 = sliding window
    sliding_window: int  # keys visible to a query: sliding_window_size + 1 (transformers' window)
    rope_theta: float
    swa_rope_theta: float
    partial_rotary_factor: float
    attention_value_scale: float | None
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_layer_freq: list | int | None  # one 0 / 1 per layer, or a number (no pattern)
    layernorm_epsilon: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    n_group: int | None
    topk_group: int | None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_config(cls, cfg: ConfigReader) -> Mimo2Hparams:
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
            num_hidden_layers=n, num_nextn_predict_layers=stated_mtp,
            hidden_size=tc.integer("hidden_size", min=1), vocab_size=tc.integer("vocab_size", min=1),
            intermediate_size=tc.integer("intermediate_size"), num_attention_heads=num_attention_heads,
            num_key_value_heads=n_kv, swa_num_key_value_heads=n_kv_swa, head_dim=head_dim, v_head_dim=v_head_dim,
            hybrid_layer_pattern=tuple(int(bool(x)) for x in pattern[:n]),
            sliding_window=window + 1 if window is not None else tc.integer("sliding_window"),
            rope_theta=rope_theta,
            swa_rope_theta=tc.number("swa_rope_theta", default=swa.number("rope_theta", default=rope_theta)),
            partial_rotary_factor=tc.number("partial_rotary_factor",
                                            default=full.number("partial_rotary_factor", default=1.0)))
        rotary = int(head_dim * hp["partial_rotary_factor"])
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise SpecconvError(f"rotary dimension {rotary} (head_dim * partial_rotary_factor) must be even "
                                f"and within the head")
        hp.update(attention_value_scale=tc.number("attention_value_scale", default=None),
                  n_routed_experts=tc.integer("n_routed_experts", "num_local_experts", min=1),
                  num_experts_per_tok=tc.integer("num_experts_per_tok", min=1),
                  moe_intermediate_size=tc.integer("moe_intermediate_size"))
        if tc.string("scoring_func", default="sigmoid") != "sigmoid":
            raise SpecconvError("config.json: scoring_func must be sigmoid (llama.cpp's mimo2 router is)")
        if not tc.flag("norm_topk_prob", default=True):
            raise SpecconvError("config.json: norm_topk_prob=false is not supported (llama.cpp's mimo2 renormalises)")
        if (tc.number("routed_scaling_factor", default=1.0) or 1.0) != 1.0:
            raise SpecconvError("config.json: routed_scaling_factor ≠ 1 is not supported (llama.cpp's mimo2 "
                                "does not scale the routing weights)")
        hp.update(moe_layer_freq=tc.per_layer("moe_layer_freq", "integer"),
                  layernorm_epsilon=tc.number("layernorm_epsilon", "rms_norm_eps", default=1e-5),
                  tie_word_embeddings=cfg.flag("tie_word_embeddings",
                                               default=tc.flag("tie_word_embeddings", default=False)))
        if tc.flag("attention_bias", default=False):
            raise SpecconvError("config.json: attention_bias=true is not supported for mimo2")
        hp.update(max_position_embeddings=tc.integer("max_position_embeddings", default=4096, min=1),
                  n_group=tc.integer("n_group", default=None), topk_group=tc.integer("topk_group", default=None))
        return cls(**hp)
