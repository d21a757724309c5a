"""`specconv mtp extract|merge` on GGUF files written directly with gguf.GGUFWriter.

The embedded, trunk-only and sidecar files here are written independently of the graft code (same
random weights, three layouts as llama.cpp's converter modes write them), so "extract then merge gives
the embedded file back" compares against files the graft code never touched. Everything is read back
with the plain gguf.GGUFReader, not with the graft's own reader.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from specconv.cli import main as cli_main

H, FF = 64, 96


# --- independent writers of the three layouts ------------------------------------------------------

def make_weights(n: int, k: int, vocab: int, hidden: int, seed: int) -> dict[str, np.ndarray]:
    """Random weights (numpy order) for N trunk blocks and k qwen35-style MTP blocks."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {"token_embd.weight": rng.standard_normal((vocab, hidden), dtype=np.float32)}

    def block(i: int) -> None:
        w[f"blk.{i}.attn_norm.weight"] = 1 + 0.2 * rng.standard_normal(hidden, dtype=np.float32)
        w[f"blk.{i}.attn_qkv.weight"] = rng.standard_normal((3 * hidden, hidden), dtype=np.float32) / 8
        w[f"blk.{i}.ffn_down.weight"] = rng.standard_normal((hidden, FF), dtype=np.float32) / 8
        w[f"blk.{i}.ssm_a"] = -rng.uniform(1, 16, 4).astype(np.float32)

    for i in range(n):
        block(i)
    w["output_norm.weight"] = 1 + 0.2 * rng.standard_normal(hidden, dtype=np.float32)
    w["output.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32)
    for i in range(n, n + k):  # MTP blocks last, as llama.cpp's converter writes them
        w[f"blk.{i}.nextn.eh_proj.weight"] = rng.standard_normal((hidden, 2 * hidden), dtype=np.float32) / 8
        block(i)
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            w[f"blk.{i}.nextn.{norm}.weight"] = 1 + 0.2 * rng.standard_normal(hidden, dtype=np.float32)
    return w


def tokens_for(vocab: int, variant: int = 0) -> list[str]:
    return [f"tok{i}" if i != 7 or not variant else f"other{variant}" for i in range(vocab)]


def write_layout(path: Path, layout: str, *, n: int = 4, k: int = 1, vocab: int = 128, hidden: int = H,
                 seed: int = 0, arch: str = "qwen35", trunk_type: T = T.F32, head_type: T = T.F32,
                 token_variant: int = 0, mtp_kv_heads: int = 4, split_max_tensors: int = 0,
                 scalar_kv_heads: bool = False, kquants: bool = False) -> Path:
    """layout: 'embedded' (N+k blocks), 'trunk' (N blocks, no nextn key), 'sidecar' (MTP-only) or
    'stripped' (the embedded KV, but the MTP blocks' tensors dropped, as some quantization tools do)."""
    w = make_weights(n, k, vocab, hidden, seed)
    total = n + k if layout != "trunk" else n
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_type("model")
    writer.add_name("tiny")
    writer.add_file_type(7 if trunk_type == T.Q8_0 else 0)
    writer.add_block_count(total)
    if layout != "trunk":
        writer.add_nextn_predict_layers(k)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_head_count(4)
    if scalar_kv_heads:
        writer.add_head_count_kv(2)
    else:
        writer.add_head_count_kv([2] * n + ([mtp_kv_heads] * k if layout != "trunk" else []))
    writer.add_array(f"{arch}.attention.recurrent_layers", [i % 2 == 0 for i in range(n)] + [False] * (total - n))
    writer.add_rope_dimension_sections([1, 1, 0, 0])  # 4 entries: as many as trunk layers when n == 4
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens_for(vocab, token_variant))
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["t o", "to k"])
    writer.add_quantization_version(2)

    def keep(name: str) -> bool:
        block = int(name.split(".")[1]) if name.startswith("blk.") else None
        if layout in ("trunk", "stripped"):
            return block is None or block < n
        if layout == "sidecar":
            return block is None or block >= n
        return True

    for name, arr in w.items():
        if not keep(name):
            continue
        block = int(name.split(".")[1]) if name.startswith("blk.") else None
        wanted = head_type if block is not None and block >= n else trunk_type
        if arr.ndim >= 2 and wanted != T.F32:
            writer.add_tensor(name, quantize(arr, wanted), raw_dtype=wanted)
        else:
            writer.add_tensor(name, arr)
    if kquants and layout != "sidecar":
        # Types gguf-py cannot produce, as third-party quants hold them: random bytes of the right size.
        rng = np.random.default_rng(seed + 1)
        for i, qtype in enumerate((T.Q4_K, T.Q6_K, T.IQ4_XS)):
            block, size = GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (4, 2 * size), dtype=np.uint8)  # 4 rows of 2 blocks
            writer.add_tensor(f"blk.{i}.kquant_demo.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        return path.with_name(f"{path.stem}-00001-of-{len(writer.tensors):05d}.gguf")
    return path


# --- independent readers ------------------------------------------------------------------------

def shards(path: Path) -> list[Path]:
    if "-00001-of-" not in path.name:
        return [path]
    count = int(path.stem.rsplit("-", 1)[1])
    return [path.with_name(path.name.replace("-00001-of-", f"-{i:05d}-of-")) for i in range(1, count + 1)]


def read_kv(path: Path) -> dict[str, tuple]:
    out = {}
    for f in GGUFReader(path).fields.values():
        if f.name.startswith("GGUF.") or f.name.startswith("split."):
            continue
        out[f.name] = (tuple(int(t) for t in f.types), repr(f.contents()))
    return out


def read_tensors(path: Path) -> dict[str, tuple]:
    out = {}
    for shard in shards(path):
        for t in GGUFReader(shard).tensors:
            out[t.name] = (t.tensor_type.name, tuple(int(d) for d in t.shape), bytes(np.asarray(t.data).tobytes()))
    return out


def tensor_order(path: Path) -> list[str]:
    return [t.name for shard in shards(path) for t in GGUFReader(shard).tensors]


def run_cli(*args) -> int:
    with pytest.raises(SystemExit) as exc:
        cli_main(["mtp", *map(str, args)])
        raise SystemExit(0)
    return exc.value.code


# --- extract / merge round trip ----------------------------------------------------------------

def test_extract_equals_independently_written_sidecar(tmp_path):
    embedded = write_layout(tmp_path / "m.gguf", "embedded")
    reference = write_layout(tmp_path / "ref-sidecar.gguf", "sidecar")
    assert run_cli("extract", embedded, "-o", tmp_path / "mtp-m.gguf") == 0
    out = tmp_path / "mtp-m.gguf"
    assert read_kv(out) == read_kv(reference)
    assert read_tensors(out) == read_tensors(reference)
    assert sorted(read_tensors(out)) == sorted(
        ["token_embd.weight", "output_norm.weight", "output.weight", "blk.4.attn_norm.weight", "blk.4.attn_qkv.weight",
         "blk.4.ffn_down.weight", "blk.4.ssm_a", "blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight",
         "blk.4.nextn.hnorm.weight", "blk.4.nextn.shared_head_norm.weight"])


@pytest.mark.parametrize("trunk_type", [T.F32, T.Q8_0])
def test_extract_then_merge_gives_the_embedded_file(tmp_path, trunk_type):
    embedded = write_layout(tmp_path / "m.gguf", "embedded", trunk_type=trunk_type)
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk", trunk_type=trunk_type)
    assert run_cli("extract", embedded, "-o", tmp_path / "mtp-m.gguf") == 0
    assert run_cli("merge", trunk, tmp_path / "mtp-m.gguf", "-o", tmp_path / "merged.gguf") == 0
    merged = tmp_path / "merged.gguf"
    assert read_kv(merged) == read_kv(embedded)
    assert read_tensors(merged) == read_tensors(embedded)
    assert tensor_order(merged) == tensor_order(embedded)
    # Beyond equal pieces: the whole file is the same bytes.
    assert merged.read_bytes() == embedded.read_bytes()


def test_k_and_iq_quant_trunk_tensors_are_copied_unchanged(tmp_path):
    embedded = write_layout(tmp_path / "m.gguf", "embedded", trunk_type=T.Q8_0, kquants=True)
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk", trunk_type=T.Q8_0, kquants=True)
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar")
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "out.gguf") == 0
    out = read_tensors(tmp_path / "out.gguf")
    assert {out[f"blk.{i}.kquant_demo.weight"][0] for i in range(3)} == {"Q4_K", "Q6_K", "IQ4_XS"}
    assert out == read_tensors(embedded)


