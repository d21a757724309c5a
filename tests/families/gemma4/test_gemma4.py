"""Gemma 4 target: conversion (metadata, trimmed embedding, K/V-sharing layers, rope_freqs, tokenizer)
and the runtime MAIN graph against transformers' Gemma4ForConditionalGeneration / Gemma4ForCausalLM,
and llama.cpp as the peer for the converted file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from specconv.runtime import Context, GraphType, load_model
from tests.fixtures import tiny_gemma4 as g
from tests.fixtures.family_runner import llama_cpp_gelu
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.gguf_files import field_value


IDS = [2, 5, 100, 7, 33, 250, 9, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47]  # longer than the window


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = {}
    for form, layout in (("hub", "conditional"), ("v5", "causal")):
        src = g.tiny_gemma4(form, layout)
        out[(form, layout)] = (src, convert_gguf(src, tmp_path_factory.mktemp(f"g4{form}") / "t.gguf"))
    return out


def _kv(path):
    r = GGUFReader(path)
    return {k: field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}, \
        {t.name: tuple(int(d) for d in t.shape) for t in r.tensors}, r


def test_metadata_and_tensors(converted):
    src, path = converted[("hub", "conditional")]
    kv, shapes, reader = _kv(path)
    assert kv["general.architecture"] == "gemma4"
    assert kv["gemma4.attention.head_count_kv"] == [2, 2, 2, 1, 2, 1]  # per-layer (num_global_key_value_heads)
    assert kv["gemma4.attention.key_length"] == 32 and kv["gemma4.attention.key_length_swa"] == 16
    assert kv["gemma4.attention.sliding_window_pattern"] == [True, True, True, False, True, False]
    assert kv["gemma4.attention.shared_kv_layers"] == 2
    assert kv["gemma4.embedding_length_per_layer_input"] == 8
    assert kv["gemma4.final_logit_softcapping"] == pytest.approx(30.0)
    assert kv["gemma4.rope.dimension_count"] == 32 and kv["gemma4.rope.dimension_count_swa"] == 16
    assert kv["tokenizer.ggml.model"] == "gemma4" and kv["tokenizer.ggml.merges"]
    assert len(kv["tokenizer.ggml.scores"]) == len(kv["tokenizer.ggml.tokens"]) == g.VOCAB_REAL
    assert kv["tokenizer.ggml.add_bos_token"] is True and "tokenizer.ggml.pre" not in kv
    # the embedding (and the PLE table) trimmed to the tokenizer.s 400 tokens, not the 416 rows
    assert shapes["token_embd.weight"] == (g.HIDDEN, g.VOCAB_REAL)
    assert shapes["per_layer_token_embd.weight"] == (6 * 8, g.VOCAB_REAL)
    assert "output.weight" not in shapes
    for i in (4, 5):  # K/V-sharing layers own no K/V
        assert not any(n.startswith(f"blk.{i}.attn_k") or n.startswith(f"blk.{i}.attn_v") for n in shapes)
    assert "blk.3.attn_v.weight" not in shapes and "blk.2.attn_v.weight" in shapes  # attention_k_eq_v (full only)
    rope = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    np.testing.assert_array_equal(rope.data, np.array([1.0] * 4 + [1e30] * 12, np.float32))  # 32·0.25/2 pairs
    scale = next(t for t in reader.tensors if t.name == "blk.0.layer_output_scale.weight")
    hf = g.load_target(src)
    assert float(scale.data[0]) == pytest.approx(float(hf.model.language_model.layers[0].layer_scalar))
    norm = next(t for t in reader.tensors if t.name == "output_norm.weight")  # plain weight: no +1
    np.testing.assert_array_equal(norm.data, hf.model.language_model.norm.weight.detach().numpy())


def test_v5_config_form(converted):
    kv, shapes, _ = _kv(converted[("v5", "causal")][1])
    assert kv["gemma4.attention.head_count_kv"] == 2  # per_layer_config gives head_dim only
    assert kv["gemma4.attention.key_length"] == 32
    assert "blk.3.attn_v.weight" in shapes and shapes["blk.3.attn_q.weight"] == (g.HIDDEN, 4 * 32)


@pytest.mark.parametrize("key", [("hub", "conditional"), ("v5", "causal")])
def test_main_logits_match_transformers(converted, key):
    src, path = converted[key]
    model = load_model(path, device="cpu")
    out = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS)
    logits, hidden, _ = g.hf_target(src, IDS)
    d = (out.logits - logits[:, :g.VOCAB_REAL]).abs().max().item()
    dh = (out.hidden["post_norm"] - hidden).abs().max().item()
    print(f"gemma4 {key}: max |Δlogit| vs transformers {d:.2e}, post-norm hidden {dh:.2e}")
    assert d < 1e-4 and dh < 1e-4


def test_float64_matches_transformers_float64(converted):
    """Both in float64: what remains is transformers' float32 rope tables (it builds cos/sin in float32)."""
    src, path = converted[("hub", "conditional")]
    import copy

    model = load_model(path, device="cpu", dtype="f64")
    ours = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits
    ref = copy.deepcopy(g.load_target(src)).double()
    with torch.no_grad():
        theirs = ref(torch.tensor([IDS]), use_cache=False).logits[0, :, :g.VOCAB_REAL]
    d = (ours - theirs).abs().max().item()
    print(f"gemma4 float64: max |Δlogit| {d:.2e}")
    assert d < 1e-4


