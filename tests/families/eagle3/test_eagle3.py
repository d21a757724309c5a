"""EAGLE-3 conversion: both public layouts, the target's tokenizer and sizes, d2t, q/k permutation, refusals.

Heads are built by tests/fixtures/tiny_eagle3.py with random tensors; expected values are read from
the HF tensors and the target's tokenizer/config, never from our converter.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_eagle3 import HEAD_HIDDEN, N_HEAD, N_KV, build_eagle3_head, build_llama_target, load_head



@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    return build_llama_target(tmp_path_factory.mktemp("e3") / "llama", n_layers=6)


def _convert(head, target, out):
    return convert_gguf(head, out, outtype="f32", extra_args=["--target", str(target)])


def _kv(reader: GGUFReader, key: str):
    field = reader.fields[key]
    if len(field.types) > 1:  # array
        return [field.parts[i].tolist()[0] if field.types[1] != 8 else bytes(field.parts[i]).decode()
                for i in field.data]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == 8 else value.tolist()[0]


def _tensor(reader: GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return np.array(t.data)


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_layout_converts_with_target_metadata(tmp_path, llama_target, layout):
    from transformers import AutoTokenizer

    head = build_eagle3_head(tmp_path / "head", llama_target, layout=layout, layer_ids=[0, 3, 5], seed=3)
    out = _convert(head, llama_target, tmp_path / "h.gguf")
    r = GGUFReader(out)
    assert _kv(r, "general.architecture") == "eagle3"
    # top level (eagle layout): layer inputs, as written; nested in eagle_config (speculators layout here,
    # SpecForge's key): layer outputs, written + 1 (docs/eagle3.md)
    assert _kv(r, "eagle3.target_layers") == ([1, 4, 6] if layout == "speculators" else [0, 3, 5])
    target_cfg = json.loads((llama_target / "config.json").read_text())
    assert _kv(r, "eagle3.target_hidden_size") == target_cfg["hidden_size"]
    assert _kv(r, "eagle3.norm_before_residual") is (layout == "speculators")
    assert _kv(r, "eagle3.norm_before_fc") is False
    assert _kv(r, "eagle3.block_count") == 1
    assert _kv(r, "eagle3.vocab_size") == target_cfg["vocab_size"]
    assert _kv(r, "eagle3.rope.freq_base") == pytest.approx(5000.0)
    # the tokenizer is the target's, full vocabulary
    tok = AutoTokenizer.from_pretrained(llama_target)
    tokens = _kv(r, "tokenizer.ggml.tokens")
    assert tokens == tok.convert_ids_to_tokens(list(range(len(tokens))))
    assert len(tokens) == target_cfg["vocab_size"]

    cfg, hf = load_head(head)
    names = {t.name: t for t in r.tensors}
    assert "t2d" not in names and not any("t2d" in n for n in names)
    d2t = names["d2t"]
    assert d2t.tensor_type == GGMLQuantizationType.I64
    np.testing.assert_array_equal(np.array(d2t.data), (hf["d2t"] + torch.arange(hf["d2t"].numel())).numpy())
    assert ("token_embd.weight" in names) is (layout == "speculators")
    np.testing.assert_array_equal(_tensor(r, "fc.weight"), hf["fc.weight"].float().numpy())
    np.testing.assert_array_equal(_tensor(r, "output.weight"), hf["lm_head.weight"].float().numpy())
    np.testing.assert_array_equal(_tensor(r, "blk.0.attn_norm_2.weight"), hf["midlayer.hidden_norm.weight"].float().numpy())
    # q/k rows: GGUF row 2i of a head is HF row i, row 2i+1 is HF row i + hd/2 (2H-wide inputs)
    hd = HEAD_HIDDEN // N_HEAD
    for gguf_name, hf_name, heads in (("blk.0.attn_q.weight", "q_proj", N_HEAD), ("blk.0.attn_k.weight", "k_proj", N_KV)):
        ours = _tensor(r, gguf_name).reshape(heads, hd, 2 * HEAD_HIDDEN)
        ref = hf[f"midlayer.self_attn.{hf_name}.weight"].float().numpy().reshape(heads, hd, 2 * HEAD_HIDDEN)
        np.testing.assert_array_equal(ours[:, 0::2], ref[:, : hd // 2])
        np.testing.assert_array_equal(ours[:, 1::2], ref[:, hd // 2:])
    np.testing.assert_array_equal(_tensor(r, "blk.0.attn_v.weight"), hf["midlayer.self_attn.v_proj.weight"].float().numpy())


def test_default_target_layers_and_norm_before_fc(tmp_path, llama_target):
    head = build_eagle3_head(tmp_path / "head", llama_target, layout="eagle", norm_before_fc=True)
    r = GGUFReader(_convert(head, llama_target, tmp_path / "h.gguf"))
    assert _kv(r, "eagle3.target_layers") == [2, 6 // 2, 6 - 3]  # [2, L//2, L-3] of the 6-layer target
    assert _kv(r, "eagle3.norm_before_fc") is True
    _, hf = load_head(head)
    np.testing.assert_array_equal(_tensor(r, "enc.output_norm.weight"), hf["input_norm.weight"].float().numpy())


def _refused(tmp_path, head, target, needle):
    from click.testing import CliRunner

    from specconv import cli

    out = tmp_path / "refused.gguf"
    args = ["convert", str(head), "-o", str(out), "--outtype", "f32"] + (["--target", str(target)] if target else [])
    res = CliRunner().invoke(cli.cli, args)
    assert res.exit_code != 0
    message = str(res.exception)
    assert needle in message, message
    assert "\n" not in message.strip()
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial*"))


def test_refuses_without_target(tmp_path, llama_target):
    head = build_eagle3_head(tmp_path / "head", llama_target)
    _refused(tmp_path, head, None, "--target TARGET_DIR")


@pytest.mark.parametrize("kind", ["out_of_range", "duplicate", "negative"])
def test_refuses_bad_d2t(tmp_path, llama_target, kind):
    vd = 200
    ids = torch.arange(vd) * 2
    if kind == "out_of_range":
        ids[-1] = 512  # the target vocabulary is [0, 512)
    elif kind == "duplicate":
        ids[7] = ids[6]
    else:
        ids[0] = -1
    head = build_eagle3_head(tmp_path / "head", llama_target, draft_vocab=vd, d2t_override=ids - torch.arange(vd))
    needle = "same target id" if kind == "duplicate" else "outside the target vocabulary"
    _refused(tmp_path, head, llama_target, needle)


def test_refuses_wrong_target_sizes(tmp_path, llama_target):
    head = build_eagle3_head(tmp_path / "head", llama_target, layer_ids=[0, 3, 5])
    narrow = build_llama_target(tmp_path / "narrow", hidden=48, n_layers=6)
    _refused(tmp_path, head, narrow, "fc.weight has shape [64, 192], but config.json implies [64, 144]")
    small_vocab = build_llama_target(tmp_path / "vocab", vocab=256, n_layers=6)
    _refused(tmp_path, head, small_vocab, "vocabulary of 512 tokens, but the target has 256")
    shallow = build_llama_target(tmp_path / "shallow", n_layers=4)
    _refused(tmp_path, head, shallow, "target layer 5 (from eagle_aux_hidden_state_layer_ids [0, 3, 5]")


def test_target_only_for_draft_heads(tmp_path, llama_target):
    _refused(tmp_path, llama_target, llama_target, "--target is only for draft heads")


def test_inspect_names_a_draft_head(tmp_path, llama_target):
    from click.testing import CliRunner

    from specconv import cli

    head = build_eagle3_head(tmp_path / "head", llama_target, layer_ids=[0, 3, 5])
    out = _convert(head, llama_target, tmp_path / "h.gguf")
    res = CliRunner().invoke(cli.cli, ["inspect", str(out), "--json"])
    info = json.loads(res.output)
    assert info["arch"] == "eagle3" and info["serves"] == ["encoder", "decoder"] and not info["problems"]


def test_release_layout_target(tmp_path):
    """A Qwen3.5 release folder as target: sizes from the nested text_config, its tokenizer and pre-tokenizer."""
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_qwen35 import build_qwen35

    target = build_qwen35(tmp_path / "qwen", layout="release", mtp=False, n_layers=8)
    text = json.loads((target / "config.json").read_text())["text_config"]
    head = build_eagle3_head(tmp_path / "head", target, layout="speculators")
    r = GGUFReader(_convert(head, target, tmp_path / "h.gguf"))
    assert _kv(r, "eagle3.target_hidden_size") == text["hidden_size"]
    assert _kv(r, "eagle3.target_layers") == [2, 4, 5]  # [2, L//2, L-3] with L from text_config
    assert _kv(r, "tokenizer.ggml.pre") == "qwen35"
    tok = AutoTokenizer.from_pretrained(target)
    tokens = _kv(r, "tokenizer.ggml.tokens")
    assert len(tokens) == text["vocab_size"]
    assert tokens == tok.convert_ids_to_tokens(list(range(len(tokens))))


def test_head_saved_as_llama_for_causal_lm(tmp_path, llama_target):
    """Heads whose config says LlamaForCausalLM are recognised by draft_vocab_size and one layer."""
    head = build_eagle3_head(tmp_path / "head", llama_target, layer_ids=[0, 3, 5])
    cfg = json.loads((head / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (head / "config.json").write_text(json.dumps(cfg))
    r = GGUFReader(_convert(head, llama_target, tmp_path / "h.gguf"))
    assert _kv(r, "general.architecture") == "eagle3"
    assert _kv(r, "eagle3.target_layers") == [0, 3, 5]
