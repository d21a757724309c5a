"""qwen3 / qwen3moe plugins: tiny Qwen3 and Qwen3-MoE checkpoints (save_pretrained = release layout,
re-randomised) convert to what llama.cpp's own converter writes, and to the tensor table written out
here from the config (not from the plugin); bad checkpoints fail with one-line errors.

* against llama.cpp's converter (SPECCONV_LLAMA_CPP_SRC): the same tensor names, order, types,
  shapes and bytes, and the same KV pairs in the same order (dense, MoE, tied, f16);
* the table: names, ggml shapes, F32 for norms / router, values equal to the HF tensors (experts
  stacked in expert order, no permutation of q/k);
* transformers' fused in-memory expert layout converts to the same file as the per-expert one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from specconv.archs import Checkpoint, SourceTensor, SpecconvError, plugin_class_for
from specconv.runtime.gguf_reader import open_gguf
from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream
from tests.fixtures.tiny_qwen3 import build_qwen3
from tests.fixtures.tiny_qwen3 import gguf_contents as _read

torch.set_num_threads(1)
VARIANTS = {"dense": {}, "moe": {"moe": True}, "dense-tied": {"tie": True}, "moe-tied": {"moe": True, "tie": True},
            "dense-yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                            "beta_fast": 16.0}}}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("q3")


def _src(root, variant, **extra):
    kw = {**VARIANTS[variant], **extra}
    return build_qwen3(root / (variant + "".join(f"-{k}{v}" for k, v in extra.items())), **kw)


def expected_table(cfg: dict, moe: bool, tied: bool) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF name -> (ggml shape, forced F32) for a Qwen3 config, written out from llama.cpp's tables."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {"token_embd.weight": ((H, V), False), "output_norm.weight": ((H,), True)}
    if not tied:
        out["output.weight"] = ((H, V), False)
    for i in range(L):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": ((H,), True), b + "attn_q.weight": ((H, nh * hd), False),
                    b + "attn_k.weight": ((H, nkv * hd), False), b + "attn_v.weight": ((H, nkv * hd), False),
                    b + "attn_output.weight": ((nh * hd, H), False), b + "attn_q_norm.weight": ((hd,), True),
                    b + "attn_k_norm.weight": ((hd,), True), b + "ffn_norm.weight": ((H,), True)})
        if moe:
            E, Fe = cfg["num_experts"], cfg["moe_intermediate_size"]
            out.update({b + "ffn_gate_inp.weight": ((H, E), True), b + "ffn_gate_exps.weight": ((H, Fe, E), False),
                        b + "ffn_up_exps.weight": ((H, Fe, E), False), b + "ffn_down_exps.weight": ((Fe, H, E), False)})
        else:
            F = cfg["intermediate_size"]
            out.update({b + "ffn_gate.weight": ((H, F), False), b + "ffn_up.weight": ((H, F), False),
                        b + "ffn_down.weight": ((F, H), False)})
    return out


def hf_source(hf: dict, name: str, L: int, E: int) -> np.ndarray:
    """The HF tensor(s) a GGUF tensor must equal (experts stacked by id), written independently."""
    direct = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
    if name in direct:
        return hf[direct[name]].numpy()
    _, i, part, _ = name.split(".")
    p = f"model.layers.{i}."
    if part.endswith("_exps"):
        kind = part.split("_")[1]
        return np.stack([hf[f"{p}mlp.experts.{e}.{kind}_proj.weight"].numpy() for e in range(E)])
    table = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    return hf[f"{p}{table[part]}.weight"].numpy()


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "yarn" not in v])
def test_tensor_table_types_and_values(root, variant, tmp_path):
    src = _src(root, variant)
    cfg = json.loads((src / "config.json").read_text())
    moe, tied = "moe" in variant, "tied" in variant
    f = open_gguf(convert_gguf(src, tmp_path / "m.gguf", outtype="f16"))
    table = expected_table(cfg, moe, tied)
    assert set(f.tensors) == set(table)
    hf = load_file(str(src / "model.safetensors"))
    assert ("lm_head.weight" in hf) == (not tied)
    for name, (shape, f32) in table.items():
        t = f.tensors[name]
        assert tuple(t.shape) == shape, name
        assert t.ggml_type == (Q.F32 if f32 else Q.F16), name
        want = hf_source(hf, name, cfg["num_hidden_layers"], cfg.get("num_experts", 0))
        got = t.to_float32()
        tol = 0 if f32 else 1e-3 * max(1.0, float(np.abs(want).max()))
        assert np.abs(got - want).max() <= tol, name
    arch = "qwen3moe" if moe else "qwen3"
    assert f.arch == arch and f.block_count() == cfg["num_hidden_layers"]
    assert f.get(f"{arch}.rope.freq_base") == cfg["rope_theta"] and f.get(f"{arch}.attention.key_length") == cfg["head_dim"]
    assert f.get("tokenizer.ggml.pre") == "qwen2"
    if moe:
        assert f.get(f"{arch}.expert_count") == cfg["num_experts"]
        assert f.get(f"{arch}.expert_used_count") == cfg["num_experts_per_tok"]
        assert f.get(f"{arch}.expert_feed_forward_length") == cfg["moe_intermediate_size"]
        assert f.get(f"{arch}.expert_weights_norm") is None  # norm_topk_prob: true, as upstream writes it


@pytest.mark.parametrize("variant,outtype", [("dense", "f32"), ("moe", "f32"), ("dense-tied", "f32"),
                                             ("moe-tied", "f16"), ("dense", "q8_0"), ("dense-yarn", "f32")])
def test_matches_llama_cpp_converter(root, variant, outtype, tmp_path):
    src = _src(root, variant)
    theirs = convert_gguf_upstream(src, tmp_path / "theirs.gguf", outtype=outtype, pre="qwen2")
    ours = convert_gguf(src, tmp_path / "ours.gguf", outtype=outtype)
    kv_a, t_a = _read(ours)
    kv_b, t_b = _read(theirs)
    assert [t[:3] for t in t_a] == [t[:3] for t in t_b]  # names, order, types, shapes
    differ = [a[0] for a, b in zip(t_a, t_b) if a[3] != b[3]]
    assert not differ, f"tensor bytes differ: {differ[:5]}"
    assert list(kv_a) == list(kv_b), "KV keys or their order differ"
    assert kv_a == kv_b
    print(f"\n[qwen3 {variant} {outtype}] {len(t_a)} tensors and {len(kv_a)} KV pairs identical to llama.cpp's converter")


def test_tied_checkpoint_with_a_saved_head_matches_llama_cpp_converter(root, tmp_path):
    """Some tied releases still save lm_head.weight; llama.cpp's converter writes it as output.weight."""
    src = tmp_path / "tied-head"
    build_qwen3(src, tie=True)
    t = load_file(str(src / "model.safetensors"))
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    theirs = convert_gguf_upstream(src, tmp_path / "theirs.gguf", pre="qwen2")
    ours = convert_gguf(src, tmp_path / "ours.gguf")
    (kv_a, t_a), (kv_b, t_b) = _read(ours), _read(theirs)
    assert [x[:3] for x in t_a] == [x[:3] for x in t_b] and all(a[3] == b[3] for a, b in zip(t_a, t_b))
    assert "output.weight" in {x[0] for x in t_a} and kv_a == kv_b


