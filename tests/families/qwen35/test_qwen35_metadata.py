"""qwen35 / qwen35moe metadata (docs/reference/gguf-layout.md §7.1 / §7.2 KV tables): values, types, config forms."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFValueType

from specconv.archs import SpecconvError
from tests.fixtures.qwen35_synth import (DK, DV, E, FE, FF, FS, H, HD, K_CONV, NH, NKV, convert, dense, hf_shapes, kv_dict,
                                     moe, plugin, random_tensors, text_config)


# ----------------------------------------------------------------------------- metadata


def test_metadata_values_and_types_dense():
    cfg, tensors = dense()
    kv = kv_dict(plugin(cfg, tensors))
    u32, f32, arr = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.ARRAY
    want = {
        "qwen35.block_count": (5, u32, None), "qwen35.nextn_predict_layers": (1, u32, None),
        "qwen35.context_length": (2048, u32, None), "qwen35.embedding_length": (H, u32, None),
        "qwen35.feed_forward_length": (FF, u32, None), "qwen35.attention.head_count": (NH, u32, None),
        "qwen35.attention.head_count_kv": (NKV, u32, None), "qwen35.attention.key_length": (HD, u32, None),
        "qwen35.attention.value_length": (HD, u32, None),
        "qwen35.attention.layer_norm_rms_epsilon": (1e-5, f32, None), "qwen35.rope.freq_base": (5e5, f32, None),
        "qwen35.rope.dimension_count": (4, u32, None),  # int(head_dim 8 * partial 0.5)
        "qwen35.rope.dimension_sections": ([1, 1, 0, 0], arr, GGUFValueType.INT32),
        "qwen35.ssm.conv_kernel": (K_CONV, u32, None), "qwen35.ssm.state_size": (DK, u32, None),
        "qwen35.ssm.group_count": (2, u32, None), "qwen35.ssm.time_step_rank": (6, u32, None),
        "qwen35.ssm.inner_size": (6 * DV, u32, None),
        "qwen35.attention.recurrent_layers": ([True, True, True, False, False], arr, GGUFValueType.BOOL),
        "qwen35.full_attention_interval": (4, u32, None),
    }
    assert kv == want


def test_metadata_trunk_only():
    cfg, tensors = dense()
    kv = kv_dict(plugin(cfg, tensors), keep_mtp=False)
    assert kv["qwen35.block_count"][0] == 4 and "qwen35.nextn_predict_layers" not in kv
    assert kv["qwen35.attention.recurrent_layers"][0] == [True, True, True, False]


def test_metadata_moe_keys():
    cfg, tensors = moe()
    kv = kv_dict(plugin(cfg, tensors))
    assert "qwen35moe.feed_forward_length" not in kv
    assert kv["qwen35moe.expert_count"][0] == E and kv["qwen35moe.expert_used_count"][0] == 2
    assert kv["qwen35moe.expert_feed_forward_length"][0] == FE
    assert kv["qwen35moe.expert_shared_feed_forward_length"][0] == FS
    assert not any("gating" in k or "weights_" in k for k in kv)
    assert kv["qwen35moe.block_count"][0] == 5 and kv["qwen35moe.nextn_predict_layers"][0] == 1


def nested(cfg: dict, rope_top_level: bool = False) -> dict:
    """The VL release form of a flat text config (fields under text_config)."""
    text = {k: v for k, v in cfg.items() if k != "architectures"}
    if rope_top_level:
        rope = dict(text.pop("rope_parameters"))
        text["rope_theta"], text["partial_rotary_factor"] = rope.pop("rope_theta"), rope.pop("partial_rotary_factor")
        text["rope_scaling"] = rope
    arch = cfg["architectures"][0].replace("ForCausalLM", "ForConditionalGeneration")
    return {"architectures": [arch], "text_config": text, "tie_word_embeddings": cfg["tie_word_embeddings"],
            "vision_config": {"depth": 1}}


@pytest.mark.parametrize("make", [dense, moe])
def test_nested_and_flat_config_forms_give_identical_metadata(make):
    cfg, tensors = make()
    release = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in tensors.items()}
    release["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 2)
    base = plugin(cfg, tensors)
    for form in (nested(cfg), nested(cfg, rope_top_level=True)):
        other = plugin(form, release)
        assert other.checkpoint.skipped.keys() == {"model.visual.blocks.0.attn.qkv.weight"}
        for keep in (True, False):
            assert other.metadata(keep) == base.metadata(keep)
        a, b = convert(base, tensors), convert(other, release)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_rope_defaults_and_absent_sections():
    cfg, tensors = dense()
    cfg["rope_parameters"] = {"rope_type": "default"}
    cfg["head_dim"] = HD
    kv = kv_dict(plugin(cfg, tensors))
    # transformers' defaults: partial_rotary_factor 0.25, rope_theta 1e4; sections [rot/2, 0, 0, 0]
    assert kv["qwen35.rope.dimension_count"][0] == 2
    assert kv["qwen35.rope.freq_base"][0] == 10000.0
    assert kv["qwen35.rope.dimension_sections"][0] == [1, 0, 0, 0]


@pytest.mark.parametrize("section", [[1, 1, 1], [2, 1], [1, 1, 0, 0, 0]])
def test_rope_sections_must_sum_to_half_the_rotary_dim(section):
    cfg, tensors = dense()
    cfg["rope_parameters"]["mrope_section"] = section
    with pytest.raises(SpecconvError, match="mrope_section"):
        plugin(cfg, tensors)


def test_rope_yarn_scaling_keys_and_unknown_type():
    cfg, tensors = dense()
    cfg["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32.0)
    kv = kv_dict(plugin(cfg, tensors))
    assert kv["qwen35.rope.scaling.type"][0] == "yarn" and kv["qwen35.rope.scaling.factor"][0] == 4.0
    assert kv["qwen35.rope.scaling.original_context_length"][0] == 512
    assert kv["qwen35.rope.scaling.yarn_beta_fast"][0] == 32.0
    cfg["rope_parameters"]["rope_type"] = "longrope"
    with pytest.raises(SpecconvError, match="longrope"):
        plugin(cfg, tensors)


@pytest.mark.parametrize("types, interval, want", [
    (["linear_attention", "full_attention"] * 2, None, 2),   # v5 drops the key; the pattern has period 2
    (["linear_attention"] * 3 + ["full_attention"], None, 4),
    (["linear_attention", "full_attention", "linear_attention", "linear_attention"], None, 4),  # aperiodic
    (["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"], 3, 3),
])
def test_full_attention_interval_follows_layer_types(types, interval, want):
    cfg = text_config(layer_types=types)
    if interval:
        cfg["full_attention_interval"] = interval
    kv = kv_dict(plugin(cfg, random_tensors(hf_shapes(cfg))))
    assert kv["qwen35.full_attention_interval"][0] == want
    assert kv["qwen35.attention.recurrent_layers"][0] == [t == "linear_attention" for t in types] + [False]


def test_layer_types_derived_from_interval_when_absent():
    cfg = text_config(layer_types=["linear_attention", "linear_attention", "full_attention"] * 2, num_hidden_layers=6)
    tensors = random_tensors(hf_shapes(cfg))
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 3
    kv = kv_dict(plugin(cfg, tensors))
    assert kv["qwen35.attention.recurrent_layers"][0] == [True, True, False, True, True, False, False]
    assert kv["qwen35.full_attention_interval"][0] == 3


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(head_dim=6), "rotary dimension 3"),  # int(6 * 0.5) is odd
    (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=2.0), "original_max_position_embeddings"),
    (lambda c: c["rope_parameters"].update(rope_type="linear"), "'linear' is not supported"),  # no factor
    (lambda c: c.update(num_experts_per_tok=9), "exceeds num_experts"),
    (lambda c: c.update(num_hidden_layers="4"), "num_hidden_layers"),
    (lambda c: c.update(mtp_num_hidden_layers=-1), "mtp_num_hidden_layers"),
    (lambda c: c.update(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
])
def test_config_errors(edit, match):
    cfg, tensors = moe()
    edit(cfg)
    with pytest.raises(SpecconvError, match=match):
        plugin(cfg, tensors)


def test_linear_rope_scaling_keys():
    cfg, tensors = dense()
    cfg["rope_parameters"].update(rope_type="linear", factor=2.0)
    kv = kv_dict(plugin(cfg, tensors))
    assert kv["qwen35.rope.scaling.type"][0] == "linear" and kv["qwen35.rope.scaling.factor"][0] == 2.0
    assert "qwen35.rope.scaling.original_context_length" not in kv
