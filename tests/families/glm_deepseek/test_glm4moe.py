"""glm4moe plugin: a tiny GLM-4.5 with a nextn layer (release naming, re-randomised) converts in every
MTP mode; the files carry what docs/reference/gguf-layout.md §4 / §7.4 requires; llama.cpp loads them and matches
transformers (trunk logits and the nextn head through MtpModel); embedded and sidecar files give
llama.cpp MTP contexts.

Expected values come from the checkpoint's own tensors and config (not from the plugin), and the
logit references are transformers and llama.cpp.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from specconv.archs import SpecconvError
from specconv.runtime.gguf_reader import open_gguf
from tests.fixtures import tiny_glm_deepseek as tiny
from tests.fixtures.gguf_files import convert_gguf

FAMILY = "glm4moe"
N = tiny.N_LAYERS
IDS = [int(x) for x in np.random.default_rng(7).integers(0, tiny.VOCAB - 3, 24)]


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    return tiny.converted(FAMILY, tmp_path_factory.mktemp("glm"))


@pytest.fixture(scope="module")
def hf_tensors(conv):
    return load_file(str(conv[0] / "model.safetensors"))


def _t(f, name):
    return f.tensors[name].to_float32()


def test_modes_block_counts_and_tensor_sets(conv):
    _, files = conv
    emb, none, only = (open_gguf(files[m]) for m in ("embed", "none", "only"))
    sep, side = open_gguf(files["separate"]), open_gguf(files["mtp-separate"])
    assert emb.block_count() == N + 1 and emb.nextn_layers() == 1
    assert none.block_count() == N and none.get("glm4moe.nextn_predict_layers") is None
    assert only.block_count() == N + 1 and only.nextn_layers() == 1
    mtp_names = {n for n in emb.tensors if n.startswith(f"blk.{N}.")}
    trunk_names = set(emb.tensors) - mtp_names
    assert set(none.tensors) == trunk_names and not any(n.startswith(f"blk.{N}.") for n in none.tensors)
    assert set(only.tensors) == mtp_names | {"token_embd.weight", "output_norm.weight", "output.weight"}
    assert not any(n.startswith("blk.0.") for n in only.tensors)  # llama.cpp's mtp_only detection
    # the nextn extras, with the release's embed_tokens / shared_head.head copies kept
    for part in ("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head"):
        assert f"blk.{N}.nextn.{part}.weight" in emb.tensors
    # --mtp separate writes the same files as --mtp none and --mtp only
    assert set(sep.tensors) == set(none.tensors) and set(side.tensors) == set(only.tensors)
    for a, b in ((sep, none), (side, only)):
        for name in a.tensors:
            assert np.array_equal(a.tensors[name].raw(), b.tensors[name].raw()), name


def test_metadata_from_config(conv):
    src, files = conv
    cfg = json.loads((src / "config.json").read_text())
    f = open_gguf(files["embed"])
    g = lambda k: f.get(f"glm4moe.{k}")  # noqa: E731
    hd = cfg["head_dim"]
    assert g("attention.head_count") == cfg["num_attention_heads"]
    assert g("attention.head_count_kv") == cfg["num_key_value_heads"]
    assert g("attention.key_length") == hd and g("attention.value_length") == hd
    assert g("rope.dimension_count") == int(hd * 0.5)  # GLM's default partial_rotary_factor
    assert g("rope.freq_base") == pytest.approx(tiny.ROPE_THETA)
    assert g("feed_forward_length") == cfg["intermediate_size"]
    assert g("expert_count") == cfg["n_routed_experts"] and g("expert_used_count") == cfg["num_experts_per_tok"]
    assert g("expert_feed_forward_length") == cfg["moe_intermediate_size"]
    assert g("expert_shared_count") == cfg["n_shared_experts"]
    assert g("leading_dense_block_count") == cfg["first_k_dense_replace"] == 1
    assert g("expert_group_count") == cfg["n_group"] > 1 and g("expert_group_used_count") == cfg["topk_group"]
    assert g("expert_gating_func") == 2
    assert g("expert_weights_scale") == pytest.approx(cfg["routed_scaling_factor"])
    assert g("expert_weights_norm") is True
    assert g("attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])


def test_tensors_equal_checkpoint(conv, hf_tensors):
    _, files = conv
    f, hf = open_gguf(files["embed"]), {k: v.numpy() for k, v in hf_tensors.items()}
    E = json.loads((conv[0] / "config.json").read_text())["n_routed_experts"]
    # block 0 is dense, blocks 1.. (and the nextn block N) are MoE
    assert "blk.0.ffn_gate.weight" in f.tensors and "blk.0.ffn_gate_inp.weight" not in f.tensors
    for i in (1, N):
        p = f"model.layers.{i}.mlp."
        assert np.array_equal(_t(f, f"blk.{i}.exp_probs_b.bias"), hf[p + "gate.e_score_correction_bias"])
        assert np.array_equal(_t(f, f"blk.{i}.ffn_gate_inp.weight"), hf[p + "gate.weight"])
        for part in ("gate", "up", "down"):
            stacked = np.stack([hf[f"{p}experts.{e}.{part}_proj.weight"] for e in range(E)])
            assert np.array_equal(_t(f, f"blk.{i}.ffn_{part}_exps.weight"), stacked)
            assert np.array_equal(_t(f, f"blk.{i}.ffn_{part}_shexp.weight"), hf[f"{p}shared_experts.{part}_proj.weight"])
        a = f"model.layers.{i}.self_attn."
        for part in ("q", "k", "v"):
            assert np.array_equal(_t(f, f"blk.{i}.attn_{part}.bias"), hf[f"{a}{part}_proj.bias"])
        assert np.array_equal(_t(f, f"blk.{i}.attn_q_norm.weight"), hf[a + "q_norm.weight"])
    # norms are plain weights (no +1) and the nextn copies are the release's own tensors
    assert np.array_equal(_t(f, "blk.2.attn_norm.weight"), hf["model.layers.2.input_layernorm.weight"])
    assert np.array_equal(_t(f, f"blk.{N}.nextn.shared_head_norm.weight"), hf[f"model.layers.{N}.shared_head.norm.weight"])
    assert np.array_equal(_t(f, f"blk.{N}.nextn.eh_proj.weight"), hf[f"model.layers.{N}.eh_proj.weight"])
    assert np.array_equal(_t(f, f"blk.{N}.nextn.embed_tokens.weight"), hf[f"model.layers.{N}.embed_tokens.weight"])


def test_fused_expert_layout_converts_identically(conv, tmp_path):
    fused = tiny.build_tiny(tmp_path / "fused", FAMILY, layout="fused")
    out = convert_gguf(fused, tmp_path / "fused.gguf", mtp="embed")
    a, b = open_gguf(conv[1]["embed"]), open_gguf(out)
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert np.array_equal(a.tensors[name].raw(), b.tensors[name].raw()), name


def test_glm46_style_without_copies(tmp_path):
    """GLM-4.6 ships no nextn embed_tokens / shared_head.head; llama.cpp falls back to the trunk's."""
    src = tiny.build_tiny(tmp_path / "g46", FAMILY, copies=False)
    out = convert_gguf(src, tmp_path / "g46.gguf", mtp="embed")
    f = open_gguf(out)
    assert f"blk.{N}.nextn.eh_proj.weight" in f.tensors
    assert f"blk.{N}.nextn.embed_tokens.weight" not in f.tensors
    assert f"blk.{N}.nextn.shared_head_head.weight" not in f.tensors


