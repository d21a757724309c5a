"""step35 plugin (Step-3.5-Flash `Step3p5ForCausalLM`, Step-3.7-Flash `Step3p7ForConditionalGeneration`):
metadata from the release config.json, names / transforms / F32 rule of llama.cpp's step35 loader,
the 3.7 layout (nested text_config, vision tower skipped), transformers-style field names, refused
configs, and the same file as llama.cpp's own converter when it reads config.json itself
(SPECCONV_LLAMA_CPP_SRC). Runtime, llama.cpp and verify checks: test_chained_mtp.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from specconv.archs import SpecconvError
from specconv.archs.step35 import Step35
from specconv.runtime.gguf_reader import open_gguf
from tests.fixtures import chained_reference as ref_mod
from tests.fixtures import tiny_chained as tiny
from tests.fixtures.gguf_files import upstream_source
from tests.fixtures.paths import ROOT
from tests.fixtures.tiny_tools import plugin_on

N, K = tiny.N_LAYERS, tiny.K_MTP["step35"]
RUNNER = ROOT / "tests" / "fixtures" / "llamacpp_rawconfig.py"


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    return ref_mod.converted("step35", tmp_path_factory.mktemp("st"))


def _plugin(src, config_edit=None, extra=None, nest=False):
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    if nest:  # Step-3.7-Flash: the text model's config under text_config
        cfg = {"architectures": ["Step3p7ForConditionalGeneration"], "model_type": "step3p7", "text_config": cfg}
    return plugin_on(Step35, src, cfg, extra=extra)


def test_metadata_from_release_config(conv):
    src, files = conv
    cfg = json.loads((src / "config.json").read_text())
    f = open_gguf(files["embed"])
    g = lambda k: f.get(f"step35.{k}")  # noqa: E731
    types = cfg["layer_types"]
    assert g("block_count") == N + K and g("nextn_predict_layers") == K
    other = cfg["attention_other_setting"]
    assert g("attention.head_count") == [other["num_attention_heads"] if t == "sliding_attention"
                                         else cfg["num_attention_heads"] for t in types]
    assert g("attention.head_count_kv") == [cfg["num_attention_groups"]] * (N + K)
    assert g("attention.sliding_window") == cfg["sliding_window"]
    assert g("attention.sliding_window_pattern") == [t == "sliding_attention" for t in types]
    assert g("rope.freq_base") == pytest.approx(tiny.ROPE_THETA) and g("rope.freq_base_swa") == pytest.approx(500.0)
    assert g("expert_count") == cfg["moe_num_experts"] and g("expert_used_count") == cfg["moe_top_k"]
    assert g("expert_shared_feed_forward_length") == cfg["share_expert_dim"]
    assert g("expert_weights_scale") == pytest.approx(1.7) and g("expert_weights_norm") is True
    assert g("leading_dense_block_count") == 1
    assert g("swiglu_clamp_exp") == pytest.approx(cfg["swiglu_limits"])
    assert g("swiglu_clamp_shexp") == pytest.approx(cfg["swiglu_limits_shared"])
    none = open_gguf(files["none"])
    assert none.get("step35.block_count") == N and none.get("step35.nextn_predict_layers") is None


def test_names_transforms_and_f32_rule(conv):
    src, files = conv
    hf = load_file(str(src / "model.safetensors"))
    f = open_gguf(files["embed"])
    t = lambda name: f.tensors[name].to_float32()  # noqa: E731
    # Gemma-style norms get +1; gates and stacked experts are kept; the per-block head is the LM head copy
    assert np.array_equal(t("blk.0.attn_norm.weight"), hf["model.layers.0.input_layernorm.weight"].numpy() + 1)
    assert np.array_equal(t(f"blk.{N}.nextn.shared_head_norm.weight"),
                          hf[f"model.layers.{N}.transformer.shared_head.norm.weight"].numpy() + 1)
    assert np.array_equal(t("blk.1.attn_gate.weight"), hf["model.layers.1.self_attn.g_proj.weight"].numpy())
    assert np.array_equal(t("blk.1.ffn_up_exps.weight"), hf["model.layers.1.moe.up_proj.weight"].numpy())
    assert np.array_equal(t("blk.1.exp_probs_b.bias"), hf["model.layers.1.moe.router_bias"].numpy())
    for j in range(K):
        assert f"blk.{N + j}.nextn.shared_head_head.weight" in f.tensors
    assert "blk.0.ffn_gate.weight" in f.tensors and "blk.0.ffn_gate_inp.weight" not in f.tensors
    for name, x in f.tensors.items():
        assert (x.ggml_type == Q.F32), name  # f32 file: every tensor F32 (q8_0 rule: test_chained_hy_v3)


def test_step37_layout_and_transformers_field_names(conv):
    src, _ = conv
    base, _ = _plugin(src)
    vl, skipped = _plugin(src, nest=True, extra={"vision_model.transformer.resblocks.0.attn.in_proj_weight": (48, 16),
                                                 "vit_large_projector.weight": (64, 32)})
    assert set(skipped) == {"vision_model.transformer.resblocks.0.attn.in_proj_weight", "vit_large_projector.weight"}
    assert [p.name for p in vl.tensor_plan()] == [p.name for p in base.tensor_plan()]
    assert vl.metadata(True) == base.metadata(True)

    def hf_names(c):  # the fields as transformers' Step3p7TextConfig names them
        c["num_key_value_heads"] = c.pop("num_attention_groups")
        c["n_routed_experts"] = c.pop("moe_num_experts")
        c["num_experts_per_tok"] = c.pop("moe_top_k")
    renamed, _ = _plugin(src, hf_names)
    assert renamed.metadata(True) == base.metadata(True)


def test_refused_configs(conv):
    src, _ = conv
    with pytest.raises(SpecconvError, match=r"partial_rotary_factors\[0\] = 1.0"):
        _plugin(src, lambda c: c.update(partial_rotary_factors=[1.0] * (N + K)))
    with pytest.raises(SpecconvError, match="query_pre_attn_scalar"):
        _plugin(src, lambda c: c.update(query_pre_attn_scalar=64))
    with pytest.raises(SpecconvError, match="moe_layers_enum disagrees .* layer 0"):
        _plugin(src, lambda c: c.update(moe_layers_enum="0,1,2,3,4,5"))
    with pytest.raises(SpecconvError, match="num_nextn_predict_layers=1, but the checkpoint holds 3"):
        _plugin(src, lambda c: c.update(num_nextn_predict_layers=1))
    per_element = {f"model.layers.{i}.self_attn.g_proj.weight": (4 * 16, tiny.HIDDEN) for i in (0,)}
    with pytest.raises(SpecconvError, match="g_proj.weight has shape"):
        _plugin(src, extra=per_element)[0].tensor_plan()


def _upstream(src, out, raw_config: bool):
    root = upstream_source()
    if root is None:
        pytest.skip("SPECCONV_LLAMA_CPP_SRC does not name a llama.cpp tree with convert_hf_to_gguf.py")
    tool = RUNNER if raw_config else ROOT / "tools" / "llamacpp_convert.py"
    return subprocess.run([sys.executable, str(tool), str(root), "deepseek-v3", str(src), "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True)


def test_same_file_as_llama_cpp_converter_reading_config_json(conv, tmp_path):
    src, files = conv
    proc = _upstream(src, tmp_path / "up.gguf", raw_config=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    up, ours = open_gguf(tmp_path / "up.gguf"), open_gguf(files["embed"])
    assert list(ours.tensors) == list(up.tensors)
    for name, x in ours.tensors.items():
        u = up.tensors[name]
        assert x.ggml_type == u.ggml_type and x.shape == u.shape and np.array_equal(x.to_float32(), u.to_float32()), name
    arch = [k for k in up.kv if k.startswith("step35.")]
    assert [k for k in ours.kv if k.startswith("step35.")] == arch and all(ours.get(k) == up.get(k) for k in arch)
    import gguf  # value types too (llama.cpp's converter writes Python int lists as INT32 arrays)

    types = lambda path: {k: f.types for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("step35.")}  # noqa: E731
    assert types(files["embed"]) == types(tmp_path / "up.gguf")
    # as shipped, llama.cpp's converter reads the config through transformers, which renames the fields
    failed = _upstream(src, tmp_path / "up2.gguf", raw_config=False)
    print(f"step35: {len(ours.tensors)} tensors, {len(arch)} keys identical to llama.cpp's converter reading "
          f"config.json; through transformers' AutoConfig it fails: {failed.stderr.strip().splitlines()[-1]}")
    assert failed.returncode != 0 and "num_attention_groups" in failed.stderr
