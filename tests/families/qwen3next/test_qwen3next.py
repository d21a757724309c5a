"""qwen3next plugin: a tiny Qwen3-Next (`Qwen3NextForCausalLM`) with its MTP head, in the release layout
(per-expert tensors, no MTP count in config.json) and in transformers' layout (fused experts,
`layer_types`), converts in every --mtp mode to what llama.cpp's own converter writes; llama.cpp loads
the files and matches transformers (trunk) and transformers' MtpModel (MTP head, llama.cpp's rows).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specconv.archs import SpecconvError
from specconv.runtime.gguf_reader import open_gguf
from tests.fixtures import tiny_qwen3next as tiny
from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream

torch.set_num_threads(1)
N = tiny.N_LAYERS
IDS = [int(x) for x in np.random.default_rng(11).integers(0, tiny.VOCAB - 3, 32)]
SHARED = {"token_embd.weight", "output_norm.weight", "output.weight"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("q3n")


@pytest.fixture(scope="module")
def conv(root):
    return tiny.converted(root)


def test_modes_mtp_count_from_names_and_tensor_sets(conv):
    src, files = conv
    cfg = json.loads((src / "config.json").read_text())
    assert not any("mtp" in k for k in cfg) and "layer_types" not in cfg  # as the release: no MTP count
    emb, none, only = (open_gguf(files[m]) for m in ("embed", "none", "only"))
    assert emb.arch == "qwen3next" and emb.block_count() == N + 1 and emb.nextn_layers() == 1
    assert none.block_count() == N and none.get("qwen3next.nextn_predict_layers") is None
    assert emb.get("qwen3next.attention.recurrent_layers") == [True, True, True, False, False]
    assert none.get("qwen3next.attention.recurrent_layers") == [True, True, True, False]
    assert emb.get("tokenizer.ggml.pre") == "qwen2" and emb.get("qwen3next.rope.dimension_sections") is None
    mtp_names = {n for n in emb.tensors if n.startswith(f"blk.{N}.")}
    assert {f"blk.{N}.nextn.{p}.weight" for p in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= mtp_names
    assert f"blk.{N}.attn_q.weight" in mtp_names and f"blk.{N}.ffn_gate_inp_shexp.weight" in mtp_names
    assert set(none.tensors) == set(emb.tensors) - mtp_names
    assert set(only.tensors) == mtp_names | SHARED
    sep, side = open_gguf(files["separate"]), open_gguf(files["mtp-separate"])
    for a, b in ((sep, none), (side, only)):
        assert list(a.tensors) == list(b.tensors)
        assert all(np.array_equal(a.tensors[n].raw(), b.tensors[n].raw()) for n in a.tensors)


def test_fused_projections_split_per_key_head(conv):
    """attn_qkv / attn_gate gather HF's per-key-head [q_g | k_g | v_g | z_g] rows (written out head by
    head here), ssm_ba keeps in_proj_ba's rows, nothing is re-tiled, ssm_a = -exp(A_log)."""
    src, files = conv
    hf = load_file(str(src / "model.safetensors"))
    f = open_gguf(files["embed"])
    cfg = json.loads((src / "config.json").read_text())
    nk, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    vr = cfg["linear_num_value_heads"] // nk * dv
    for i in (0, 2):
        a = f"model.layers.{i}.linear_attn."
        qkvz = hf[a + "in_proj_qkvz.weight"].numpy()
        q, k, v, z = [], [], [], []
        for g in range(nk):
            rows = qkvz[g * (2 * dk + 2 * vr):(g + 1) * (2 * dk + 2 * vr)]
            q.append(rows[:dk]), k.append(rows[dk:2 * dk]), v.append(rows[2 * dk:2 * dk + vr]), z.append(rows[2 * dk + vr:])
        assert np.array_equal(f.tensors[f"blk.{i}.attn_qkv.weight"].to_float32(), np.concatenate(q + k + v))
        assert np.array_equal(f.tensors[f"blk.{i}.attn_gate.weight"].to_float32(), np.concatenate(z))
        assert np.array_equal(f.tensors[f"blk.{i}.ssm_ba.weight"].to_float32(), hf[a + "in_proj_ba.weight"].numpy())
        assert np.array_equal(f.tensors[f"blk.{i}.ssm_out.weight"].to_float32(), hf[a + "out_proj.weight"].numpy())
        assert np.array_equal(f.tensors[f"blk.{i}.ssm_dt.bias"].to_float32(), hf[a + "dt_bias"].numpy())
        np.testing.assert_allclose(f.tensors[f"blk.{i}.ssm_a"].to_float32(), -np.exp(hf[a + "A_log"].numpy()),
                                   rtol=1e-6)
        assert f.tensors[f"blk.{i}.ssm_conv1d.weight"].shape == (4, 2 * nk * dk + 2 * vr)  # ggml {K, C}
    # (1+w) norms get +1, the gated linear-attention norm does not
    assert np.array_equal(f.tensors["blk.0.attn_norm.weight"].to_float32(),
                          hf["model.layers.0.input_layernorm.weight"].numpy() + 1)
    assert np.array_equal(f.tensors["blk.0.ssm_norm.weight"].to_float32(),
                          hf["model.layers.0.linear_attn.norm.weight"].numpy())
    assert np.array_equal(f.tensors[f"blk.{N}.nextn.enorm.weight"].to_float32(),
                          hf["mtp.pre_fc_norm_embedding.weight"].numpy() + 1)


