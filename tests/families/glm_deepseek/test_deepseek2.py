"""deepseek2 plugin: a tiny DeepSeek-V3 with its MTP layer (kept as nextn, beyond llama.cpp's own
converter) converts in every MTP mode; MLA is written the way llama.cpp's MLA path loads it
(kv_b split per head, one latent KV head); the gating function is explicit; YaRN and
rope_interleave=False configs also match. llama.cpp loads every file and matches transformers
(trunk) and MtpModel (nextn head); embedded and sidecar files give llama.cpp MTP contexts.
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

FAMILY = "deepseek2"
N = tiny.N_LAYERS
IDS = [int(x) for x in np.random.default_rng(11).integers(0, tiny.VOCAB - 3, 40)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ds")


@pytest.fixture(scope="module")
def conv(root):
    return tiny.converted(FAMILY, root)


@pytest.fixture(scope="module")
def cfg(conv):
    return json.loads((conv[0] / "config.json").read_text())


def test_modes_block_counts_and_tensor_sets(conv):
    _, files = conv
    emb, none, only = (open_gguf(files[m]) for m in ("embed", "none", "only"))
    assert emb.block_count() == N + 1 and emb.nextn_layers() == 1
    assert none.block_count() == N and none.get("deepseek2.nextn_predict_layers") is None
    assert only.block_count() == N + 1 and only.nextn_layers() == 1
    mtp_names = {n for n in emb.tensors if n.startswith(f"blk.{N}.")}
    assert set(none.tensors) == set(emb.tensors) - mtp_names
    assert set(only.tensors) == mtp_names | {"token_embd.weight", "output_norm.weight", "output.weight"}
    for part in ("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head"):
        assert f"blk.{N}.nextn.{part}.weight" in emb.tensors
    # the nextn block is a full MLA + MoE block
    for name in ("attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_k_b", "attn_v_b", "ffn_norm", "ffn_gate_inp"):
        assert f"blk.{N}.{name}.weight" in emb.tensors
    assert f"blk.{N}.exp_probs_b.bias" in emb.tensors
    sep, side = open_gguf(files["separate"]), open_gguf(files["mtp-separate"])
    for a, b in ((sep, none), (side, only)):
        assert set(a.tensors) == set(b.tensors)
        for name in a.tensors:
            assert np.array_equal(a.tensors[name].raw(), b.tensors[name].raw()), name


def test_mla_metadata(conv, cfg):
    f = open_gguf(conv[1]["embed"])
    g = lambda k: f.get(f"deepseek2.{k}")  # noqa: E731
    kvl, dn, dr, dv = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    assert g("attention.head_count") == cfg["num_attention_heads"]
    assert g("attention.head_count_kv") == 1  # MLA as MQA over the latent
    assert g("attention.q_lora_rank") == cfg["q_lora_rank"] and g("attention.kv_lora_rank") == kvl
    assert g("attention.key_length") == kvl + dr and g("attention.value_length") == kvl
    assert g("attention.key_length_mla") == dn + dr and g("attention.value_length_mla") == dv
    assert g("rope.dimension_count") == dr
    assert g("vocab_size") == cfg["vocab_size"]
    assert g("expert_gating_func") == 2  # must be explicit: llama.cpp's deepseek2 default is softmax
    assert g("expert_weights_scale") == pytest.approx(cfg["routed_scaling_factor"])
    assert g("leading_dense_block_count") == cfg["first_k_dense_replace"]
    assert g("expert_group_count") == cfg["n_group"] and g("expert_group_used_count") == cfg["topk_group"]
    assert g("rope.scaling.type") is None


def test_kv_b_split_per_head(conv, cfg):
    src, files = conv
    hf = load_file(str(src / "model.safetensors"))
    f = open_gguf(files["embed"])
    nh, kvl, dn, dv = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for i in (0, N):
        kv_b = hf[f"model.layers.{i}.self_attn.kv_b_proj.weight"].numpy()
        k_b, v_b = f.tensors[f"blk.{i}.attn_k_b.weight"], f.tensors[f"blk.{i}.attn_v_b.weight"]
        assert k_b.shape == (dn, kvl, nh) and v_b.shape == (kvl, dv, nh)  # ggml order (docs/reference/gguf-layout.md §7.5)
        k_b, v_b = k_b.to_float32(), v_b.to_float32()
        for h in range(nh):
            rows = kv_b[h * (dn + dv):(h + 1) * (dn + dv)]
            assert np.array_equal(k_b[h], rows[:dn].T)
            assert np.array_equal(v_b[h], rows[dn:])
        # the routing bias and post-attention norm land where llama.cpp reads them
    assert np.array_equal(f.tensors["blk.1.exp_probs_b.bias"].to_float32(),
                          hf["model.layers.1.mlp.gate.e_score_correction_bias"].numpy())
    assert np.array_equal(f.tensors["blk.1.ffn_norm.weight"].to_float32(),
                          hf["model.layers.1.post_attention_layernorm.weight"].numpy())


def test_yarn_keys(root):
    src, files = tiny.converted(FAMILY, root, yarn=True)
    rope = json.loads((src / "config.json").read_text())["rope_parameters"]
    f = open_gguf(files["embed"])
    g = lambda k: f.get(f"deepseek2.{k}")  # noqa: E731
    assert g("rope.scaling.type") == "yarn"
    assert g("rope.scaling.factor") == pytest.approx(rope["factor"])
    assert g("rope.scaling.original_context_length") == rope["original_max_position_embeddings"]
    assert g("rope.scaling.yarn_beta_fast") == pytest.approx(rope["beta_fast"])
    assert g("rope.scaling.yarn_log_multiplier") == pytest.approx(0.1 * rope["mscale_all_dim"])  # legacy encoding


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias"),
    ({"num_nextn_predict_layers": 3}, "num_nextn_predict_layers=3"),
    ({"n_group": 8}, "expert groups"),  # groups must be fewer than experts
    ({"qk_rope_head_dim": 7}, "shape|even"),
    ({"num_hidden_layers": 27}, "Lite"),  # llama.cpp would ignore q_lora_rank and miss attn_q
])
def test_bad_configs_are_refused(conv, change, message):
    from specconv.archs.base import Checkpoint, SourceTensor
    from specconv.archs.deepseek2 import Deepseek2

    cfg = json.loads((conv[0] / "config.json").read_text())
    cfg.update(change)
    tensors = {}
    for k, v in load_file(str(conv[0] / "model.safetensors")).items():
        name = Deepseek2.normalize_name(k)
        tensors[name] = SourceTensor(name, tuple(v.shape), "F32")
    with pytest.raises(SpecconvError, match=message):
        Deepseek2(Checkpoint(cfg, tensors)).tensor_plan()


# ------------------------------------------------------------------ llama.cpp vs transformers

@pytest.mark.parametrize("variant", [{}, {"yarn": True}, {"yarn": True, "rope_interleave": False}],
                         ids=["default", "yarn", "yarn-rotate-half"])
def test_llamacpp_trunk_logits_equal_transformers(root, llama_peer, variant):
    src, files = tiny.converted(FAMILY, root, **variant)
    ref, _ = tiny.hf_trunk(src, IDS)  # 40 positions: past YaRN's original context of 16
    for mode in ("embed", "none"):
        diff = float(np.abs(llama_peer.llama_logits(files[mode], IDS) - ref).max())
        print(f"deepseek2 {variant} llama.cpp vs transformers trunk logits ({mode}): max |Δ| = {diff:.3g}")
        assert diff < 1e-4


@pytest.mark.parametrize("variant", [{}, {"yarn": True}], ids=["default", "yarn"])
def test_llamacpp_mtp_contexts_and_logits_equal_mtpmodel(root, llama_peer, variant):
    src, files = tiny.converted(FAMILY, root, **variant)
    tiny.check_llamacpp_mtp_heads(llama_peer, src, files, IDS, f"deepseek2 {variant}")


def test_q_lora_free_variant_runs_in_llamacpp(tmp_path, llama_peer):
    """q_lora_rank = null (DeepSeek-V2-Lite style attention): a plain attn_q."""
    src = tiny.build_tiny(tmp_path / "noq", FAMILY, mtp=False, q_lora_rank=None)
    out = convert_gguf(src, tmp_path / "noq.gguf", mtp="none")
    f = open_gguf(out)
    assert "blk.0.attn_q.weight" in f.tensors and "blk.0.attn_q_a.weight" not in f.tensors
    ref, _ = tiny.hf_trunk(src, IDS)
    diff = float(np.abs(llama_peer.llama_logits(out, IDS) - ref).max())
    print(f"deepseek2 q_lora_rank=null llama.cpp vs transformers: max |Δ| = {diff:.3g}")
    assert diff < 1e-4


def test_upstream_converter_differs_only_by_gating_and_nextn(conv, tmp_path, llama_peer):
    """llama.cpp's own converter (SPECCONV_LLAMA_CPP_SRC) drops the MTP layer and leaves out
    expert_gating_func; its trunk tensors and other KV equal ours. Without the key llama.cpp routes
    with softmax: far from transformers. specconv's runtime runs the file as written, like llama.cpp."""
    from specconv.runtime import Context, GraphType, load_model
    from tests.fixtures.gguf_files import convert_gguf_upstream

    src, files = conv
    up_path = convert_gguf_upstream(src, tmp_path / "upstream.gguf", pre="deepseek-v3")
    up, ours = open_gguf(up_path), open_gguf(files["none"])
    assert set(up.tensors) == set(ours.tensors)
    for name in up.tensors:
        assert np.array_equal(up.tensors[name].to_float32(), ours.tensors[name].to_float32()), name
    arch_kv = lambda f: {k: f.get(k) for k in f.kv if k.startswith("deepseek2.")}  # noqa: E731
    a, b = arch_kv(up), arch_kv(ours)
    assert {k for k in set(a) | set(b) if a.get(k) != b.get(k)} == {"deepseek2.expert_gating_func"}
    ref, _ = tiny.hf_trunk(src, IDS)
    llama_up = llama_peer.llama_logits(up_path, IDS)
    ours_up = Context(load_model(up_path, device="cpu"), GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy()
    off = float(np.abs(llama_up - ref).max())
    same = float(np.abs(ours_up - llama_up).max())
    print(f"upstream deepseek2 file (no gating key): llama.cpp vs transformers {off:.3g}; "
          f"specconv runtime vs llama.cpp {same:.3g}")
    assert off > 0.1 and same < 1e-4


def test_release_scale_deepseek_v3_headers():
    """DeepSeek-V3's real configuration (61 + 1 layers, 256 experts, MLA 1536/512/128/64/128, YaRN
    x40): tensor names and shapes from transformers' own modules on the meta device, per-expert as
    in the release; the plan's ggml shapes and KV are those of docs/reference/gguf-layout.md §7.5."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from specconv.archs.base import Role
    from specconv.archs.deepseek2 import Deepseek2

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(max_position_embeddings=163840, rope_parameters=rope, num_nextn_predict_layers=1)
    plugin = tiny.release_scale_plugin(cfg, DeepseekV3ForCausalLM, Deepseek2, "DeepseekV3ForCausalLM", 61,
                                       tied_copies=True)
    plans = {p.name: p for p in plugin.tensor_plan()}
    ggml = lambda n: tuple(reversed(plans[n].shape))  # noqa: E731
    assert plugin.n_mtp_layers == 1
    assert ggml("blk.5.attn_k_b.weight") == (128, 512, 128) and ggml("blk.5.attn_v_b.weight") == (512, 128, 128)
    assert ggml("blk.61.attn_kv_a_mqa.weight") == (7168, 576) and ggml("blk.61.attn_q_b.weight") == (1536, 128 * 192)
    assert ggml("blk.3.ffn_gate_exps.weight") == (7168, 2048, 256) and ggml("blk.3.ffn_down_exps.weight") == (2048, 7168, 256)
    assert ggml("blk.61.nextn.eh_proj.weight") == (14336, 7168) and ggml("blk.0.ffn_gate.weight") == (7168, 18432)
    assert "blk.2.ffn_gate_inp.weight" not in plans and "blk.3.exp_probs_b.bias" in plans
    assert plans["blk.61.nextn.embed_tokens.weight"].role == Role.MTP
    # 3 global + 3 dense + 58 MoE trunk blocks + the nextn block with its 6 extras
    # per block: 2 norms, 8 MLA tensors (q_a, q_a_norm, q_b, kv_a_mqa, kv_a_norm, k_b, v_b, output),
    # then 3 dense FFN tensors, or router + bias + 3 expert stacks + 3 shared-expert matrices
    dense, moe = 2 + 8 + 3, 2 + 8 + 2 + 3 + 3
    assert len(plans) == 3 + 3 * dense + 58 * moe + moe + 6
    kv = {m.key: m.value for m in plugin.metadata(keep_mtp=True)}
    expect = {"block_count": 62, "nextn_predict_layers": 1, "attention.head_count_kv": 1,
              "attention.key_length": 576, "attention.value_length": 512, "attention.key_length_mla": 192,
              "attention.value_length_mla": 128, "attention.q_lora_rank": 1536, "attention.kv_lora_rank": 512,
              "rope.dimension_count": 64, "leading_dense_block_count": 3, "expert_count": 256,
              "expert_used_count": 8, "expert_group_count": 8, "expert_group_used_count": 4,
              "expert_gating_func": 2, "rope.scaling.type": "yarn", "rope.scaling.original_context_length": 4096,
              "vocab_size": 129280, "expert_feed_forward_length": 2048}
    for key, value in expect.items():
        assert kv[f"deepseek2.{key}"] == value, key
    assert kv["deepseek2.rope.scaling.factor"] == pytest.approx(40.0)
    assert kv["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    assert kv["deepseek2.expert_weights_scale"] == pytest.approx(2.5)
    assert "deepseek2.nextn_predict_layers" not in {m.key for m in plugin.metadata(keep_mtp=False)}


def test_missing_fields_mean_transformers_defaults(conv):
    """A config.json without the routing fields means transformers' DeepseekV3Config defaults."""
    from transformers import DeepseekV3Config

    from specconv.archs.base import Checkpoint, SourceTensor
    from specconv.archs.deepseek2 import Deepseek2

    cfg = json.loads((conv[0] / "config.json").read_text())
    for key in ("routed_scaling_factor", "norm_topk_prob", "rms_norm_eps", "max_position_embeddings"):
        cfg.pop(key)
    ref = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    tensors = {}
    for k, v in load_file(str(conv[0] / "model.safetensors")).items():
        name = Deepseek2.normalize_name(k)
        tensors[name] = SourceTensor(name, tuple(v.shape), "F32")
    kv = {m.key: m.value for m in Deepseek2(Checkpoint(cfg, tensors)).metadata(keep_mtp=True)}
    assert kv["deepseek2.expert_weights_scale"] == pytest.approx(ref.routed_scaling_factor)
    assert kv["deepseek2.expert_weights_norm"] == ref.norm_topk_prob
    assert kv["deepseek2.attention.layer_norm_rms_epsilon"] == pytest.approx(ref.rms_norm_eps)
    assert kv["deepseek2.context_length"] == ref.max_position_embeddings