def test_merge_updates_every_per_layer_array(tmp_path):
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk")
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar", mtp_kv_heads=8)
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "out.gguf") == 0
    r = GGUFReader(tmp_path / "out.gguf")
    assert r.fields["qwen35.block_count"].contents() == 5
    assert r.fields["qwen35.nextn_predict_layers"].contents() == 1
    assert r.fields["qwen35.attention.recurrent_layers"].contents() == [True, False, True, False, False]
    assert r.fields["qwen35.attention.head_count_kv"].contents() == [2, 2, 2, 2, 8]
    # A fixed-length array with N entries is not per-layer and must stay as it is.
    assert r.fields["qwen35.rope.dimension_sections"].contents() == [1, 1, 0, 0]


def test_scalar_trunk_value_becomes_per_layer_only_when_the_head_differs(tmp_path):
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk", scalar_kv_heads=True)
    for heads, expected in ((8, [2, 2, 2, 2, 8]), (2, 2)):
        sidecar = write_layout(tmp_path / f"mtp{heads}.gguf", "sidecar", mtp_kv_heads=heads)
        out = tmp_path / f"out{heads}.gguf"
        assert run_cli("merge", trunk, sidecar, "-o", out) == 0
        assert GGUFReader(out).fields["qwen35.attention.head_count_kv"].contents() == expected