def test_checkpoint_without_nextn_tensors_converts_trunk_only(tmp_path):
    # transformers' save_pretrained keeps num_nextn_predict_layers but drops the nextn weights
    src = tiny.build_tiny(tmp_path / "nomtp", FAMILY, mtp=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    f = open_gguf(convert_gguf(src, tmp_path / "t.gguf", mtp="none"))
    assert f.block_count() == N and f.nextn_layers() == 0


@pytest.mark.parametrize("change, message", [
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers=2"),
    ({"n_group": 3}, "expert groups"),
    ({"topk_group": 4}, "expert groups"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_configs_are_refused(conv, tmp_path, change, message):
    from specconv.archs.base import Checkpoint, SourceTensor
    from specconv.archs.glm4moe import Glm4Moe

    cfg = json.loads((conv[0] / "config.json").read_text())
    cfg.update(change)
    tensors = {Glm4Moe.normalize_name(k): SourceTensor(Glm4Moe.normalize_name(k), tuple(v.shape), "F32")
               for k, v in load_file(str(conv[0] / "model.safetensors")).items()}
    with pytest.raises(SpecconvError, match=message):
        Glm4Moe(Checkpoint(cfg, tensors)).tensor_plan()


def test_incomplete_nextn_layer_is_refused(conv, hf_tensors):
    from specconv.archs.base import Checkpoint, SourceTensor
    from specconv.archs.glm4moe import Glm4Moe

    cfg = json.loads((conv[0] / "config.json").read_text())
    tensors = {Glm4Moe.normalize_name(k): SourceTensor(Glm4Moe.normalize_name(k), tuple(v.shape), "F32")
               for k, v in hf_tensors.items() if k != f"model.layers.{N}.hnorm.weight"}
    with pytest.raises(SpecconvError, match="hnorm"):
        Glm4Moe(Checkpoint(cfg, tensors)).tensor_plan()


# ------------------------------------------------------------------ llama.cpp vs transformers

def test_llamacpp_trunk_logits_equal_transformers(conv, llama_peer):
    src, files = conv
    ref, _ = tiny.hf_trunk(src, IDS)
    for mode in ("embed", "none", "separate"):
        diff = float(np.abs(llama_peer.llama_logits(files[mode], IDS) - ref).max())
        print(f"glm4moe llama.cpp vs transformers trunk logits ({mode}): max |Δ| = {diff:.3g}")
        assert diff < 1e-4


def test_llamacpp_mtp_contexts_and_logits_equal_mtpmodel(conv, llama_peer):
    src, files = conv
    tiny.check_llamacpp_mtp_heads(llama_peer, src, files, IDS, "glm4moe")


def test_release_scale_glm45_headers():
    """GLM-4.5's real configuration (92 + 1 layers, 160 experts, head_dim 128 with 96 heads over a
    5120 hidden size, q/k norms, biases): names and shapes from transformers' modules on the meta
    device, per-expert as released; ggml shapes and KV as docs/reference/gguf-layout.md §7.4 gives them."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from specconv.archs.glm4moe import Glm4Moe

    cfg = Glm4MoeConfig(
        vocab_size=151552, hidden_size=5120, intermediate_size=12288, num_hidden_layers=92, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, attention_bias=True, use_qk_norm=True, moe_intermediate_size=1536,
        num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=160, routed_scaling_factor=2.5,
        first_k_dense_replace=3, max_position_embeddings=131072, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})
    plugin = tiny.release_scale_plugin(cfg, Glm4MoeForCausalLM, Glm4Moe, "Glm4MoeForCausalLM", 92)
    plans = {p.name: p for p in plugin.tensor_plan()}
    ggml = lambda n: tuple(reversed(plans[n].shape))  # noqa: E731
    assert ggml("blk.0.attn_q.weight") == (5120, 96 * 128) and ggml("blk.0.attn_k.weight") == (5120, 8 * 128)
    assert ggml("blk.92.attn_output.weight") == (96 * 128, 5120) and ggml("blk.92.attn_q.bias") == (96 * 128,)
    assert ggml("blk.3.ffn_gate_exps.weight") == (5120, 1536, 160) and ggml("blk.92.ffn_down_exps.weight") == (1536, 5120, 160)
    assert ggml("blk.3.ffn_up_shexp.weight") == (5120, 1536) and ggml("blk.92.exp_probs_b.bias") == (160,)
    assert ggml("blk.2.ffn_gate.weight") == (5120, 12288) and "blk.2.ffn_gate_inp.weight" not in plans
    # per block: 2 norms, q/k/v weights and biases, output, q/k norms = 11; dense FFN 3, MoE 2 + 3 + 3
    attn = 2 + 3 + 3 + 1 + 2
    assert len(plans) == 3 + 3 * (attn + 3) + 89 * (attn + 8) + (attn + 8) + 4  # nextn: no copies here
    kv = {m.key: m.value for m in plugin.metadata(keep_mtp=True)}
    expect = {"block_count": 93, "nextn_predict_layers": 1, "attention.head_count": 96, "attention.head_count_kv": 8,
              "attention.key_length": 128, "attention.value_length": 128, "rope.dimension_count": 64,
              "leading_dense_block_count": 3, "expert_count": 160, "expert_used_count": 8,
              "expert_shared_count": 1, "expert_feed_forward_length": 1536, "feed_forward_length": 12288,
              "expert_gating_func": 2, "embedding_length": 5120}
    for key, value in expect.items():
        assert kv[f"glm4moe.{key}"] == value, key
    assert kv["glm4moe.rope.freq_base"] == pytest.approx(1e6)


def test_sharded_checkpoint_converts_identically(conv, tmp_path):
    src = tiny.build_tiny(tmp_path / "sharded", FAMILY, sharded=True)
    assert (src / "model.safetensors.index.json").is_file()
    a, b = open_gguf(conv[1]["embed"]), open_gguf(convert_gguf(src, tmp_path / "s.gguf", mtp="embed"))
    assert set(a.tensors) == set(b.tensors)  # the order follows the shards' reading order
    for name in a.tensors:
        assert np.array_equal(a.tensors[name].raw(), b.tensors[name].raw()), name


@pytest.mark.parametrize("mode, upstream_flag", [("embed", None), ("none", "--no-mtp"), ("only", "--mtp")])
def test_same_files_as_llamacpp_converter(tmp_path, mode, upstream_flag):
    """llama.cpp's own Glm4MoeModel converter (SPECCONV_LLAMA_CPP_SRC) keeps GLM's nextn layer: in
    every mode its tensors (bytes, types, order) and all non-general KV equal ours, the special-token
    ids it fixes by text ([gMASK] as bos, <|user|> as eot, <|observation|> as eom) included."""
    from tests.fixtures.gguf_files import convert_gguf_upstream

    src = tiny.build_tiny(tmp_path / "hf", FAMILY, glm_tokens=True)
    up_path = convert_gguf_upstream(src, tmp_path / "up.gguf", pre="glm4",
                                    extra_args=[upstream_flag] if upstream_flag else [])
    up, ours = open_gguf(up_path), open_gguf(convert_gguf(src, tmp_path / "ours.gguf", mtp=mode))
    assert list(up.tensors) == list(ours.tensors)
    for name, t in up.tensors.items():
        assert t.ggml_type == ours.tensors[name].ggml_type, name
        assert np.array_equal(t.raw(), ours.tensors[name].raw()), name
    keys = lambda f: {k: f.get(k) for k in f.kv if not k.startswith("general.")}  # noqa: E731
    a, b = keys(up), keys(ours)
    differing = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    print(f"glm4moe --mtp {mode} vs llama.cpp's converter: {len(up.tensors)} tensors identical; "
          f"KV differing: {sorted(differing)}")
    assert b.get("tokenizer.ggml.bos_token_id") == a.get("tokenizer.ggml.bos_token_id") is not None
    assert not differing
