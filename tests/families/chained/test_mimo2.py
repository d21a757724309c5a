"""mimo2 plugin (MiMo-V2-Flash, `MiMoV2FlashForCausalLM`): metadata from the release config.json,
names, the fused attn_qkv of the MTP blocks, the MTP count from `model.mtp.layers.*`, refused
configs; and, against llama.cpp's own converter reading config.json (SPECCONV_LLAMA_CPP_SRC), the
same file except where that converter is wrong for llama.cpp's runtime:
* it writes the MTP blocks' q/k/v split, and llama.cpp's MTP graph then aborts (it needs attn_qkv);
* it writes `sliding_window` (one token narrower than transformers' `sliding_window_size + 1`),
  which moves llama.cpp's trunk logits on a prompt longer than the window.
Runtime, llama.cpp and verify checks on our files: test_chained_mtp.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from specconv.archs import SpecconvError
from specconv.archs.mimo2 import MiMo2
from specconv.runtime.gguf_reader import open_gguf
from tests.fixtures import chained_reference as ref_mod
from tests.fixtures import tiny_chained as tiny
from tests.fixtures.gguf_files import upstream_source
from tests.fixtures.paths import ROOT
from tests.fixtures.tiny_tools import plugin_on

N, K = tiny.N_LAYERS, tiny.K_MTP["mimo2"]
RUNNER = ROOT / "tests" / "fixtures" / "llamacpp_rawconfig.py"
IDS = [int(x) for x in np.random.default_rng(5).integers(0, tiny.VOCAB - 3, 24)]


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    return ref_mod.converted("mimo2", tmp_path_factory.mktemp("mimo"))


def _plugin(src, config_edit=None, drop=()):
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    return plugin_on(MiMo2, src, cfg, drop)[0]


def test_metadata_from_release_config(conv):
    src, files = conv
    cfg = json.loads((src / "config.json").read_text())
    f = open_gguf(files["embed"])
    g = lambda k: f.get(f"mimo2.{k}")  # noqa: E731
    assert g("block_count") == N + K and g("nextn_predict_layers") == K  # counted: the config states none
    assert g("attention.sliding_window") == cfg["sliding_window_size"] + 1  # transformers' window
    assert g("attention.sliding_window_pattern") == cfg["hybrid_layer_pattern"] + [1] * K
    assert g("attention.head_count_kv") == [cfg["swa_num_key_value_heads"] if s else cfg["num_key_value_heads"]
                                            for s in cfg["hybrid_layer_pattern"] + [1] * K]
    assert g("attention.key_length") == cfg["head_dim"] and g("attention.value_length") == cfg["v_head_dim"]
    assert g("rope.dimension_count") == int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    assert g("rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert g("rope.freq_base_swa") == pytest.approx(cfg["swa_rope_theta"])
    assert g("attention.value_scale") == pytest.approx(cfg["attention_value_scale"])
    assert g("expert_group_count") == cfg["n_group"] and g("expert_gating_func") == 2
    assert f.get("tokenizer.ggml.pre") == "qwen2"


def test_names_fused_mtp_attention_and_sinks(conv):
    src, files = conv
    hf = load_file(str(src / "model.safetensors"))
    f = open_gguf(files["embed"])
    for j in range(K):
        b, p = N + j, f"model.mtp.layers.{j}.self_attn."
        qkv = np.concatenate([hf[p + x + "_proj.weight"].numpy() for x in "qkv"])
        assert np.array_equal(f.tensors[f"blk.{b}.attn_qkv.weight"].to_float32(), qkv)
        assert f"blk.{b}.attn_q.weight" not in f.tensors and f"blk.{b}.attn_sinks.weight" in f.tensors
        assert np.array_equal(f.tensors[f"blk.{b}.layer_output_norm.weight"].to_float32(),
                              hf[f"model.mtp.layers.{j}.final_layernorm.weight"].numpy())
        assert np.array_equal(f.tensors[f"blk.{b}.ffn_norm.weight"].to_float32(),
                              hf[f"model.mtp.layers.{j}.pre_mlp_layernorm.weight"].numpy())
    sinks = [i for i in range(N) if f"blk.{i}.attn_sinks.weight" in f.tensors]
    assert sinks == [i for i, s in enumerate(json.loads((src / "config.json").read_text())["hybrid_layer_pattern"]) if s]
    assert "blk.0.attn_q.weight" in f.tensors and "blk.0.ffn_gate.weight" in f.tensors


def test_mtp_count_and_refused_configs(conv):
    src, _ = conv
    assert _plugin(src).n_mtp_layers == K
    assert _plugin(src, drop=["model.mtp."]).n_mtp_layers == 0
    # a count config.json states without the weights: trunk-only, with the reason, never silently
    stripped = _plugin(src, lambda c: c.update(num_nextn_predict_layers=K), drop=["model.mtp."])
    assert stripped.n_mtp_layers == 0 and "holds no model.mtp.layers.* tensors" in stripped.missing_mtp
    with pytest.raises(SpecconvError, match="not 0..2"):
        _plugin(src, drop=["model.mtp.layers.1."])
    with pytest.raises(SpecconvError, match="num_nextn_predict_layers=1, but the checkpoint holds 3"):
        _plugin(src, lambda c: c.update(num_nextn_predict_layers=1))
    for edit, match in (({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
                        ({"scoring_func": "softmax"}, "scoring_func"),
                        ({"norm_topk_prob": False}, "norm_topk_prob"),
                        ({"swa_num_attention_heads": 8}, "swa_num_attention_heads"),
                        ({"moe_layer_freq": [1, 1, 1]}, "moe_layer_freq disagrees .* layer 0")):
        with pytest.raises(SpecconvError, match=match):
            _plugin(src, lambda c, e=edit: c.update(e))


def _upstream(src, out):
    root = upstream_source()
    if root is None:
        pytest.skip("SPECCONV_LLAMA_CPP_SRC does not name a llama.cpp tree with convert_hf_to_gguf.py")
    proc = subprocess.run([sys.executable, str(RUNNER), str(root), "qwen2", str(src), "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_llama_cpp_converter_differs_only_where_it_is_wrong(conv, tmp_path, llama_peer):
    src, files = conv
    up_path = _upstream(src, tmp_path / "up.gguf")
    up, ours = open_gguf(up_path), open_gguf(files["embed"])
    split = {f"blk.{N + j}.attn_{x}.weight" for j in range(K) for x in "qkv"}
    fused = {f"blk.{N + j}.attn_qkv.weight" for j in range(K)}
    assert set(up.tensors) - set(ours.tensors) == split and set(ours.tensors) - set(up.tensors) == fused
    for name in set(up.tensors) & set(ours.tensors):
        assert np.array_equal(up.tensors[name].to_float32(), ours.tensors[name].to_float32()), name
    keys = [k for k in up.kv if k.startswith("mimo2.")]
    assert [k for k in ours.kv if k.startswith("mimo2.")] == keys
    assert [k for k in keys if ours.get(k) != up.get(k)] == ["mimo2.attention.sliding_window"]
    # llama.cpp's MTP graph cannot be built from its own converter's file (a GGML_ASSERT: run apart)
    probe = ("import sys; from tests.fixtures import peers; peers.llama_mtp_context_ok(sys.argv[1])")
    run = lambda path: subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True,  # noqa: E731
                                      cwd=ROOT)
    theirs, mine = run(up_path), run(files["embed"])
    assert theirs.returncode != 0 and "requires fused attn_qkv" in theirs.stderr
    assert mine.returncode == 0, mine.stderr[-2000:]
    # the narrower window moves llama.cpp's trunk logits once the prompt is longer than it
    lg, _ = ref_mod.reference(src, "mimo2").trunk(IDS)
    d_up = float(np.abs(llama_peer.llama_logits(up_path, IDS) - lg).max())
    d_ours = float(np.abs(llama_peer.llama_logits(files["embed"], IDS) - lg).max())
    print(f"mimo2 llama.cpp vs transformers, {len(IDS)}-token prompt: our file {d_ours:.3g}, llama.cpp's converter's "
          f"file {d_up:.3g} (window {up.get('mimo2.attention.sliding_window')} vs "
          f"{ours.get('mimo2.attention.sliding_window')}); its MTP context: "
          f"{next(x for x in theirs.stderr.splitlines() if 'fused attn_qkv' in x).strip()[-80:]}")
    assert d_ours < 1e-4 and d_up > 1e-2


def test_plugin_and_graph_hparams_share_the_release_names(conv):
    """One naming for mimo2: the graph's HParams, read from the converted file through the GGUF key
    reader, gives each config.json quantity under the name the plugin's Mimo2HParams gives it."""
    from specconv.runtime.gguf_file import GGUFModelFile
    from specconv.runtime.graphs import mimo2 as graph
    src, files = conv
    config = _plugin(src).hp
    hp = graph.HParams.from_kv(GGUFModelFile(files["embed"]).kv)
    shared = ("head_dim", "v_head_dim", "sliding_window", "rope_theta", "swa_rope_theta", "rotary_dim")
    got, want = ({n: getattr(h, n) for n in shared} for h in (hp, config))
    print(f"\nmimo2 hparams by their release names: {want}")
    assert got == pytest.approx(want)
    assert hp.hybrid_layer_pattern[:N] == config.hybrid_layer_pattern[:N]
    assert hp.attention_value_scale == pytest.approx(config.attention_value_scale or 1.0)
