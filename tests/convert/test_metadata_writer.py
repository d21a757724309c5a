"""archs/metadata.py: the one writer of a plugin's `{arch}.*` keys (shared pieces written once)."""

from __future__ import annotations

from gguf import GGUFValueType as T

from specconv.archs.metadata import MetadataWriter, RopeScaling


def _written(w: MetadataWriter) -> list[tuple]:
    return [(kv.key, kv.value, kv.vtype, kv.sub_type) for kv in w.kv]


def test_text_model_keys_in_llama_cpp_order_with_per_layer_arrays_and_gaps():
    w = MetadataWriter("demo")
    w.text_model(4, None, 64, [96, 96, 192, 192], 8, [2, 2, 1, 1], array_type=T.INT32)
    assert _written(w) == [("demo.block_count", 4, T.UINT32, None), ("demo.embedding_length", 64, T.UINT32, None),
                           ("demo.feed_forward_length", [96, 96, 192, 192], T.ARRAY, T.INT32),
                           ("demo.attention.head_count", 8, T.UINT32, None),
                           ("demo.attention.head_count_kv", [2, 2, 1, 1], T.ARRAY, T.INT32)]


def test_rope_scaling_linear_writes_type_and_factor_yarn_its_set_fields():
    w = MetadataWriter("demo")
    w.rope_scaling(None)
    w.rope_scaling(RopeScaling("linear", 2.0, original_context=4096, beta_fast=32.0))
    w.rope_scaling(RopeScaling("yarn", 4.0, 8192, attn_factor=0.5, beta_slow=1.0, mscale_all_dim=1.0))
    assert _written(w) == [("demo.rope.scaling.type", "linear", T.STRING, None),
                           ("demo.rope.scaling.factor", 2.0, T.FLOAT32, None),
                           ("demo.rope.scaling.type", "yarn", T.STRING, None),
                           ("demo.rope.scaling.factor", 4.0, T.FLOAT32, None),
                           ("demo.rope.scaling.original_context_length", 8192, T.UINT32, None),
                           ("demo.rope.scaling.yarn_attn_factor", 0.5, T.FLOAT32, None),
                           ("demo.rope.scaling.yarn_beta_slow", 1.0, T.FLOAT32, None)]


def test_head_sizes_counts_and_nextn_append_to_a_given_list():
    w = MetadataWriter("demo", [])
    w.head_sizes(128)
    w.head_sizes(576, 512)
    w.experts(64, 8)
    w.expert_groups(None, 4)
    w.nextn(0)
    w.nextn(2)
    assert [(k, v) for k, v, _, _ in _written(w)] == [
        ("demo.attention.key_length", 128), ("demo.attention.value_length", 128),
        ("demo.attention.key_length", 576), ("demo.attention.value_length", 512),
        ("demo.expert_count", 64), ("demo.expert_used_count", 8), ("demo.expert_group_used_count", 4),
        ("demo.nextn_predict_layers", 2)]
    assert MetadataWriter("x", w.kv).kv is w.kv  # plugins extend their base class's list in place


def test_text_model_writes_the_stated_later_keys_in_text_model_order():
    w = MetadataWriter("demo")
    w.text_model(2, 4096, 64, 128, 4, 2, causal=False, rope_scaling=RopeScaling("linear", 2.0),
                 rope_sections=[8, 0, 0, 0], rope_theta=1e6, rope_theta_swa=1e4, rms_norm_eps=1e-6, experts=(8, 2),
                 expert_groups=(None, 1), expert_gating_func=2, key_length=16, value_length=8)
    assert [k for k, *_ in _written(w)][6:] == [
        "demo.attention.causal", "demo.rope.scaling.type", "demo.rope.scaling.factor", "demo.rope.dimension_sections",
        "demo.rope.freq_base", "demo.rope.freq_base_swa", "demo.attention.layer_norm_rms_epsilon", "demo.expert_count",
        "demo.expert_used_count", "demo.expert_group_used_count", "demo.expert_gating_func",
        "demo.attention.key_length", "demo.attention.value_length"]
    assert _written(w)[9] == ("demo.rope.dimension_sections", [8, 0, 0, 0], T.ARRAY, T.INT32)
    bare = MetadataWriter("demo")
    bare.text_model(2, 4096, 64, 128, 4, 2, causal=True, key_length=16)  # a causal model writes no flag
    assert [k for k, *_ in _written(bare)][6:] == ["demo.attention.key_length", "demo.attention.value_length"]
    assert _written(bare)[-1][1] == 16  # value length = key length unless given