@pytest.mark.parametrize("layout", ["release", "transformers", "sharded"])
def test_equals_llamacpp_converter(root, tmp_path, layout):
    """llama.cpp's converter (SPECCONV_LLAMA_CPP_SRC) on the same checkpoint, f16: the same tensor names,
    order, storage types, KV set, values and order; values equal (ssm_a within one float32 ulp: ours is
    exp correctly rounded, docs/convert.md "Computed values")."""
    kwargs = {"transformers": {"layout": "transformers"}, "sharded": {"sharded": True}}.get(layout, {})
    src, _ = tiny.converted(root, **kwargs)
    ours_path = convert_gguf(src, tmp_path / "ours.gguf", outtype="f16")
    up, ours = open_gguf(convert_gguf_upstream(src, tmp_path / "up.gguf", outtype="f16", pre="qwen2")), open_gguf(ours_path)
    assert list(up.tensors) == list(ours.tensors)
    for name, t in up.tensors.items():
        o = ours.tensors[name]
        assert (t.ggml_type, t.shape) == (o.ggml_type, o.shape), name
        a, b = t.to_float32(), o.to_float32()
        if name.endswith("ssm_a"):
            assert np.all(np.abs(a - b) <= np.spacing(np.abs(a))), name
        else:
            assert np.array_equal(a, b), name
    arch_kv = lambda f: [(k, f.get(k)) for k in f.kv if k.startswith("qwen3next.")]  # noqa: E731
    assert arch_kv(up) == arch_kv(ours)
    print(f"qwen3next ({layout}) vs llama.cpp's converter: {len(up.tensors)} tensors, same names, order, types, "
          f"values and {len(arch_kv(up))} arch KV pairs")


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [1]}, "dense layers"),
    ({"decoder_sparse_step": 2}, "dense layers"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"linear_value_head_dim": 8}, "linear_key_head_dim"),
    ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers=2"),
])
def test_bad_configs_are_refused(conv, change, message):
    from specconv.archs.qwen3next import Qwen3Next
    from tests.fixtures.tiny_tools import plugin_on

    cfg = {**json.loads((conv[0] / "config.json").read_text()), **change}
    with pytest.raises(SpecconvError, match=message):
        plugin_on(Qwen3Next, conv[0], cfg)[0].tensor_plan()


def test_llamacpp_matches_transformers(conv, llama_peer):
    from tests.fixtures.mtp_checks import llamacpp_diffs

    for what, diff in llamacpp_diffs(llama_peer, tiny, *conv, IDS):
        print(f"qwen3next llama.cpp vs transformers, {what}: max |Δ| = {diff:.3g}")
        assert diff < 1e-4


