"""The qwen35 / qwen35moe plugin: names, shapes, roles, storage types, transforms, metadata, errors.
Expected values are written out from docs/reference/gguf-layout.md §4 / §7.1 / §7.2 / §9 and from the HF config,
never computed by the plugin's own helpers. The forward-level checks (re-tiling, MoE) live in
test_qwen35_math.py, the metadata in test_qwen35_metadata.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from gguf import GGMLQuantizationType

from specconv.archs import Role, SpecconvError, plugin_class_for, supported_architectures
from specconv.archs import names
from tests.fixtures.qwen35_synth import (DK, DV, E, FE, FF, FS, H, HD, K_CONV, NH, NKV, V, convert, dense,
                                     fused_to_per_expert, hf_shapes, kv_dict, moe, plugin, random_tensors,
                                     text_config)

F32 = GGMLQuantizationType.F32


def tiled_to_hf(n: int, nk: int, r: int) -> int:
    """docs/reference/gguf-layout.md §9: GGUF value head n holds HF head (n mod nk)·r + ⌊n/nk⌋."""
    return (n % nk) * r + n // nk


def untile(t: torch.Tensor, dim: int, nk: int, nv: int, block: int) -> torch.Tensor:
    """Inverse of the re-tiling, head by head with an explicit loop."""
    r = nv // nk
    out = torch.empty_like(t)
    for n in range(nv):
        h = tiled_to_hf(n, nk, r)
        out.narrow(dim, h * block, block).copy_(t.narrow(dim, n * block, block))
    return out


# ----------------------------------------------------------------------------- registry and names


def test_registry_covers_the_four_hf_classes():
    for arch, gguf_arch in (("Qwen3_5ForCausalLM", "qwen35"), ("Qwen3_5ForConditionalGeneration", "qwen35"),
                            ("Qwen3_5MoeForCausalLM", "qwen35moe"),
                            ("Qwen3_5MoeForConditionalGeneration", "qwen35moe")):
        assert arch in supported_architectures()
        cls = plugin_class_for({"architectures": [arch]})
        assert cls.family == "qwen35" and cls.tokenizer_pre == "qwen35" and cls.tokenizer_model == "gpt2"
        is_moe = "Moe" in arch
        cfg, tensors = moe() if is_moe else dense()
        cfg["architectures"] = [arch]
        assert plugin(cfg, tensors).gguf_arch == gguf_arch


@pytest.mark.parametrize("raw, expected", [
    ("model.language_model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight"),
    ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("language_model.model.norm.weight", "model.norm.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("model.mtp.fc.weight", "mtp.fc.weight"),
    ("model.language_model.mtp.layers.0.input_layernorm.weight", "mtp.layers.0.input_layernorm.weight"),
    ("mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.gate_up_proj"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_normalize_name(raw, expected):
    assert plugin_class_for({"architectures": ["Qwen3_5ForConditionalGeneration"]}).normalize_name(raw) == expected


@pytest.mark.parametrize("raw", ["model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.linear_fc1.weight",
                                 "model.layers.0.self_attn.rotary_emb.inv_freq",
                                 "model.language_model.rotary_emb.inv_freq"])
def test_normalize_name_skips_towers_and_inv_freq_with_reason(raw):
    out = plugin_class_for({"architectures": ["Qwen3_5ForConditionalGeneration"]}).normalize_name(raw)
    assert isinstance(out, tuple) and out[0] is None and out[1]


def test_names_module_formats():
    assert names.nextn(4, names.NEXTN_EH_PROJ) == "blk.4.nextn.eh_proj.weight"
    assert names.nextn(4, names.NEXTN_SHARED_HEAD_NORM) == "blk.4.nextn.shared_head_norm.weight"
    assert names.blk(2, "ssm_a", None) == "blk.2.ssm_a"
    assert names.blk(2, "ssm_dt", "bias") == "blk.2.ssm_dt.bias"
    assert names.recurrent_layers_key("qwen35") == "qwen35.attention.recurrent_layers"
    assert names.nextn_predict_layers_key("qwen35moe") == "qwen35moe.nextn_predict_layers"
    assert names.target_layers_key() == "eagle3.target_layers"
    with pytest.raises(ValueError):
        names.nextn(0, "bogus")


# ----------------------------------------------------------------------------- tensor map


def expected_dense_map(cfg, n_mtp=1):
    """docs/reference/gguf-layout.md §7.1 tensor table, written out: GGUF name -> (HF source, torch shape, role)."""
    N, nk, nv = cfg["num_hidden_layers"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    C = 2 * nk * DK + nv * DV
    out = {"token_embd.weight": ("model.embed_tokens.weight", (V, H), Role.SHARED),
           "output_norm.weight": ("model.norm.weight", (H,), Role.SHARED),
           "output.weight": ("lm_head.weight", (V, H), Role.SHARED)}

    def block(b, p, linear, role):
        out[f"blk.{b}.attn_norm.weight"] = (p + "input_layernorm.weight", (H,), role)
        out[f"blk.{b}.post_attention_norm.weight"] = (p + "post_attention_layernorm.weight", (H,), role)
        if linear:
            a = p + "linear_attn."
            for g, hf, shape in (("attn_qkv.weight", "in_proj_qkv.weight", (C, H)),
                                 ("attn_gate.weight", "in_proj_z.weight", (nv * DV, H)),
                                 ("ssm_beta.weight", "in_proj_b.weight", (nv, H)),
                                 ("ssm_alpha.weight", "in_proj_a.weight", (nv, H)),
                                 ("ssm_a", "A_log", (nv,)), ("ssm_dt.bias", "dt_bias", (nv,)),
                                 ("ssm_conv1d.weight", "conv1d.weight", (C, K_CONV)),
                                 ("ssm_norm.weight", "norm.weight", (DV,)),
                                 ("ssm_out.weight", "out_proj.weight", (H, nv * DV))):
                out[f"blk.{b}.{g}"] = (a + hf, shape, role)
        else:
            a = p + "self_attn."
            for g, hf, shape in (("attn_q", "q_proj", (2 * NH * HD, H)), ("attn_k", "k_proj", (NKV * HD, H)),
                                 ("attn_v", "v_proj", (NKV * HD, H)), ("attn_output", "o_proj", (H, NH * HD)),
                                 ("attn_q_norm", "q_norm", (HD,)), ("attn_k_norm", "k_norm", (HD,))):
                out[f"blk.{b}.{g}.weight"] = (f"{a}{hf}.weight", shape, role)
        for g, shape in (("gate", (FF, H)), ("up", (FF, H)), ("down", (H, FF))):
            out[f"blk.{b}.ffn_{g}.weight"] = (f"{p}mlp.{g}_proj.weight", shape, role)

    for i, t in enumerate(cfg["layer_types"]):
        block(i, f"model.layers.{i}.", t == "linear_attention", Role.TRUNK)
    for j in range(n_mtp):
        block(N + j, f"mtp.layers.{j}.", False, Role.MTP)
    if n_mtp:
        for g, hf, shape in (("eh_proj", "fc", (H, 2 * H)), ("enorm", "pre_fc_norm_embedding", (H,)),
                             ("hnorm", "pre_fc_norm_hidden", (H,)), ("shared_head_norm", "norm", (H,))):
            out[f"blk.{N}.nextn.{g}.weight"] = (f"mtp.{hf}.weight", shape, Role.MTP)
    return out


def test_dense_plan_matches_reference_table():
    cfg, tensors = dense()
    plans = plugin(cfg, tensors).tensor_plan()
    got = {p.name: (p.sources[0] if len(p.sources) == 1 else p.sources, p.shape, p.role) for p in plans}
    assert len(got) == len(plans), "duplicate GGUF names"
    assert got == expected_dense_map(cfg)


def test_mtp_sidecar_tensor_count_matches_upstream():
    # docs/reference/gguf-layout.md §4.2: tiny qwen35 (4 trunk + 1 MTP) -> 15 MTP tensors + 3 shared = 18.
    cfg, tensors = dense()
    plans = plugin(cfg, tensors).tensor_plan()
    assert sum(p.role == Role.MTP for p in plans) == 15
    assert {p.name for p in plans if p.role == Role.SHARED} == {"token_embd.weight", "output_norm.weight",
                                                                "output.weight"}


def test_storage_types_follow_the_f32_rule():
    """§2: 1-D, *_norm.weight, names without .weight, ssm_conv1d, ffn_gate_inp(_shexp) are F32."""
    cfg, tensors = moe()
    for p in plugin(cfg, tensors).tensor_plan():
        must_f32 = (len(p.shape) <= 1 or p.name.endswith("_norm.weight") or not p.name.endswith(".weight")
                    or ".ssm_conv1d." in p.name or ".ffn_gate_inp." in p.name or ".ffn_gate_inp_shexp." in p.name)
        assert (p.force_type == F32) == must_f32, p.name


def test_norms_get_plus_one_except_ssm_norm():
    cfg, tensors = dense()
    out = convert(plugin(cfg, tensors), tensors)
    ref = expected_dense_map(cfg)
    n_checked = 0
    for name, (src, _, _) in ref.items():
        if not name.endswith("norm.weight"):
            continue
        want = tensors[src] if name.endswith("ssm_norm.weight") else tensors[src] + 1
        assert torch.equal(out[name], want), name
        n_checked += 1
    # 5 blocks x 2 layer norms, 3 ssm_norm, 2 full-attention blocks x q/k norm, 3 nextn norms, output_norm
    assert n_checked == 5 * 2 + 3 + 2 * 2 + 3 + 1


def test_unchanged_tensors_are_byte_identical():
    cfg, tensors = dense()
    out = convert(plugin(cfg, tensors), tensors)
    for name, (src, _, _) in expected_dense_map(cfg).items():
        if any(x in name for x in ("attn_q.", "attn_k.", "attn_v.", "attn_output", "ffn_", "token_embd", "output.w",
                                   "eh_proj")):
            assert torch.equal(out[name], tensors[src]), name  # q_proj stays unsplit ([q_h; gate_h] rows)


@pytest.mark.parametrize("nk, nv", [(2, 6), (3, 6), (2, 2), (1, 4)])
def test_retiling_inverts_per_reference_section_9(nk, nv):
    cfg, tensors = dense(nk=nk, nv=nv)
    out = convert(plugin(cfg, tensors), tensors)
    qk = 2 * nk * DK
    for i in range(3):  # the linear-attention layers
        a, b = f"model.layers.{i}.linear_attn.", f"blk.{i}."
        qkv = out[b + "attn_qkv.weight"]
        assert torch.equal(qkv[:qk], tensors[a + "in_proj_qkv.weight"][:qk])  # q and k rows untouched
        assert torch.equal(untile(qkv[qk:], 0, nk, nv, DV), tensors[a + "in_proj_qkv.weight"][qk:])
        assert torch.equal(untile(out[b + "attn_gate.weight"], 0, nk, nv, DV), tensors[a + "in_proj_z.weight"])
        assert torch.equal(untile(out[b + "ssm_beta.weight"], 0, nk, nv, 1), tensors[a + "in_proj_b.weight"])
        assert torch.equal(untile(out[b + "ssm_alpha.weight"], 0, nk, nv, 1), tensors[a + "in_proj_a.weight"])
        assert torch.equal(untile(out[b + "ssm_dt.bias"], 0, nk, nv, 1), tensors[a + "dt_bias"])
        A_log = torch.log(-untile(out[b + "ssm_a"], 0, nk, nv, 1))
        assert torch.allclose(A_log, tensors[a + "A_log"], atol=1e-6)
        conv = out[b + "ssm_conv1d.weight"]
        hf_conv = tensors[a + "conv1d.weight"][:, 0, :]
        assert torch.equal(conv[:qk], hf_conv[:qk])
        assert torch.equal(untile(conv[qk:], 0, nk, nv, DV), hf_conv[qk:])
        assert torch.equal(untile(out[b + "ssm_out.weight"], 1, nk, nv, DV), tensors[a + "out_proj.weight"])
        assert torch.equal(out[b + "ssm_norm.weight"], tensors[a + "norm.weight"])
        if nk == nv or nk == 1:  # a single key head or r = 1: tiled order == grouped order
            assert torch.equal(out[b + "attn_gate.weight"], tensors[a + "in_proj_z.weight"])
        else:
            assert not torch.equal(out[b + "attn_gate.weight"], tensors[a + "in_proj_z.weight"])


def test_conv1d_squeezed_source_is_accepted():
    cfg, tensors = dense()
    squeezed = dict(tensors)
    for name in list(squeezed):
        if name.endswith("conv1d.weight"):
            squeezed[name] = squeezed[name][:, 0, :].clone()
    a, b = convert(plugin(cfg, tensors), tensors), convert(plugin(cfg, squeezed), squeezed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_tied_embeddings_omit_output():
    cfg, tensors = dense()
    cfg["tie_word_embeddings"] = True
    names_with_head = {p.name for p in plugin(cfg, tensors).tensor_plan()}
    del tensors["lm_head.weight"]
    names_without = {p.name for p in plugin(cfg, tensors).tensor_plan()}
    assert "output.weight" not in names_with_head and names_with_head == names_without


def test_vocab_size_is_embedding_rows():
    cfg, tensors = dense()
    assert plugin(cfg, tensors).vocab_size() == V


# ----------------------------------------------------------------------------- MoE


def test_moe_plan_names_shapes_and_roles():
    cfg, tensors = moe()
    plans = {p.name: p for p in plugin(cfg, tensors).tensor_plan()}
    for b in range(5):  # every layer, the MTP block included, is MoE
        role = Role.MTP if b == 4 else Role.TRUNK
        for name, shape in ((f"blk.{b}.ffn_gate_inp.weight", (E, H)), (f"blk.{b}.ffn_gate_exps.weight", (E, FE, H)),
                            (f"blk.{b}.ffn_up_exps.weight", (E, FE, H)), (f"blk.{b}.ffn_down_exps.weight", (E, H, FE)),
                            (f"blk.{b}.ffn_gate_shexp.weight", (FS, H)), (f"blk.{b}.ffn_up_shexp.weight", (FS, H)),
                            (f"blk.{b}.ffn_down_shexp.weight", (H, FS)), (f"blk.{b}.ffn_gate_inp_shexp.weight", (1, H))):
            assert plans[name].shape == shape and plans[name].role == role, name
        assert f"blk.{b}.ffn_gate.weight" not in plans


def test_moe_both_expert_layouts_give_identical_tensors():
    cfg, fused = moe()
    split = fused_to_per_expert(fused)
    assert not any(n.endswith("gate_up_proj") for n in split)
    a, b = convert(plugin(cfg, fused), fused), convert(plugin(cfg, split), split)
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    for b_id, p in ((0, "model.layers.0."), (4, "mtp.layers.0.")):  # expert stacking keyed on the GGUF block id
        gate_up = fused[p + "mlp.experts.gate_up_proj"]
        for e in range(E):
            assert torch.equal(a[f"blk.{b_id}.ffn_gate_exps.weight"][e], gate_up[e, :FE])  # gate = first half
            assert torch.equal(a[f"blk.{b_id}.ffn_up_exps.weight"][e], gate_up[e, FE:])
            assert torch.equal(a[f"blk.{b_id}.ffn_down_exps.weight"][e], fused[p + "mlp.experts.down_proj"][e])


def test_moe_fused_with_weight_suffix_is_accepted():
    cfg, fused = moe()
    renamed = {(n + ".weight" if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else n): t
               for n, t in fused.items()}
    a, b = convert(plugin(cfg, fused), fused), convert(plugin(cfg, renamed), renamed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_moe_missing_expert_names_the_layer():
    cfg, fused = moe()
    split = fused_to_per_expert(fused)
    del split["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(SpecconvError, match=r"layer 2 .*experts \[3\] missing"):
        plugin(cfg, split).tensor_plan()


def test_moe_mixed_or_incomplete_fused_layouts_are_errors():
    cfg, fused = moe()
    mixed = dict(fused)
    mixed["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(FE, H)
    with pytest.raises(SpecconvError, match="both fused and per-expert"):
        plugin(cfg, mixed).tensor_plan()
    partial = dict(fused)
    del partial["model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(SpecconvError, match="lack model.layers.1.mlp.experts.down_proj"):
        plugin(cfg, partial).tensor_plan()
    none = {n: t for n, t in fused.items() if "layers.1.mlp.experts" not in n}
    with pytest.raises(SpecconvError, match="layer 1 .*no expert tensors"):
        plugin(cfg, none).tensor_plan()


def test_moe_extra_expert_id_is_an_error():
    cfg, fused = moe()
    split = fused_to_per_expert(fused)
    for part in ("gate", "up", "down"):
        split[f"model.layers.0.mlp.experts.{E}.{part}_proj.weight"] = split[f"model.layers.0.mlp.experts.0.{part}_proj.weight"]
    with pytest.raises(SpecconvError, match=f"expert ids \\[{E}\\] >= num_experts"):
        plugin(cfg, split).tensor_plan()


# ----------------------------------------------------------------------------- MTP


def test_mtp_count_from_tensor_names_when_config_lacks_it():
    for mtp_cfg in (None, 0):
        cfg, tensors = dense(mtp=mtp_cfg)
        p = plugin(cfg, tensors)
        assert p.n_mtp_layers == 1 and p.n_trunk_layers == 4
        assert kv_dict(p)["qwen35.nextn_predict_layers"][0] == 1
        assert kv_dict(p)["qwen35.block_count"][0] == 5


def test_mtp_config_and_names_must_agree():
    cfg = text_config(mtp=1)
    no_mtp = random_tensors(hf_shapes(cfg, n_mtp=0))
    stripped = plugin(cfg, no_mtp)  # a stripped head: recorded, refused by the engine unless --mtp none
    assert stripped.n_mtp_layers == 0
    assert re.search(r"mtp_num_hidden_layers=1.*0 MTP layer", stripped.missing_mtp)
    cfg2 = text_config(mtp=2)
    with pytest.raises(SpecconvError, match=r"mtp_num_hidden_layers=2.*1 MTP layer"):
        plugin(cfg2, random_tensors(hf_shapes(cfg2, n_mtp=1)))


def test_no_mtp_anywhere_gives_a_trunk_only_model():
    cfg = text_config(mtp=None)
    tensors = random_tensors(hf_shapes(cfg, n_mtp=0))
    p = plugin(cfg, tensors)
    assert p.n_mtp_layers == 0
    assert all(pl.role != Role.MTP for pl in p.tensor_plan())
    kv = kv_dict(p, keep_mtp=True)
    assert "qwen35.nextn_predict_layers" not in kv and kv["qwen35.block_count"][0] == 4
    assert kv["qwen35.attention.recurrent_layers"][0] == [True, True, True, False]


def test_mtp_tensors_without_a_block_are_an_error():
    cfg = text_config(mtp=None)
    tensors = random_tensors(hf_shapes(cfg, n_mtp=0))
    tensors["mtp.fc.weight"] = torch.zeros(H, 2 * H)
    with pytest.raises(SpecconvError, match="no mtp.layers"):
        plugin(cfg, tensors)


def test_model_mtp_prefix_is_the_same_as_mtp():
    cfg, tensors = dense()
    prefixed = {("model." + n if n.startswith("mtp.") else n): t for n, t in tensors.items()}
    a, b = convert(plugin(cfg, tensors), tensors), convert(plugin(cfg, prefixed), prefixed)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# ----------------------------------------------------------------------------- errors


def test_dk_ne_dv_is_rejected():
    cfg, tensors = dense()
    cfg["linear_value_head_dim"] = DV * 2
    with pytest.raises(SpecconvError, match=r"linear_key_head_dim \(8\) != linear_value_head_dim \(16\)"):
        plugin(cfg, tensors)


def test_nv_not_multiple_of_nk_is_rejected():
    cfg, tensors = dense()
    cfg["linear_num_value_heads"] = 5
    with pytest.raises(SpecconvError, match="not a multiple"):
        plugin(cfg, tensors)


def test_shape_mismatch_names_tensor_and_both_shapes():
    cfg, tensors = dense()
    tensors["model.layers.1.linear_attn.in_proj_z.weight"] = torch.zeros(40, H)
    with pytest.raises(SpecconvError, match=r"model\.layers\.1\.linear_attn\.in_proj_z\.weight has shape \[40, 32\].*\[48, 32\]"):
        plugin(cfg, tensors).tensor_plan()
    cfg, tensors = dense()
    cfg["vocab_size"] = V + 2
    with pytest.raises(SpecconvError, match=r"model\.embed_tokens\.weight has shape \[48, 32\].*\[50, 32\]"):
        plugin(cfg, tensors).tensor_plan()


def test_missing_and_unexpected_tensors():
    cfg, tensors = dense()
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    with pytest.raises(SpecconvError, match="lacks tensor model.layers.3.self_attn.k_norm.weight"):
        plugin(cfg, tensors).tensor_plan()
    cfg, tensors = dense()
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(4)
    with pytest.raises(SpecconvError, match="unexpected tensor.*model.layers.0.self_attn.q_proj.bias"):
        plugin(cfg, tensors).tensor_plan()
    cfg, tensors = dense()
    del tensors["lm_head.weight"]
    with pytest.raises(SpecconvError, match="lm_head.weight"):
        plugin(cfg, tensors).tensor_plan()


def test_layer_type_and_tensor_kind_must_agree():
    cfg, tensors = dense()
    cfg["layer_types"] = ["full_attention"] + cfg["layer_types"][1:]  # layer 0 holds linear_attn tensors
    with pytest.raises(SpecconvError, match="lacks tensor model.layers.0.self_attn"):
        plugin(cfg, tensors).tensor_plan()


@pytest.mark.parametrize("types, match", [(["linear_attention"] * 3, "3 entries"),
                                          (["linear_attention"] * 3 + ["sliding_attention"], "sliding_attention")])
def test_bad_layer_types(types, match):
    cfg, tensors = dense()
    cfg["layer_types"] = types
    with pytest.raises(SpecconvError, match=match):
        plugin(cfg, tensors)


def test_non_float_dtype_is_rejected():
    cfg, tensors = dense()
    with pytest.raises(SpecconvError, match="F8_E4M3"):
        plugin(cfg, tensors, dtypes={"model.layers.0.mlp.up_proj.weight": "F8_E4M3"}).tensor_plan()


def test_missing_required_config_field_and_dedicated_mtp_embeddings():
    cfg, tensors = dense()
    del cfg["hidden_size"]
    with pytest.raises(SpecconvError, match="hidden_size"):
        plugin(cfg, tensors)
    cfg, tensors = dense()
    cfg["mtp_use_dedicated_embeddings"] = True
    with pytest.raises(SpecconvError, match="mtp_use_dedicated_embeddings"):
        plugin(cfg, tensors)
    for field, value in (("attention_bias", True), ("hidden_act", "gelu")):
        cfg, tensors = dense()
        cfg[field] = value
        with pytest.raises(SpecconvError, match=field):
            plugin(cfg, tensors)
    cfg, tensors = moe()
    del cfg["num_experts"]
    with pytest.raises(SpecconvError, match="num_experts"):
        plugin(cfg, tensors)


def test_release_scale_dimensions_headers_only():
    """Qwen3.5-9B-like dims (docs/reference/gguf-layout.md §7.1, docs/reference/model-math.md §2): hd 256, rot 64, nk 16, nv 32,
    dk = dv = 128, K 4, 3:1 layers. Only headers: the plan and metadata never touch data."""
    from specconv.archs import Checkpoint, SourceTensor, plugin_class_for

    hidden, num_hidden_layers, vocab = 4096, 32, 248320
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": False,
           "text_config": {"hidden_size": hidden, "num_hidden_layers": num_hidden_layers, "num_attention_heads": 16,
                           "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 12288, "vocab_size": vocab,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
                           "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 1,
                           "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                           for i in range(num_hidden_layers)],
                           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                               "mrope_section": [11, 11, 10], "mrope_interleaved": True}}}
    # The tensor names of the synthetic layout at 32 layers; shapes are rewritten from the real dims.
    names_only = hf_shapes(text_config(num_hidden_layers=num_hidden_layers, layer_types=cfg["text_config"]["layer_types"]))
    scale = {H: hidden, V: vocab}
    C, nvdv = 2 * 16 * 128 + 32 * 128, 32 * 128
    real = {"in_proj_qkv.weight": (C, hidden), "in_proj_z.weight": (nvdv, hidden), "in_proj_b.weight": (32, hidden),
            "in_proj_a.weight": (32, hidden), "A_log": (32,), "dt_bias": (32,), "conv1d.weight": (C, 1, 4),
            "linear_attn.norm.weight": (128,), "out_proj.weight": (hidden, nvdv), "q_proj.weight": (2 * 16 * 256, hidden),
            "k_proj.weight": (4 * 256, hidden), "v_proj.weight": (4 * 256, hidden), "o_proj.weight": (hidden, 16 * 256),
            "q_norm.weight": (256,), "k_norm.weight": (256,), "gate_proj.weight": (12288, hidden),
            "up_proj.weight": (12288, hidden), "down_proj.weight": (hidden, 12288), "mtp.fc.weight": (hidden, 2 * hidden)}
    headers = {}
    for name, shape in names_only.items():
        key = next((k for k in real if name.endswith(k)), None)
        new = real[key] if key else tuple(scale.get(d, d) for d in shape)
        raw = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
        headers[raw] = new
    cls = plugin_class_for(cfg)
    ckpt = Checkpoint(cfg, {cls.normalize_name(n): SourceTensor(cls.normalize_name(n), s, "BF16")
                            for n, s in headers.items()}, {})
    p = cls(ckpt)
    plans = {pl.name: pl for pl in p.tensor_plan()}
    assert plans["blk.0.attn_qkv.weight"].shape == (8192, hidden)
    assert plans["blk.0.ssm_conv1d.weight"].shape == (8192, 4)
    assert plans["blk.3.attn_q.weight"].shape == (8192, hidden)
    assert plans["blk.32.nextn.eh_proj.weight"].shape == (hidden, 2 * hidden)
    assert len(plans) == 8 * (3 * 14 + 11) + 15 + 3  # 8 x (3 linear + 1 full) blocks, MTP, shared
    kv = kv_dict(p)
    assert kv["qwen35.rope.dimension_count"][0] == 64
    assert kv["qwen35.rope.dimension_sections"][0] == [11, 11, 10, 0]
    assert kv["qwen35.ssm.inner_size"][0] == 4096 and kv["qwen35.ssm.state_size"][0] == 128
    assert kv["qwen35.block_count"][0] == 33 and kv["qwen35.full_attention_interval"][0] == 4
    assert kv["qwen35.attention.recurrent_layers"][0] == [(i + 1) % 4 != 0 for i in range(32)] + [False]
    assert p.vocab_size() == vocab
