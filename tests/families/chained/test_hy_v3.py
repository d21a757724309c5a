"""hy_v3 plugin (Tencent Hy3, `HYV3ForCausalLM`): metadata from config.json, the names and F32 rule
llama.cpp's hy_v3 loader reads, the MTP count (stated, inferred, inconsistent), skipped MTP copies,
and the same file as llama.cpp's own converter (names, types, order, values, KV) when
SPECCONV_LLAMA_CPP_SRC names its tree. Runtime, llama.cpp and verify checks: test_chained_mtp.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from specconv.archs import SpecconvError
from specconv.archs.hy_v3 import HyV3
from specconv.runtime.gguf_reader import open_gguf
from tests.fixtures import chained_reference as ref_mod
from tests.fixtures import tiny_chained as tiny
from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream
from tests.fixtures.tiny_tools import plugin_on

N, K = tiny.N_LAYERS, tiny.K_MTP["hy_v3"]


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    return ref_mod.converted("hy_v3", tmp_path_factory.mktemp("hy"))


def _plugin(src, config_edit=None, drop=(), extra=None):
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    return plugin_on(HyV3, src, cfg, drop, extra)


def test_metadata_from_config(conv):
    src, files = conv
    cfg = json.loads((src / "config.json").read_text())
    f = open_gguf(files["embed"])
    g = lambda k: f.get(f"hy_v3.{k}")  # noqa: E731
    assert f.get("general.architecture") == "hy_v3"
    assert g("block_count") == N + K and g("nextn_predict_layers") == K
    assert g("attention.head_count") == cfg["num_attention_heads"]
    assert g("attention.head_count_kv") == cfg["num_key_value_heads"]
    assert g("attention.key_length") == g("attention.value_length") == cfg["head_dim"]
    assert g("rope.freq_base") == pytest.approx(tiny.ROPE_THETA)
    assert g("feed_forward_length") == cfg["intermediate_size"]
    assert g("expert_count") == cfg["num_experts"] and g("expert_used_count") == cfg["num_experts_per_tok"]
    assert g("expert_feed_forward_length") == cfg["moe_intermediate_size"]
    assert g("expert_shared_feed_forward_length") == cfg["moe_intermediate_size"] * cfg["num_shared_experts"]
    assert g("expert_weights_scale") == pytest.approx(cfg["router_scaling_factor"])
    assert g("expert_weights_norm") is True and g("expert_gating_func") == 2  # sigmoid
    assert f.get("tokenizer.ggml.pre") == "hy_v4"


def test_names_and_f32_rule(conv, tmp_path):
    src, files = conv
    f = open_gguf(files["embed"])
    q8 = open_gguf(convert_gguf(src, tmp_path / "q8.gguf", outtype="q8_0"))
    # layer 0 is dense (no router), the others and every MTP block MoE with a shared expert
    assert "blk.0.ffn_gate.weight" in f.tensors and "blk.0.ffn_gate_inp.weight" not in f.tensors
    for i in range(1, N + K):
        for part in ("ffn_gate_inp.weight", "exp_probs_b", "ffn_gate_exps.weight", "ffn_up_shexp.weight",
                     "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight"):
            assert f"blk.{i}.{part}" in f.tensors, (i, part)
    for j in range(K):  # the release's final_layernorm is the block's shared_head_norm
        assert f"blk.{N + j}.nextn.shared_head_norm.weight" in f.tensors
    assert f.tensors[f"blk.{N}.ffn_gate_exps.weight"].torch_shape == (8, 32, tiny.HIDDEN)
    for name, t in q8.tensors.items():
        small = name.endswith(("norm.weight", "exp_probs_b", "ffn_gate_inp.weight"))
        assert (t.ggml_type == Q.F32) == small or t.n_dims == 1, name


def test_mtp_count_stated_inferred_and_inconsistent(conv):
    src, _ = conv
    assert _plugin(src)[0].n_mtp_layers == K
    assert _plugin(src, lambda c: c.pop("num_nextn_predict_layers"))[0].n_mtp_layers == K  # from the tensors
    with pytest.raises(SpecconvError, match="num_nextn_predict_layers=2, but the checkpoint holds 3"):
        _plugin(src, lambda c: c.update(num_nextn_predict_layers=2))
    p, _ = _plugin(src, drop=[f"model.layers.{N + j}." for j in range(K)])
    assert p.n_mtp_layers == 0 and "holds no model.layers.3" in p.missing_mtp
    with pytest.raises(SpecconvError, match="not a contiguous run"):
        _plugin(src, drop=[f"model.layers.{N + 1}."])
    with pytest.raises(SpecconvError, match="mlp_layer_types disagrees .* layer 0"):
        _plugin(src, lambda c: c.update(mlp_layer_types=["sparse"] * N))


def test_mtp_copies_skipped_with_a_reason(conv):
    src, _ = conv
    V, H = tiny.VOCAB, tiny.HIDDEN
    p, skipped = _plugin(src, extra={f"model.layers.{N}.shared_head.head.weight": (V, H),
                                     f"model.layers.{N}.embed_tokens.weight": (V, H)})
    assert set(skipped) == {f"model.layers.{N}.shared_head.head.weight", f"model.layers.{N}.embed_tokens.weight"}
    assert all("trunk's are used" in r for r in skipped.values())
    assert not any("shared_head_head" in t.name or "nextn.embed_tokens" in t.name for t in p.tensor_plan())


def test_unsupported_configs_are_refused(conv):
    src, _ = conv
    with pytest.raises(SpecconvError, match="attention_bias"):
        _plugin(src, lambda c: c.update(attention_bias=True))
    with pytest.raises(SpecconvError, match="rope type 'yarn'"):
        _plugin(src, lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e3, "factor": 2.0}))


def test_same_file_as_llama_cpp_converter(conv, tmp_path):
    src, files = conv
    up = open_gguf(convert_gguf_upstream(src, tmp_path / "up.gguf", outtype="f32", pre="hy_v4"))
    ours = open_gguf(files["embed"])
    assert list(ours.tensors) == list(up.tensors)  # names and order
    for name, t in ours.tensors.items():
        u = up.tensors[name]
        assert t.ggml_type == u.ggml_type and t.shape == u.shape, name
        assert np.array_equal(t.to_float32(), u.to_float32()), name
    arch = [k for k in up.kv if k.startswith("hy_v3.")]
    assert [k for k in ours.kv if k.startswith("hy_v3.")] == arch
    assert all(ours.get(k) == up.get(k) for k in arch)
    print(f"hy_v3: {len(ours.tensors)} tensors and {len(arch)} arch keys identical to llama.cpp's converter")