def test_incremental_decoding_equals_one_batch(converted):
    """Token by token through the cache (sliding window, shared K/V) = one batch, and HF within 2e-4."""
    src, path = converted[("hub", "conditional")]
    model = load_model(path, device="cpu", dtype="f64")
    ctx = Context(model, GraphType.MAIN, n_ctx=64)
    whole = ctx.decode(IDS).logits
    ctx.clear()
    rows = [ctx.decode(IDS[:5]).logits] + [ctx.decode([t]).logits for t in IDS[5:]]
    d = (torch.cat(rows) - whole).abs().max().item()
    print(f"gemma4 incremental vs batch (float64): {d:.2e}")
    assert d < 1e-9
    ctx.seq_rm(0, 12)  # roll back into the window and re-decode
    again = ctx.decode(IDS[12:]).logits
    assert (again - whole[12:]).abs().max().item() < 1e-9


def test_window_is_real(converted):
    """A token 8 or more positions back is invisible to sliding layers: changing it alters fewer logits
    than changing a recent one, and the full layers still see it (logits change)."""
    src, path = converted[("hub", "conditional")]
    model = load_model(path, device="cpu")
    base = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits
    changed = list(IDS)
    changed[1] = 200
    other = Context(model, GraphType.MAIN, n_ctx=64).decode(changed).logits
    ref = g.hf_target(src, changed)[0][:, :g.VOCAB_REAL]
    assert (other - ref).abs().max().item() < 1e-4
    assert (other[-1] - base[-1]).abs().max().item() > 1e-3


def test_tokenizer_round_trip(converted):
    from transformers import AutoTokenizer

    src, path = converted[("hub", "conditional")]
    tok = load_model(path, device="cpu").tokenizer
    hf = AutoTokenizer.from_pretrained(str(src))
    for text in ("def  f(x):\n    return x", "héllo wörld ✓", "plain words and more words"):
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.decode(tok.encode(text), skip_special=True) == text