def test_merge_restores_a_stripped_file(tmp_path, capsys):
    embedded = write_layout(tmp_path / "m.gguf", "embedded", trunk_type=T.Q8_0)
    stripped = write_layout(tmp_path / "stripped.gguf", "stripped", trunk_type=T.Q8_0)
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar")
    assert run_cli("merge", stripped, sidecar, "-o", tmp_path / "out.gguf") == 0
    assert (tmp_path / "out.gguf").read_bytes() == embedded.read_bytes()
    two_heads = write_layout(tmp_path / "mtp2.gguf", "sidecar", k=2)
    assert run_cli("merge", stripped, two_heads, "-o", tmp_path / "out2.gguf") == 2
    assert "declares 1 MTP layer(s)" in capsys.readouterr().err


def test_merge_onto_q8_0_trunk_keeps_trunk_bytes(tmp_path):
    trunk = write_layout(tmp_path / "trunk-q8.gguf", "trunk", trunk_type=T.Q8_0)
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar")  # F32 head
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "out.gguf") == 0
    out, src_trunk, src_side = (read_tensors(p) for p in (tmp_path / "out.gguf", trunk, sidecar))
    for name, value in src_trunk.items():
        assert out[name] == value, name
    for name in ("blk.4.nextn.eh_proj.weight", "blk.4.attn_qkv.weight"):
        assert out[name] == src_side[name]
        assert out[name][0] == "F32"
    assert out["blk.0.attn_qkv.weight"][0] == "Q8_0"


# --- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, sidecar_kwargs, phrase", [
    ("arch", dict(arch="qwen35moe"), "architecture differs (qwen35 vs qwen35moe)"),
    ("hidden", dict(hidden=96), "hidden size differs (64 vs 96)"),
    ("vocab", dict(vocab=160), "vocabulary size differs (128 vs 160)"),
    ("tokenizer", dict(token_variant=1), "tokenizer fingerprint differs"),
    ("layers", dict(n=6), "trunk layer count differs (4 vs 6"),
])
def test_mismatched_pairs_are_refused(tmp_path, capsys, kind, sidecar_kwargs, phrase):
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk")
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar", **sidecar_kwargs)
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "out.gguf") == 2
    err = capsys.readouterr().err
    assert phrase in err, err
    assert "do not belong together" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.gguf").exists()
    # Only that kind of mismatch is named (a longer vocabulary is necessarily another token list too).
    kinds = {"arch": "architecture", "hidden": "hidden size", "vocab": "vocabulary size",
             "tokenizer": "tokenizer fingerprint", "layers": "trunk layer count"}
    named = {o for o in kinds.values() if o + " differs" in err}
    expected = {kinds[kind]} | ({kinds["tokenizer"]} if kind == "vocab" else set())
    assert named == expected, err


def test_force_grafts_a_mismatched_pair_and_renumbers(tmp_path):
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk", n=4)
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar", n=6)
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "out.gguf", "--force") == 0
    out = read_tensors(tmp_path / "out.gguf")
    assert "blk.4.nextn.eh_proj.weight" in out and "blk.6.nextn.eh_proj.weight" not in out
    assert out["blk.4.nextn.eh_proj.weight"] == read_tensors(sidecar)["blk.6.nextn.eh_proj.weight"]


def test_trunk_with_head_and_file_without_head_are_refused(tmp_path, capsys):
    embedded = write_layout(tmp_path / "m.gguf", "embedded")
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk")
    assert run_cli("merge", embedded, embedded, "-o", tmp_path / "o.gguf") == 2
    assert "already has an MTP head" in capsys.readouterr().err
    assert run_cli("extract", trunk, "-o", tmp_path / "o.gguf") == 2
    assert "has no MTP head" in capsys.readouterr().err
    assert run_cli("merge", trunk, trunk, "-o", tmp_path / "o.gguf") == 2
    assert "has no MTP head" in capsys.readouterr().err


