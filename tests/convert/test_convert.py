"""`specconv convert` on the tiny Qwen3.5 / Qwen3.5-MoE checkpoints: every MTP mode x every outtype, both
on-disk layouts, sharded input, nk != nv. Files are read back with gguf-py's GGUFReader and compared with
the reference tables of docs/reference/gguf-layout.md (tests/fixtures/convert_reference.py), not with the plugin's own output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType as VT, TokenType

from tests.fixtures import convert_reference as ref
from tests.fixtures.cli import KINDS, convert, run_cli


MODES = ["embed", "none", "only", "separate"]
OUTTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "auto"]


def outputs(folder: Path, mode: str, name: str = "model.gguf") -> dict[str, Path]:
    """kind -> path for `-o folder/name` (§4.2: the sidecar next to a named file is mtp-NAME)."""
    kinds = KINDS[mode]
    if kinds == ["sidecar"]:
        return {"sidecar": folder / name}
    paths = {kinds[0]: folder / name}
    if "sidecar" in kinds:
        paths["sidecar"] = folder / f"mtp-{name}"
    return paths


def fields(reader: GGUFReader) -> dict:
    return {k: f for k, f in reader.fields.items()}


def check_file(path: Path, kind: str, moe: bool, outtype: str) -> GGUFReader:
    """Names, ggml shapes, types (§2, §4.2, §7.1/7.2) and metadata (§1, §3, §7.1/7.2) of one file."""
    r = GGUFReader(str(path))
    want = ref.expected_tensors(kind, moe)
    got = {t.name: t for t in r.tensors}
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
    for name, (shape, rule) in want.items():
        t = got[name]
        assert tuple(int(d) for d in t.shape) == shape, (name, t.shape, shape)
        assert Q(t.tensor_type) == ref.expected_type(rule, outtype), (name, Q(t.tensor_type).name)
    if kind == "sidecar":
        assert len(got) == (18 if not moe else 23)  # §4.2: 15 MTP tensors + 3 shared for dense qwen35

    f = fields(r)
    arch = "qwen35moe" if moe else "qwen35"
    assert f["general.architecture"].contents() == arch  # a sidecar keeps its trunk's arch (§4.1)
    assert f["general.type"].contents() == "model"
    assert f["general.name"].contents()
    assert f["general.file_type"].contents() == ref.FILE_TYPE[outtype]
    assert f["general.file_type"].types == [VT.UINT32]
    assert f["general.quantization_version"].contents() == 2
    for key, (value, vtype) in ref.expected_arch_kv(kind, moe).items():
        field = f.get(f"{arch}.{key}")
        assert field is not None, f"{arch}.{key} missing from {path.name}"
        got_value = field.contents()
        if vtype == VT.FLOAT32:
            assert field.types == [VT.FLOAT32] and got_value == pytest.approx(value, rel=1e-6), key
        elif isinstance(value, list):
            assert field.types == [VT.ARRAY, vtype] and list(got_value) == value, (key, got_value)
        else:
            assert field.types == [vtype] and got_value == value, (key, got_value)
    for key in ref.ABSENT_ARCH_KEYS.get(kind, []):
        assert f"{arch}.{key}" not in f, f"{key} must be absent in a {kind} file"
    if moe:
        assert f"{arch}.feed_forward_length" not in f

    # §3: byte-level BPE, the family's pre-tokenizer, one token per embedding row, specials CONTROL.
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.ggml.pre"].contents() == "qwen35"
    tokens = f["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == ref.V
    types = f["tokenizer.ggml.token_type"].contents()
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[-3:] == [TokenType.CONTROL] * 3 and set(types[:-3]) == {TokenType.NORMAL}
    assert len(f["tokenizer.ggml.merges"].contents()) > 0
    assert f["tokenizer.ggml.eos_token_id"].contents() == ref.V - 1
    assert f["tokenizer.ggml.padding_token_id"].contents() == ref.V - 3
    assert "<|im_start|>" in f["tokenizer.chat_template"].contents()
    return r


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("convert-src")
    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = build_qwen35(root / f"m{len(cache)}", **kw)
        return cache[key]

    return get


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_and_outtype(sources, tmp_path, capsys, mode, outtype, moe):
    src = sources(moe=moe)
    convert(capsys, src, tmp_path / "model.gguf", "--mtp", mode, "--outtype", outtype)
    expected = outputs(tmp_path, mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in expected.values())
    for kind, path in expected.items():
        check_file(path, kind, moe, outtype)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("layout,sharded", [("release", False), ("release", True), ("save_pretrained", True)])
@pytest.mark.parametrize("mode", MODES)
def test_layouts_and_sharded_input(sources, tmp_path, capsys, mode, layout, sharded, moe):
    """The release layout (VL prefixes, fused experts, vision tower skipped) and sharded input (index)
    give the same reference layout; and the same bytes as the single-file save_pretrained checkpoint."""
    src = sources(moe=moe, layout=layout, sharded=sharded)
    convert(capsys, src, tmp_path / "a" / "model.gguf", "--mtp", mode, "--outtype", "q8_0")
    plain = sources(moe=moe)
    convert(capsys, plain, tmp_path / "b" / "model.gguf", "--mtp", mode, "--outtype", "q8_0")
    for kind, path in outputs(tmp_path / "a", mode).items():
        r = check_file(path, kind, moe, "q8_0")
        other = GGUFReader(str(outputs(tmp_path / "b", mode)[kind]))
        mine = {t.name: t for t in r.tensors}
        # Same weights through either layout: tensor bytes identical (the name differs, general.name).
        for t in other.tensors:
            assert np.array_equal(np.asarray(mine[t.name].data), np.asarray(t.data)), t.name


def test_nk_equal_nv_and_tied_embeddings(sources, tmp_path, capsys):
    """Without V-head re-tiling (nk == nv) and with tied embeddings: no output.weight (§7.1)."""
    src = sources(nk=4, nv=4, tie=True)
    convert(capsys, src, tmp_path / "model.gguf", "--mtp", "separate", "--outtype", "f32")
    trunk = {t.name: t for t in GGUFReader(str(tmp_path / "model.gguf")).tensors}
    side = {t.name: t for t in GGUFReader(str(tmp_path / "mtp-model.gguf")).tensors}
    assert "output.weight" not in trunk and "output.weight" not in side
    assert tuple(trunk["blk.0.attn_qkv.weight"].shape) == (ref.H, 2 * 4 * ref.DK + 4 * ref.DV)
    assert len(side) == 17  # 15 MTP tensors + token_embd + output_norm


def test_mtp_count_from_tensor_names(sources, tmp_path, capsys):
    """A config without mtp_num_hidden_layers still keeps the head (counted from mtp.layers.*)."""
    src = sources(mtp_in_config=False, layout="release")
    convert(capsys, src, tmp_path / "model.gguf", "--outtype", "f16")
    check_file(tmp_path / "model.gguf", "embedded", False, "f16")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_separate_equals_two_runs(sources, tmp_path, capsys, moe):
    """--mtp separate == --mtp none + --mtp only, byte for byte (KV and tensors: the whole files)."""
    src = sources(moe=moe, layout="release")
    convert(capsys, src, tmp_path / "sep" / "m.gguf", "--mtp", "separate", "--outtype", "q8_0")
    convert(capsys, src, tmp_path / "one" / "m.gguf", "--mtp", "none", "--outtype", "q8_0")
    convert(capsys, src, tmp_path / "two" / "mtp-m.gguf", "--mtp", "only", "--outtype", "q8_0")
    assert (tmp_path / "sep" / "m.gguf").read_bytes() == (tmp_path / "one" / "m.gguf").read_bytes()
    assert (tmp_path / "sep" / "mtp-m.gguf").read_bytes() == (tmp_path / "two" / "mtp-m.gguf").read_bytes()


def test_separate_reads_each_source_tensor_once(sources, tmp_path):
    """Both files in one pass: every checkpoint tensor is used, none is copied out more than once (a fused
    expert tensor feeds two outputs through views of its halves)."""
    from specconv.archs.base import MtpMode
    from specconv.convert.engine import ConvertRequest, plan_conversion, run_conversion

    src = sources(moe=True, layout="release")
    plan = plan_conversion(ConvertRequest(src, str(tmp_path / "m.gguf"), "f16", MtpMode.SEPARATE))
    try:
        run_conversion(plan)
        reads, viewed = plan.reader.reads, plan.reader.viewed
    finally:
        plan.close()
    used = {name for name in plan.reader.tensors if not name.startswith("model.visual.")}
    assert set(reads) | set(viewed) == used and set(reads.values()) <= {1}
    fused = [name for name in used if name.endswith("experts.gate_up_proj")]
    assert fused and all(viewed.get(name) == 2 and name not in reads for name in fused)


def test_sidecar_kv_equals_embedded_kv(sources, tmp_path, capsys):
    """§4.2: the sidecar has the embedded file's KV (hparams, block_count N+k, full tokenizer)."""
    src = sources()
    convert(capsys, src, tmp_path / "m.gguf", "--mtp", "embed", "--outtype", "f16")
    convert(capsys, src, tmp_path / "mtp-m.gguf", "--mtp", "only", "--outtype", "f16")
    emb, side = fields(GGUFReader(str(tmp_path / "m.gguf"))), fields(GGUFReader(str(tmp_path / "mtp-m.gguf")))
    skip = {"general.size_label", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # size: its own tensors
    assert [k for k in emb if k not in skip] == [k for k in side if k not in skip]
    for key in emb:
        if key not in skip:
            assert emb[key].contents() == side[key].contents(), key


def test_tensor_values_follow_the_reference_transforms(sources, tmp_path, capsys):
    """Spot values (§7.1.1): norms +1 (not ssm_norm), ssm_a = -exp(A_log), conv1d squeezed, V re-tiled."""
    import torch
    from safetensors.torch import load_file

    src = sources()
    convert(capsys, src, tmp_path / "m.gguf", "--outtype", "f32")
    got = {t.name: np.asarray(t.data) for t in GGUFReader(str(tmp_path / "m.gguf")).tensors}
    hf = {k: v.float().numpy() for k, v in load_file(str(src / "model.safetensors")).items()}
    p = "model.layers.0."
    np.testing.assert_array_equal(got["token_embd.weight"], hf["model.embed_tokens.weight"])
    np.testing.assert_allclose(got["blk.0.attn_norm.weight"], hf[p + "input_layernorm.weight"] + 1, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(got["blk.0.ssm_norm.weight"], hf[p + "linear_attn.norm.weight"])
    np.testing.assert_allclose(got[f"blk.{ref.N}.nextn.hnorm.weight"], hf["mtp.pre_fc_norm_hidden.weight"] + 1, atol=1e-7)
    # GGUF value head n holds HF head (n mod nk)*r + n // nk (§7.1.1 item 4), r = nv / nk.
    r = ref.NV // ref.NK
    perm = [(n % ref.NK) * r + n // ref.NK for n in range(ref.NV)]
    np.testing.assert_allclose(got["blk.0.ssm_a"], -np.exp(hf[p + "linear_attn.A_log"])[perm], rtol=1e-6)
    conv = hf[p + "linear_attn.conv1d.weight"][:, 0, :]  # [C, 1, K] -> [C, K]
    qk = 2 * ref.NK * ref.DK
    v_rows = conv[qk:].reshape(ref.NV, ref.DV, -1)[perm].reshape(-1, conv.shape[1])
    np.testing.assert_array_equal(got["blk.0.ssm_conv1d.weight"], np.concatenate([conv[:qk], v_rows]))
    out = hf[p + "linear_attn.out_proj.weight"].reshape(ref.H, ref.NV, ref.DV)[:, perm].reshape(ref.H, -1)
    np.testing.assert_array_equal(got["blk.0.ssm_out.weight"], out)
    assert torch.tensor(got["blk.3.attn_q.weight"]).shape == (2 * ref.NH * ref.HD, ref.H)  # q and gate unsplit


def test_quantized_values_dequantize_close(sources, tmp_path, capsys):
    """q8_0 / q4_0 / bf16 data decode back to the f32 file's values within the types' rounding."""
    from gguf.quants import dequantize

    src = sources()
    tol = {"f16": 1e-3, "bf16": 8e-3, "q8_0": 1.5e-2, "q4_0": 0.25}
    convert(capsys, src, tmp_path / "f32.gguf", "--outtype", "f32")
    base = {t.name: np.asarray(t.data) for t in GGUFReader(str(tmp_path / "f32.gguf")).tensors}
    measured = {}
    for outtype in tol:
        convert(capsys, src, tmp_path / f"{outtype}.gguf", "--outtype", outtype)
        worst = 0.0
        for t in GGUFReader(str(tmp_path / f"{outtype}.gguf")).tensors:
            values = dequantize(np.asarray(t.data), Q(t.tensor_type)).reshape(base[t.name].shape)
            scale = np.abs(base[t.name]).max()
            worst = max(worst, float(np.abs(values - base[t.name]).max() / scale))
        measured[outtype] = worst
    print("worst |Δ| / max|w| over all tensors: " + ", ".join(f"{k} {v:.2e}" for k, v in measured.items()))
    for outtype, worst in measured.items():
        assert 0 < worst < tol[outtype], outtype


def test_padding_tokens_fill_the_embedding_rows(sources):
    """§3: ids the tokenizer lacks up to the embedding rows become [PAD{i}] of type UNUSED."""
    from specconv.convert.tokenizer import vocabulary

    tokens, types = vocabulary(sources(), ref.V + 6)
    assert tokens[ref.V:] == [f"[PAD{i}]" for i in range(ref.V, ref.V + 6)]
    assert types[ref.V:] == [TokenType.UNUSED] * 6 and types[ref.V - 1] == TokenType.CONTROL


def test_split_output_loads_back(sources, tmp_path, capsys):
    """--split-max-size: NAME-0000i-of-0000N.gguf shards with split.* keys (§5), all other KV in shard 1,
    and the union of the shards' tensors is the unsplit file's, byte for byte."""
    from specconv.runtime.gguf_reader import open_gguf

    src = sources(moe=True)
    convert(capsys, src, tmp_path / "whole" / "m.gguf", "--outtype", "q8_0")
    convert(capsys, src, tmp_path / "split" / "m.gguf", "--outtype", "q8_0", "--split-max-size", "100K")
    shards = sorted((tmp_path / "split").iterdir())
    n = len(shards)
    assert n >= 3 and [p.name for p in shards] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    whole = GGUFReader(str(tmp_path / "whole" / "m.gguf"))
    parts, tensors = [GGUFReader(str(p)) for p in shards], {}
    for i, r in enumerate(parts):
        f = fields(r)
        assert f["split.no"].contents() == i and f["split.no"].types == [VT.UINT16]
        assert f["split.count"].contents() == n and f["split.count"].types == [VT.UINT16]
        assert f["split.tensors.count"].contents() == len(whole.tensors) and f["split.tensors.count"].types == [VT.INT32]
        assert ("qwen35moe.block_count" in f) == (i == 0) and ("tokenizer.ggml.tokens" in f) == (i == 0)
        assert sum(int(t.n_bytes) for t in r.tensors) <= 100_000 or len(r.tensors) == 1
        tensors.update({t.name: t for t in r.tensors})
    assert [t.name for p in parts for t in p.tensors] == [t.name for t in whole.tensors]
    for t in whole.tensors:
        assert np.array_equal(np.asarray(tensors[t.name].data), np.asarray(t.data)), t.name
    merged = open_gguf(shards[0])  # the shard-aware reader finds the siblings from shard 1
    assert len(merged.tensors) == len(whole.tensors)


def test_directory_output_follows_the_naming_convention(sources, tmp_path, capsys):
    """-o DIR/: Name-Size-Finetune-ENCODING.gguf for the model, mtp- + the same name for its sidecar (§4.2)."""
    import shutil

    from gguf.utility import model_weight_count_rounded_notation

    src = tmp_path / "Qwen3.5-Tiny-Instruct"
    shutil.copytree(sources(), src)
    convert(capsys, src, str(tmp_path / "out") + "/", "--mtp", "separate", "--outtype", "q8_0")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    trunk = GGUFReader(str(tmp_path / "out" / names[0]))
    params = sum(int(np.prod([int(d) for d in t.shape])) for t in trunk.tensors)
    label = model_weight_count_rounded_notation(params, min_digits=2)
    assert names == [f"Qwen3.5-Tiny-{label}-Instruct-Q8_0.gguf", f"mtp-Qwen3.5-Tiny-{label}-Instruct-Q8_0.gguf"]
    assert fields(trunk)["general.size_label"].contents() == label


def test_dry_run_prints_the_plan_and_writes_nothing(sources, tmp_path, capsys):
    import json

    code, out, err = run_cli(capsys, "convert", sources(moe=True), "-o", tmp_path / "x" / "m.gguf", "--mtp",
                             "separate", "--outtype", "q4_0", "--dry-run", "--json", "--mkdir")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["dry_run"] and not (tmp_path / "x").exists()
    kinds = {f["kind"]: f for f in plan["files"]}
    assert set(kinds) == {"trunk", "sidecar"}
    for kind, f in kinds.items():
        want = ref.expected_tensors(kind, True)
        got = {t["name"]: t for t in f["tensors"]}
        assert set(got) == set(want)
        for name, (shape, rule) in want.items():
            assert tuple(got[name]["shape"]) == shape and got[name]["type"] == ref.expected_type(rule, "q4_0").name
        assert f["metadata"]["general.file_type"] == 2
        assert f["metadata"]["qwen35moe.block_count"] == (4 if kind == "trunk" else 5)
    # The human-readable plan names every tensor and the metadata too.
    code, out, _ = run_cli(capsys, "convert", sources(), "-o", tmp_path / "y.gguf", "--dry-run")
    assert code == 0 and "blk.4.nextn.eh_proj.weight" in out and "qwen35.nextn_predict_layers" in out
    assert not (tmp_path / "y.gguf").exists()


def test_help_explains_every_option(capsys):
    code, out, _ = run_cli(capsys, "convert", "--help")
    assert code == 0
    for option in ("--outtype", "--mtp", "--split-max-size", "--dry-run", "--force", "--json", "embed", "separate",
                   "q4_0", "mtp-NAME.gguf"):
        assert option in out, option


@pytest.mark.parametrize("dtype,expected", [("bfloat16", Q.BF16), ("float16", Q.F16)])
def test_auto_follows_the_checkpoint_dtype(sources, tmp_path, capsys, dtype, expected):
    """--outtype auto (§2): the type of the first 2-D source tensor (BF16 -> BF16, F16 -> F16)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(sources(), src)
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(src / "model.safetensors"))
    convert(capsys, src, tmp_path / "m.gguf", "--outtype", "auto")
    r = GGUFReader(str(tmp_path / "m.gguf"))
    types = {Q(t.tensor_type) for t in r.tensors if len(t.shape) >= 2 and "conv1d" not in t.name
             and "gate_inp" not in t.name}
    assert types == {expected}
    assert fields(r)["general.file_type"].contents() == {Q.BF16: 32, Q.F16: 1}[expected]


def test_vision_tower_is_skipped_with_a_notice(sources, tmp_path, capsys):
    """Release checkpoints carry a vision tower: it is left out (mmproj territory) and the user is told."""
    code, out, err = run_cli(capsys, "convert", sources(layout="release"), "-o", tmp_path / "m.gguf", "--outtype", "f16")
    assert code == 0, err
    assert "skipped 3 tensor(s): vision/audio tower" in " ".join(err.split())
    assert not any(t.name.startswith(("v.", "model.visual")) for t in GGUFReader(str(tmp_path / "m.gguf")).tensors)


def test_added_tokens_special_control_other_user_defined(sources, tmp_path):
    """§3: added tokens marked special are CONTROL, others USER_DEFINED (unless they look like <|...|>)."""
    import json
    import shutil

    from specconv.convert.tokenizer import vocabulary

    src = tmp_path / "src"
    shutil.copytree(sources(), src)
    tok = json.loads((src / "tokenizer.json").read_text())
    for item in tok["added_tokens"]:
        if item["content"] == "<|endoftext|>":
            item.update(content="<think>", special=False)
        if item["content"] == "<|im_start|>":
            item["special"] = False  # still looks special: CONTROL, as llama.cpp's converter decides
    (src / "tokenizer.json").write_text(json.dumps(tok))
    tokens, types = vocabulary(src, ref.V)
    assert tokens[-3:] == ["<think>", "<|im_start|>", "<|im_end|>"]
    assert types[-3:] == [TokenType.USER_DEFINED, TokenType.CONTROL, TokenType.CONTROL]


@pytest.mark.parametrize("text,expected", [("500M", 500_000_000), ("2G", 2_000_000_000), ("100K", 100_000),
                                           ("1.5G", 1_500_000_000), ("300MB", 300_000_000), ("4096", 4096)])
def test_split_size_units(text, expected):
    from specconv.commands.convert import parse_size

    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "10T", "", "0"])
def test_split_size_errors(capsys, tmp_path, text):
    code, _, err = run_cli(capsys, "convert", tmp_path, "-o", tmp_path / "m.gguf", "--split-max-size", text)
    assert code == 2 and "--split-max-size" in err and len(err.strip().splitlines()) == 1


def test_json_result_names_the_written_files(sources, tmp_path, capsys):
    import json

    code, out, err = run_cli(capsys, "convert", sources(), "-o", tmp_path / "m.gguf", "--mtp", "separate",
                             "--outtype", "q8_0", "--split-max-size", "150K", "--json")
    assert code == 0, err
    result = json.loads(out)
    written = sorted(Path(p).name for p in result["written"])
    assert written == sorted(p.name for p in tmp_path.iterdir()) and len(written) >= 3
    assert {f["kind"] for f in result["files"]} == {"trunk", "sidecar"} and not result["dry_run"]


@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_conversion_never_imports_torch(sources, tmp_path, outtype):
    """The converter is numpy only: importing torch costs seconds, more than converting a small model."""
    import subprocess
    import sys

    out = tmp_path / "model.gguf"
    script = ("import sys\nfrom specconv.cli import main\n"
              "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
              "print('imported:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script, "convert", str(sources(moe=True)), "-o", str(out),
                           "--outtype", outtype], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert out.is_file() and "imported: []" in done.stdout, done.stdout