def test_llama_cpp_loads_and_agrees_within_gelu_tolerance(converted):
    """llama.cpp computes GELU through an fp16 table (docs/reference/peers.md §1.4). Position 0 (no attention mixing)
    shows the table's own error; with that table emulated in our graph the rows agree closely."""
    from tests.fixtures import peers

    peers.require_llama_cpp()
    src, path = converted[("hub", "conditional")]
    theirs = peers.llama_logits(path, IDS)
    ref = g.hf_target(src, IDS)[0][:, :g.VOCAB_REAL].numpy()
    per_row = np.abs(theirs - ref).max(-1)
    print(f"llama.cpp vs transformers: position 0 {per_row[0]:.2e}, all {per_row.max():.2e}")
    assert per_row[0] < 5e-3
    model = load_model(path, device="cpu")
    with llama_cpp_gelu():
        ours = Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy()
    emulated = np.abs(theirs - ours).max(-1)
    print(f"llama.cpp vs ours with an fp16 GELU table: max {emulated.max():.2e}, rows within 1e-4: "
          f"{int((emulated < 1e-4).sum())}/{len(IDS)}")
    assert emulated.max() < 5e-3
    assert (theirs.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)


def _fp16_gelu_logits(path, ids):
    model = load_model(path, device="cpu")
    with llama_cpp_gelu():
        return Context(model, GraphType.MAIN, n_ctx=64).decode(ids).logits.numpy()


def test_moe_variant(tmp_path):
    """26B-A4B style blocks: router (scale, per-expert scale), fused gate/up experts, the extra norms."""
    src = g.tiny_gemma4("v5", **MOE)
    path = convert_gguf(src, tmp_path / "moe.gguf")
    kv, shapes, _ = _kv(path)
    assert kv["gemma4.expert_count"] == 4 and kv["gemma4.expert_used_count"] == 2
    assert kv["gemma4.expert_feed_forward_length"] == 16
    assert shapes["blk.0.ffn_gate_up_exps.weight"] == (g.HIDDEN, 32, 4)
    assert shapes["blk.0.ffn_down_exps.scale"] == (4,) and shapes["blk.0.ffn_gate_inp.scale"] == (g.HIDDEN,)
    ours = Context(load_model(path, device="cpu"), GraphType.MAIN, n_ctx=64).decode(IDS).logits
    ref = g.hf_target(src, IDS)[0][:, :g.VOCAB_REAL]
    d = (ours - ref).abs().max().item()
    print(f"gemma4 MoE: max |Δlogit| vs transformers {d:.2e}")
    assert d < 1e-4


def test_moe_llama_cpp(tmp_path):
    from tests.fixtures import peers

    peers.require_llama_cpp()
    src = g.tiny_gemma4("v5", **MOE)
    path = convert_gguf(src, tmp_path / "moe.gguf")
    theirs = peers.llama_logits(path, IDS)
    ref = g.hf_target(src, IDS)[0][:, :g.VOCAB_REAL].numpy()
    emulated = np.abs(theirs - _fp16_gelu_logits(path, IDS)).max(-1)
    print(f"gemma4 MoE llama.cpp vs transformers: position 0 {np.abs(theirs - ref).max(-1)[0]:.2e}, "
          f"all {np.abs(theirs - ref).max():.2e}; vs ours with an fp16 GELU table {emulated.max():.2e}")
    assert np.abs(theirs - ref).max(-1)[0] < 5e-3
    assert emulated.max() < 5e-3


def test_verify_hf_parity_passes_and_catches_another_checkpoint(converted, tmp_path):
    """`specconv verify --hf` loads the conditional-generation class (not the trap of docs/reference/peers.md §2.5),
    passes on the converted file, and fails against a differently seeded checkpoint."""
    import json

    from click.testing import CliRunner

    from specconv import cli as cli_module

    src, path = converted[("hub", "conditional")]
    report = tmp_path / "ok.json"
    res = CliRunner().invoke(cli_module.cli, ["verify", str(path), "--hf", str(src), "-n", "6", "--report", str(report)])
    data = json.loads(report.read_text())
    assert res.exit_code == 0, res.output
    assert data["parity"]["reference"].endswith("Gemma4ForConditionalGeneration")
    print(f"verify --hf: max |Δlogit| {data['parity']['max_abs_logit_diff']:.2e}")
    assert data["parity"]["max_abs_logit_diff"] < 1e-4
    other = g.tiny_gemma4("hub", seed=1)
    res = CliRunner().invoke(cli_module.cli, ["verify", str(path), "--hf", str(other), "-n", "6",
                                              "--report", str(tmp_path / "bad.json")])
    assert res.exit_code != 0
    bad = json.loads((tmp_path / "bad.json").read_text())
    assert any(c["name"] == "parity: trunk logits vs transformers" and not c["passed"] for c in bad["checks"])


