"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`) -> GGUF arch `deepseek2` with a nextn layer.

A tiny checkpoint in the release layout (config.json as the release ships it: `first_k_dense_replace`,
`topk_method: noaux_tc`, no `scoring_func`; per-expert tensors; the nextn layer at
`model.layers.{N}` with its embedding/head copies) converts in every MTP mode. llama.cpp loads the
files and matches transformers (trunk) and transformers' MtpModel (nextn head, llama.cpp's rows).
The gating decision is measured: llama.cpp's own converter leaves `expert_gating_func` out for this
config and llama.cpp then routes with softmax, far from transformers; ours writes sigmoid (2).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specconv.archs import SpecconvError
from specconv.runtime.gguf_reader import open_gguf
from tests.fixtures import tiny_glm_deepseek as tiny
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_tools import differing_keys

torch.set_num_threads(1)
FAMILY = "glm4moelite"
N = tiny.N_LAYERS
IDS = [int(x) for x in np.random.default_rng(11).integers(0, tiny.VOCAB - 6, 40)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("glm47")


@pytest.fixture(scope="module")
def conv(root):
    return tiny.converted(FAMILY, root)


def test_release_config_and_modes(conv):
    src, files = conv
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeLiteForCausalLM"] and "scoring_func" not in cfg
    assert cfg["first_k_dense_replace"] == 1 and "mlp_layer_types" not in cfg
    emb, none, only = (open_gguf(files[m]) for m in ("embed", "none", "only"))
    assert emb.arch == "deepseek2" and emb.block_count() == N + 1 and emb.nextn_layers() == 1
    assert none.block_count() == N and none.get("deepseek2.nextn_predict_layers") is None
    mtp_names = {n for n in emb.tensors if n.startswith(f"blk.{N}.")}
    assert set(none.tensors) == set(emb.tensors) - mtp_names
    assert set(only.tensors) == mtp_names | {"token_embd.weight", "output_norm.weight", "output.weight"}
    for part in ("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head"):
        assert f"blk.{N}.nextn.{part}.weight" in emb.tensors
    g = lambda k: emb.get(f"deepseek2.{k}")  # noqa: E731
    assert g("expert_gating_func") == 2 and g("leading_dense_block_count") == 1
    assert g("expert_weights_scale") == pytest.approx(1.8) and g("expert_group_count") == 1
    assert g("attention.head_count_kv") == 1 and g("attention.key_length_mla") == 16 + 8
    assert g("attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert emb.get("tokenizer.ggml.pre") == "glm4"
    sep, side = open_gguf(files["separate"]), open_gguf(files["mtp-separate"])
    for a, b in ((sep, none), (side, only)):
        assert set(a.tensors) == set(b.tensors)
        assert all(np.array_equal(a.tensors[n].raw(), b.tensors[n].raw()) for n in a.tensors)


def _plugin(src, change):
    from specconv.archs.deepseek2 import Glm4MoeLite
    from tests.fixtures.tiny_tools import plugin_on

    return plugin_on(Glm4MoeLite, src, {**json.loads((src / "config.json").read_text()), **change})[0]


@pytest.mark.parametrize("change, message", [
    ({"mlp_layer_types": ["dense", "sparse", "dense"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "dense", "sparse"]}, "disagrees"),  # with first_k_dense_replace 1
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers=2"),
])
def test_bad_configs_are_refused(conv, change, message):
    with pytest.raises(SpecconvError, match=message):
        _plugin(conv[0], change).tensor_plan()


def test_leading_dense_count_from_mlp_layer_types(tmp_path, llama_peer):
    """A config as transformers 5 saves it (`mlp_layer_types`, no `first_k_dense_replace`), with two
    leading dense layers: the count comes from the list, and llama.cpp agrees with transformers."""
    src = tiny.build_tiny(tmp_path / "hf", FAMILY, lite_config="transformers",
                          mlp_layer_types=["dense", "dense", "sparse"])
    cfg = json.loads((src / "config.json").read_text())
    assert "first_k_dense_replace" not in cfg and cfg["mlp_layer_types"] == ["dense", "dense", "sparse"]
    out = convert_gguf(src, tmp_path / "t.gguf", mtp="embed")
    assert open_gguf(out).get("deepseek2.leading_dense_block_count") == 2
    ref, hidden = tiny.hf_trunk(src, IDS)
    diff = float(np.abs(llama_peer.llama_logits(out, IDS) - ref).max())
    mtp = float(np.abs(llama_peer.llama_mtp_logits(out, IDS, hidden=hidden)
                       - tiny.hf_mtp_llamacpp_rows(src, IDS, hidden)).max())
    print(f"glm4moelite (mlp_layer_types, 2 dense) llama.cpp vs transformers: trunk {diff:.3g}, MTP {mtp:.3g}")
    assert diff < 1e-4 and mtp < 1e-4


def test_llamacpp_matches_transformers_trunk_and_mtp(conv, llama_peer):
    from tests.fixtures.mtp_checks import llamacpp_diffs

    for what, diff in llamacpp_diffs(llama_peer, tiny, *conv, IDS):
        print(f"glm4moelite llama.cpp vs transformers, {what}: max |Δ| = {diff:.3g}")
        assert diff < 1e-4


def test_gating_key_decides_llamacpp_routing(conv, tmp_path, llama_peer):
    """llama.cpp's converter writes `expert_gating_func` only from a `scoring_func` in config.json,
    which GLM-4.7-Flash's lacks; llama.cpp then routes with softmax (its sigmoid fallback needs the
    release's 47/48 layers and vocabulary 154880). Its file equals ours except that key, and is far
    from transformers; with `scoring_func: sigmoid` added its file equals ours, key included."""
    import shutil

    from tests.fixtures.gguf_files import convert_gguf_upstream

    src, files = conv
    ref, _ = tiny.hf_trunk(src, IDS)
    ours = open_gguf(files["embed"])
    up_path = convert_gguf_upstream(src, tmp_path / "up.gguf", pre="glm4")
    up = open_gguf(up_path)
    assert differing_keys(up, ours, "deepseek2") == {"deepseek2.expert_gating_func"}
    from specconv.runtime import Context, GraphType, load_model

    llama_up = llama_peer.llama_logits(up_path, IDS)
    off = float(np.abs(llama_up - ref).max())
    runtime_up = Context(load_model(up_path, device="cpu"), GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy()
    same = float(np.abs(runtime_up - llama_up).max())  # the runtime reads a file as llama.cpp does
    fixed = tmp_path / "sigmoid"
    shutil.copytree(src, fixed)
    cfg = json.loads((fixed / "config.json").read_text())
    (fixed / "config.json").write_text(json.dumps({**cfg, "scoring_func": "sigmoid"}))
    up2 = open_gguf(convert_gguf_upstream(fixed, tmp_path / "up2.gguf", pre="glm4"))
    assert differing_keys(up2, ours, "deepseek2") == set()
    ours_diff = float(np.abs(llama_peer.llama_logits(files["embed"], IDS) - ref).max())
    print(f"glm4moelite llama.cpp vs transformers: llama.cpp's converter (no gating key, softmax) {off:.3g}; "
          f"specconv's file (gating 2) {ours_diff:.3g}; specconv runtime vs llama.cpp on the former {same:.3g}")
    assert off > 0.1 and ours_diff < 1e-4 and same < 1e-4


def test_release_scale_headers():
    """GLM-4.7-Flash's own dimensions (transformers' Glm4MoeLiteConfig defaults = the release),
    headers only: MLA KV, 47 + 1 blocks, the nextn block's tensors."""
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    from specconv.archs.deepseek2 import Glm4MoeLite

    cfg = Glm4MoeLiteConfig()
    cfg.num_mtp_layers, cfg.mtp_mlp_layer_types = 1, ["sparse"]
    plugin = tiny.release_scale_plugin(cfg, Glm4MoeLiteForCausalLM, Glm4MoeLite, "Glm4MoeLiteForCausalLM",
                                       cfg.num_hidden_layers, tied_copies=True)
    kv = {m.key: m.value for m in plugin.metadata(keep_mtp=True)}
    plans = plugin.tensor_plan()
    expect = {"block_count": 48, "nextn_predict_layers": 1, "leading_dense_block_count": 1, "expert_count": 64,
              "expert_used_count": 4, "attention.key_length": 576, "attention.value_length": 512,
              "attention.key_length_mla": 256, "attention.value_length_mla": 256, "attention.q_lora_rank": 768,
              "rope.dimension_count": 64, "expert_gating_func": 2, "vocab_size": 154880}
    for key, value in expect.items():
        assert kv[f"deepseek2.{key}"] == value, key
    names = {p.name for p in plans}
    assert {"blk.47.nextn.eh_proj.weight", "blk.47.attn_k_b.weight", "blk.47.ffn_gate_exps.weight"} <= names
    shapes = {p.name: p.shape for p in plans}
    assert shapes["blk.0.attn_k_b.weight"] == (20, 512, 192) and shapes["blk.0.attn_v_b.weight"] == (20, 256, 512)
    print(f"GLM-4.7-Flash headers: {len(plans)} tensors")


def test_remaining_gap_is_transformers_fixed_latent_norm_eps(tmp_path, llama_peer):
    """transformers' MLA latent norms (`q_a_layernorm`, `kv_a_layernorm`) use a fixed eps of 1e-6;
    llama.cpp (and GGUF, which has one `layer_norm_rms_epsilon`) applies the config's 1e-5 to every
    norm. That alone is the ~7e-5 left above: with rms_norm_eps = 1e-6 the same model agrees ~10x closer."""
    src = tiny.build_tiny(tmp_path / "hf", FAMILY, rms_norm_eps=1e-6)
    out = convert_gguf(src, tmp_path / "eps.gguf", mtp="none")
    ref, _ = tiny.hf_trunk(src, IDS)
    diff = float(np.abs(llama_peer.llama_logits(out, IDS) - ref).max())
    print(f"glm4moelite with rms_norm_eps = 1e-6: llama.cpp vs transformers max |Δ| = {diff:.3g}")
    assert diff < 2e-5


@pytest.mark.parametrize("mode, flag", [("none", "--no-mtp"), ("only", "--mtp")])
def test_trunk_only_and_sidecar_equal_llamacpp_modes(conv, tmp_path, mode, flag):
    """Our --mtp none / only files are llama.cpp's converter's --no-mtp / --mtp files, but for the
    gating key (test_gating_key_decides_llamacpp_routing)."""
    from tests.fixtures.gguf_files import convert_gguf_upstream

    src, files = conv
    up = open_gguf(convert_gguf_upstream(src, tmp_path / "up.gguf", pre="glm4", extra_args=[flag]))
    ours = open_gguf(files[mode])
    assert differing_keys(up, ours, "deepseek2") == {"deepseek2.expert_gating_func"}
    print(f"glm4moelite --mtp {mode} = llama.cpp's {flag} (but the gating key): {len(up.tensors)} tensors")


def test_inspect_names_arch_and_graphs(conv):
    from click.testing import CliRunner

    from specconv import cli as cli_module

    for name, serves in (("embed", ["main", "mtp"]), ("none", ["main"]), ("only", ["mtp"])):
        info = json.loads(CliRunner().invoke(cli_module.cli, ["inspect", str(conv[1][name]), "--json"]).output)
        assert info["arch"] == "deepseek2" and sorted(info["serves"]) == serves, (name, info["serves"])