def test_fused_expert_layout_converts_identically(root, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2Fe, H], experts.down_proj [E, H, Fe])."""
    src = _src(root, "moe")
    hf = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    fused, E = {}, cfg["num_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [torch.cat([hf.pop(f"{p}{e}.gate_proj.weight"), hf.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)]
        fused[p + "gate_up_proj"] = torch.stack(gate_up)
        fused[p + "down_proj"] = torch.stack([hf.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    other = tmp_path / "fused"
    build_qwen3(other, moe=True)
    save_file({**hf, **fused}, str(other / "model.safetensors"), metadata={"format": "pt"})
    a = open_gguf(convert_gguf(src, tmp_path / "a.gguf"))
    b = open_gguf(convert_gguf(other, tmp_path / "b.gguf"))
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert np.array_equal(a.tensors[name].to_float32(), b.tensors[name].to_float32()), name


def test_norm_topk_prob_false_is_recorded(root, tmp_path):
    src = _src(root, "moe", norm_topk_prob=False)
    f = open_gguf(convert_gguf(src, tmp_path / "m.gguf"))
    assert f.get("qwen3moe.expert_weights_norm") is False


def _plugin(src, cfg_edit=None, drop=(), rename=None):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(cfg_edit or {})
    cls = plugin_class_for(cfg)
    tensors = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        if k in drop:
            continue
        name = cls.normalize_name((rename or {}).get(k, k))
        shape = tuple(v.shape)
        tensors[name] = SourceTensor(name, shape, "F32")
    return cls(Checkpoint(cfg, tensors))


@pytest.mark.parametrize("variant,edit,drop,message", [
    ("dense", {"attention_bias": True}, (), "attention_bias"),
    ("dense", {"use_sliding_window": True}, (), "use_sliding_window"),
    ("dense", {"hidden_act": "gelu"}, (), "hidden_act"),
    ("dense", {"num_key_value_heads": 3}, (), "multiple of num_key_value_heads"),
    ("dense", {}, ("lm_head.weight",), "lm_head.weight"),
    ("dense", {}, ("model.layers.2.self_attn.k_norm.weight",), "model.layers.2.self_attn.k_norm.weight"),
    ("dense", {"head_dim": 16}, (), "model.layers.0.self_attn.q_proj.weight has shape"),
    ("dense", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, (), "rope scaling type"),
    ("moe", {}, ("model.layers.1.mlp.experts.3.up_proj.weight",), "layer 1.*experts \\[3\\] missing"),
    ("moe", {"mlp_only_layers": [1]}, (), "mlp_only_layers"),
    ("moe", {"num_experts_per_tok": 9}, (), "num_experts_per_tok"),
])
def test_bad_checkpoints_fail_with_one_line(root, variant, edit, drop, message):
    with pytest.raises(SpecconvError, match=message) as exc:
        _plugin(_src(root, variant), edit, drop).tensor_plan()
    assert "\n" not in str(exc.value)


def test_unexpected_tensor_and_spellings(root):
    src = _src(root, "moe")
    extra = _plugin(src)
    extra.checkpoint.tensors["model.layers.0.mlp.shared_expert.up_proj.weight"] = SourceTensor(
        "model.layers.0.mlp.shared_expert.up_proj.weight", (32, 64), "F32")
    with pytest.raises(SpecconvError, match="unexpected tensor"):
        extra.tensor_plan()
    # transformers 5 writes num_local_experts / rope_parameters; the releases num_experts / rope_theta
    cfg = json.loads((src / "config.json").read_text())
    v5 = {"num_local_experts": cfg["num_experts"], "num_experts": None,
          "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]}, "rope_theta": None}
    a, b = _plugin(src), _plugin(src, v5)
    assert [(p.name, p.shape) for p in a.tensor_plan()] == [(p.name, p.shape) for p in b.tensor_plan()]
    assert a.metadata(False) == b.metadata(False)