def test_double_wide_mlp_on_shared_layers(tmp_path):
    """use_double_wide_mlp: the K/V-sharing layers have 2F-wide FFNs (per-layer feed_forward_length)."""
    src = g.tiny_gemma4("v5", "causal", use_double_wide_mlp=True)
    path = convert_gguf(src, tmp_path / "wide.gguf")
    kv, shapes, _ = _kv(path)
    assert kv["gemma4.feed_forward_length"] == [96, 96, 96, 96, 192, 192]
    assert shapes["blk.5.ffn_up.weight"] == (g.HIDDEN, 192) and shapes["blk.3.ffn_up.weight"] == (g.HIDDEN, 96)
    ours = Context(load_model(path, device="cpu"), GraphType.MAIN, n_ctx=64).decode(IDS).logits
    d = (ours - g.hf_target(src, IDS)[0][:, :g.VOCAB_REAL]).abs().max().item()
    print(f"gemma4 double-wide MLP: max |Δlogit| vs transformers {d:.2e}")
    assert d < 1e-4


def _refused(capsys, src, tmp_path, edit=None, drop=None):
    """Convert a copy of `src` (config edited / a tensor dropped); returns the one-line error."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.fixtures.cli import assert_refused

    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    if edit is not None:
        cfg = json.loads((copy / "config.json").read_text())
        edit(cfg.get("text_config", cfg), cfg)
        (copy / "config.json").write_text(json.dumps(cfg))
    if drop is not None:
        tensors = load_file(str(copy / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return assert_refused(capsys, copy, tmp_path / "out", expect=[])


def test_refusals(capsys, tmp_path):
    target, assistant = g.tiny_gemma4("hub"), g.tiny_assistant("hub")
    line = _refused(capsys, target, tmp_path / "a", edit=lambda t, c: t.update(attn_logit_softcapping=50.0))
    assert "attn_logit_softcapping" in line
    line = _refused(capsys, target, tmp_path / "b", edit=lambda t, c: t.update(layer_types=["full_attention"] * 3))
    assert "layer_types" in line
    line = _refused(capsys, target, tmp_path / "c", drop="model.language_model.layers.2.self_attn.k_proj.weight")
    assert "layers.2.self_attn.k_proj" in line
    line = _refused(capsys, target, tmp_path / "d", edit=lambda t, c: t.update(global_head_dim=16))
    assert "shape" in line  # the full layers' tensors contradict the config
    line = _refused(capsys, assistant, tmp_path / "e", edit=lambda t, c: c.update(backbone_hidden_size=g.ASSIST_HIDDEN))
    assert "backbone_hidden_size" in line


def _release_plugin(text_cfg: dict, n_vocab_rows: int):
    """The Gemma4 plugin over release-size headers: names and shapes from transformers'
    Gemma4ForConditionalGeneration on the meta device (nothing allocated), plus vision-tower names."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from specconv.archs.base import Checkpoint, SourceTensor
    from specconv.archs.gemma4 import Gemma4

    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text_cfg, vision_config=None,
                                                            audio_config=None))
    raw = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    raw["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = (4, 4)
    raw["model.embed_vision.embedding_projection.weight"] = (text_cfg["hidden_size"], 4)
    headers, skipped = {}, {}
    for name, shape in raw.items():
        norm = Gemma4.normalize_name(name)
        if isinstance(norm, tuple):
            skipped[name] = norm[1]
        else:
            headers[norm] = SourceTensor(norm, shape, "BF16")
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text_cfg}
    return Gemma4(Checkpoint(config, headers, skipped)), skipped