def test_merge_accepts_an_embedded_file_as_head_source(tmp_path):
    embedded = write_layout(tmp_path / "m.gguf", "embedded")
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk")
    assert run_cli("merge", trunk, embedded, "-o", tmp_path / "out.gguf") == 0
    assert (tmp_path / "out.gguf").read_bytes() == embedded.read_bytes()


def test_existing_output_needs_force_and_inputs_are_never_overwritten(tmp_path, capsys):
    embedded = write_layout(tmp_path / "m.gguf", "embedded")
    (tmp_path / "mtp.gguf").write_bytes(b"keep")
    assert run_cli("extract", embedded, "-o", tmp_path / "mtp.gguf") == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "mtp.gguf").read_bytes() == b"keep"
    assert run_cli("extract", embedded, "-o", tmp_path / "mtp.gguf", "--force") == 0
    assert run_cli("extract", embedded, "-o", embedded, "--force") == 2
    assert "would replace an input" in capsys.readouterr().err


# --- storage types -----------------------------------------------------------------------------

def _values(path: Path, name: str) -> np.ndarray:
    for shard in shards(path):
        for t in GGUFReader(shard).tensors:
            if t.name == name:
                return dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
    raise KeyError(name)


def test_merge_override_puts_head_in_q8_0_while_trunk_stays_f16(tmp_path):
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk", trunk_type=T.F16)
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar")  # F32
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "out.gguf", "--type-override", ".=q8_0") == 0
    out = read_tensors(tmp_path / "out.gguf")
    for name, (ttype, _, _) in out.items():
        block = int(name.split(".")[1]) if name.startswith("blk.") else None
        if block == 4 and name.endswith(".weight") and "norm" not in name:
            assert ttype == "Q8_0", name
        elif block == 4:
            assert ttype == "F32", name  # norms and non-.weight tensors stay F32
    for name, value in read_tensors(trunk).items():
        assert out[name] == value
    err = np.abs(_values(tmp_path / "out.gguf", "blk.4.nextn.eh_proj.weight") - _values(sidecar, "blk.4.nextn.eh_proj.weight")).max()
    print(f"q8_0 head vs f32 head: max |dw| = {err:.2e}")
    assert 0 < err < 0.01


def test_extract_overrides_embedding_and_output_to_q4_0(tmp_path):
    embedded = write_layout(tmp_path / "m.gguf", "embedded")
    out = tmp_path / "mtp-m.gguf"
    assert run_cli("extract", embedded, "-o", out, "--outtype", "f16",
                   "--type-override", r"^(token_embd|output)\.weight$=q4_0") == 0
    types = {name: v[0] for name, v in read_tensors(out).items()}
    assert types["token_embd.weight"] == "Q4_0" and types["output.weight"] == "Q4_0"
    assert types["output_norm.weight"] == "F32" and types["blk.4.nextn.enorm.weight"] == "F32"
    assert types["blk.4.ssm_a"] == "F32"
    assert types["blk.4.nextn.eh_proj.weight"] == "F16" and types["blk.4.attn_qkv.weight"] == "F16"
    assert GGUFReader(out).fields["general.file_type"].contents() == 1  # mostly F16
    err = np.abs(_values(out, "output.weight") - _values(embedded, "output.weight")).max()
    print(f"q4_0 output vs f32: max |dw| = {err:.3f}")
    assert 0 < err < 0.5


def test_override_that_matches_nothing_or_bad_type_is_refused(tmp_path, capsys):
    trunk = write_layout(tmp_path / "trunk.gguf", "trunk")
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar")
    # token_embd is a trunk tensor: overrides in merge only ever reach grafted tensors.
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "o.gguf", "--type-override", "token_embd=q8_0") == 2
    assert "match no tensor" in capsys.readouterr().err
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "o.gguf", "--type-override", "eh_proj=q4_k") == 2
    assert "unsupported storage type" in capsys.readouterr().err


# --- split input and output ---------------------------------------------------------------------

def test_split_trunk_in_and_split_output(tmp_path):
    embedded = write_layout(tmp_path / "m.gguf", "embedded", trunk_type=T.Q8_0)
    first = write_layout(tmp_path / "trunk.gguf", "trunk", trunk_type=T.Q8_0, split_max_tensors=6)
    assert len(shards(first)) == 4 and all(p.is_file() for p in shards(first))
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar", split_max_tensors=4)
    out = tmp_path / "merged.gguf"
    assert run_cli("merge", first, sidecar, "-o", out, "--split-max-size", "40K") == 0
    written = sorted(tmp_path.glob("merged-*.gguf"))
    assert len(written) >= 2 and not out.exists()
    assert [p.name for p in written] == [f"merged-{i:05d}-of-{len(written):05d}.gguf" for i in range(1, len(written) + 1)]
    for p in written:  # a shard holds at most 40 KB of tensor data, or one tensor larger than that
        sizes = [int(t.n_bytes) for t in GGUFReader(p).tensors]
        assert sum(sizes) <= 40_000 or len(sizes) == 1, (p.name, sizes)
    assert read_tensors(written[0]) == read_tensors(embedded)
    assert read_kv(written[0]) == read_kv(embedded)
    assert not list(tmp_path.glob(".*partial*"))