def test_release_scale_headers():
    """Qwen3-Next-80B-A3B's dimensions (transformers' Qwen3NextConfig defaults), headers only, per-expert
    tensors as the release stores them: 48 + 1 blocks, 512 experts, the split projections' shapes."""
    from transformers import Qwen3NextConfig

    from specconv.archs.base import Checkpoint, SourceTensor
    from specconv.archs.qwen3next import Qwen3Next

    cfg = Qwen3NextConfig()
    tensors = {n: SourceTensor(n, shape, "BF16") for n, shape in tiny.release_shapes(cfg).items()}
    config = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"}
    plugin = Qwen3Next(Checkpoint({**config, "architectures": ["Qwen3NextForCausalLM"]}, tensors))
    plans = {p.name: p.shape for p in plugin.tensor_plan()}
    kv = {m.key: m.value for m in plugin.metadata(keep_mtp=True)}
    assert kv["qwen3next.block_count"] == 49 and kv["qwen3next.nextn_predict_layers"] == 1
    assert kv["qwen3next.rope.dimension_count"] == 64 and kv["qwen3next.expert_count"] == 512
    assert plans["blk.0.attn_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2048)
    assert plans["blk.0.attn_gate.weight"] == (32 * 128, 2048) and plans["blk.0.ssm_ba.weight"] == (64, 2048)
    assert plans["blk.48.ffn_gate_exps.weight"] == (512, 512, 2048) and "blk.48.nextn.eh_proj.weight" in plans
    print(f"Qwen3-Next-80B-A3B headers: {len(plans)} GGUF tensors from {len(tensors)} checkpoint tensors")


def test_bf16_checkpoint_streams_bit_exact(conv, tmp_path):
    """A BF16 checkpoint (as the release) converted to bf16: the fused-projection split runs on the raw
    BF16 values (a layout-only transform), so every matrix equals llama.cpp's converter bit for bit."""
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "bf16"
    shutil.copytree(conv[0], src)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    ours = open_gguf(convert_gguf(src, tmp_path / "ours.gguf", outtype="bf16", mtp="embed"))
    up = open_gguf(convert_gguf_upstream(src, tmp_path / "up.gguf", outtype="bf16", pre="qwen2"))
    assert list(up.tensors) == list(ours.tensors)
    same = [n for n in up.tensors if np.array_equal(up.tensors[n].raw(), ours.tensors[n].raw())]
    differ = sorted(set(up.tensors) - set(same))
    assert all(n.endswith("ssm_a") for n in differ), differ  # -exp: ours correctly rounded
    assert ours.tensors["blk.0.attn_qkv.weight"].ggml_type.name == "BF16"
    print(f"qwen3next bf16 checkpoint: {len(same)} of {len(up.tensors)} tensors byte-identical to llama.cpp's "
          f"converter (differing: {differ})")


@pytest.mark.parametrize("mode, flag", [("none", "--no-mtp"), ("only", "--mtp")])
def test_trunk_only_and_sidecar_equal_llamacpp_modes(conv, tmp_path, mode, flag):
    """Our --mtp none / only files are llama.cpp's converter's --no-mtp / --mtp files (f32)."""
    src, files = conv
    up = open_gguf(convert_gguf_upstream(src, tmp_path / "up.gguf", pre="qwen2", extra_args=[flag]))
    ours = open_gguf(files[mode])
    assert list(up.tensors) == list(ours.tensors)
    for name, t in up.tensors.items():
        a, b = t.to_float32(), ours.tensors[name].to_float32()
        assert np.array_equal(a, b) or (name.endswith("ssm_a") and np.all(np.abs(a - b) <= np.spacing(np.abs(a))))
    arch_kv = lambda f: [(k, f.get(k)) for k in f.kv if k.startswith("qwen3next.")]  # noqa: E731
    assert arch_kv(up) == arch_kv(ours)
    print(f"qwen3next --mtp {mode} = llama.cpp's {flag}: {len(up.tensors)} tensors")


def test_checkpoint_without_mtp_layers(tmp_path):
    """No `mtp.*` tensors (a stripped re-upload): with no count in the config there is nothing to
    disagree with; the trunk converts (with a notice for --mtp embed) and --mtp only is refused."""
    from click.testing import CliRunner

    from specconv import cli as cli_module

    src = tiny.build_qwen3next(tmp_path / "hf", mtp=False)
    f = open_gguf(convert_gguf(src, tmp_path / "t.gguf", mtp="embed"))
    assert f.block_count() == N and f.get("qwen3next.nextn_predict_layers") is None
    result = CliRunner().invoke(cli_module.cli, ["convert", str(src), "-o", str(tmp_path / "m.gguf"), "--mtp", "only"])
    assert result.exit_code != 0 and "no MTP" in f"{result.output}{result.exception}"