def test_release_scale_e2b_like_headers():
    """An E2B-like text config (35 layers, 20 sharing K/V, PLE 256, double-wide MLP, head dims 256/512,
    1 KV head): every tensor planned with the ggml shapes of docs/reference/gguf-layout.md §7.6, towers skipped."""
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)]
    cfg = dict(vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=1536, intermediate_size=6144,
               num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
               layer_types=types, sliding_window=512, num_kv_shared_layers=20, hidden_size_per_layer_input=256,
               use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=131072)
    plugin, skipped = _release_plugin(cfg, 262144)
    plans = {p.name: p for p in plugin.tensor_plan()}
    ggml = lambda n: tuple(reversed(plans[n].shape))  # noqa: E731
    assert len(skipped) == 2
    assert ggml("token_embd.weight") == (1536, 262144)
    assert ggml("per_layer_token_embd.weight") == (35 * 256, 262144)
    assert ggml("per_layer_model_proj.weight") == (1536, 35 * 256)
    assert ggml("blk.4.attn_q.weight") == (1536, 8 * 512) and ggml("blk.4.attn_k.weight") == (1536, 512)
    assert ggml("blk.0.attn_q.weight") == (1536, 8 * 256) and ggml("blk.13.attn_v.weight") == (1536, 256)
    assert not any(n.startswith(("blk.15.attn_k", "blk.34.attn_v")) for n in plans)  # shared from layer 15 on
    assert ggml("blk.15.ffn_up.weight") == (1536, 12288) and ggml("blk.14.ffn_up.weight") == (1536, 6144)
    assert ggml("rope_freqs.weight") == (256,)
    kv = {m.key: m.value for m in plugin.metadata(keep_mtp=False)}
    assert kv["gemma4.feed_forward_length"] == [6144] * 15 + [12288] * 20
    assert kv["gemma4.attention.key_length"] == 512 and kv["gemma4.attention.key_length_swa"] == 256
    assert kv["gemma4.attention.head_count_kv"] == 1 and kv["gemma4.attention.shared_kv_layers"] == 20
    assert kv["gemma4.rope.dimension_count"] == 512 and kv["gemma4.rope.dimension_count_swa"] == 256
    rope = plans["rope_freqs.weight"].transform([np.zeros(1, dtype=np.float32)])
    assert int((rope == 1.0).sum()) == 64 and int((rope > 1e29).sum()) == 192  # docs/reference/gguf-layout.md §7.6


def test_release_scale_moe_like_headers():
    """A 26B-A4B-like config (128 experts, top 8, attention_k_eq_v with 2 global KV heads)."""
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)]
    cfg = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
               num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
               num_global_key_value_heads=2, attention_k_eq_v=True, layer_types=types, sliding_window=1024,
               hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=True, num_experts=128,
               top_k_experts=8, moe_intermediate_size=704, final_logit_softcapping=30.0)
    plugin, _ = _release_plugin(cfg, 262144)
    plans = {p.name: p for p in plugin.tensor_plan()}
    ggml = lambda n: tuple(reversed(plans[n].shape))  # noqa: E731
    assert ggml("blk.5.attn_k.weight") == (2816, 2 * 512) and "blk.5.attn_v.weight" not in plans
    assert ggml("blk.0.attn_v.weight") == (2816, 8 * 256)
    assert ggml("blk.0.ffn_gate_up_exps.weight") == (2816, 2 * 704, 128)
    assert ggml("blk.0.ffn_down_exps.weight") == (704, 2816, 128)
    assert ggml("blk.0.ffn_gate_inp.weight") == (2816, 128) and ggml("blk.0.ffn_down_exps.scale") == (128,)
    assert plans["blk.0.ffn_gate_inp.weight"].force_type is not None
    kv = {m.key: m.value for m in plugin.metadata(keep_mtp=False)}
    assert kv["gemma4.attention.head_count_kv"] == [2 if t == "full_attention" else 8 for t in types]
    assert kv["gemma4.expert_count"] == 128 and kv["gemma4.expert_used_count"] == 8
    assert kv["gemma4.expert_feed_forward_length"] == 704