def test_giving_a_later_shard_is_refused(tmp_path, capsys):
    first = write_layout(tmp_path / "trunk.gguf", "trunk", split_max_tensors=6)
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar")
    assert run_cli("merge", shards(first)[1], sidecar, "-o", tmp_path / "o.gguf") == 2
    assert "give the first shard" in capsys.readouterr().err


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    from specconv.convert import mtp_graft

    trunk = write_layout(tmp_path / "trunk.gguf", "trunk")
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar")
    calls = {"n": 0}
    real = mtp_graft.OutTensor.data

    def failing(self):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full")
        return real(self)

    monkeypatch.setattr(mtp_graft.OutTensor, "data", failing)
    assert run_cli("merge", trunk, sidecar, "-o", tmp_path / "out.gguf") == 1
    assert calls["n"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mtp.gguf", "trunk.gguf"]


def test_extract_retypes_a_quantized_head(tmp_path):
    # A q8_0 embedded file re-typed to f16: the values are the q8_0 values (dequantized by gguf-py,
    # independently of the graft code) rounded to f16.
    embedded = write_layout(tmp_path / "m.gguf", "embedded", trunk_type=T.Q8_0, head_type=T.Q8_0)
    out = tmp_path / "mtp-m.gguf"
    assert run_cli("extract", embedded, "-o", out, "--outtype", "f16") == 0
    for name in ("token_embd.weight", "blk.4.nextn.eh_proj.weight", "blk.4.attn_qkv.weight"):
        expected = _values(embedded, name).astype(np.float16)
        got = {t.name: t for t in GGUFReader(out).tensors}[name]
        assert got.tensor_type == T.F16
        assert np.array_equal(np.asarray(got.data), expected), name


def test_garbage_and_truncated_inputs_are_refused(tmp_path, capsys):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all, sorry" * 4)
    assert run_cli("extract", tmp_path / "junk.gguf", "-o", tmp_path / "o.gguf") == 2
    assert "not a GGUF file" in capsys.readouterr().err
    embedded = write_layout(tmp_path / "m.gguf", "embedded")
    data = embedded.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 4096])
    assert run_cli("extract", tmp_path / "cut.gguf", "-o", tmp_path / "o.gguf") == 2
    assert "beyond the end of the file" in capsys.readouterr().err
    assert run_cli("extract", tmp_path / "missing.gguf", "-o", tmp_path / "o.gguf") == 2
    assert "no such file" in capsys.readouterr().err


def test_custom_alignment_is_honoured(tmp_path):
    # A trunk written with general.alignment = 64: the output declares it and its data follow it.
    src = write_layout(tmp_path / "trunk.gguf", "trunk")
    reader = GGUFReader(src)
    writer = GGUFWriter(tmp_path / "trunk64.gguf", "qwen35")
    writer.add_custom_alignment(64)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    sidecar = write_layout(tmp_path / "mtp.gguf", "sidecar")
    assert run_cli("merge", tmp_path / "trunk64.gguf", sidecar, "-o", tmp_path / "out.gguf") == 0
    out = GGUFReader(tmp_path / "out.gguf")
    assert out.alignment == 64 and out.fields["general.alignment"].contents() == 64
    assert all(t.data_offset % 64 == 0 for t in out.tensors)
    expected = {**read_tensors(src), **{k: v for k, v in read_tensors(sidecar).items() if k.startswith("blk.4.")}}
    assert read_tensors(tmp_path / "out.gguf") == expected


def test_extract_names_the_sidecar_after_the_model_by_default(tmp_path):
    first = write_layout(tmp_path / "Tiny-Q8_0.gguf", "embedded", trunk_type=T.Q8_0, split_max_tensors=8)
    assert first.name == "Tiny-Q8_0-00001-of-00004.gguf"
    assert run_cli("extract", first) == 0
    side = tmp_path / "mtp-Tiny-Q8_0.gguf"
    assert read_tensors(side) == {k: v for k, v in read_tensors(first).items()
                                  if k.startswith("blk.4.") or not k.startswith("blk.")}
