"""`specconv inspect`: arch, graph types served (decided as llama.cpp's loaders decide, docs/reference/gguf-layout.md §4.3),
hparams, tensor table and sizes, split shards. Files come from `specconv convert` and, for the corner
cases of the detection rules, from gguf-py's writer directly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from tests.fixtures.cli import run_cli



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("inspect")
    src = build_qwen35(root / "hf", moe=True)
    convert_gguf(src, root / "emb.gguf", outtype="q8_0", mtp="embed")
    convert_gguf(src, root / "t.gguf", outtype="q8_0", mtp="separate")
    convert_gguf(src, root / "split" / "s.gguf", outtype="q8_0", extra_args=["--split-max-size", "100K"])
    return root


def inspect_json(capsys, path) -> dict:
    code, out, err = run_cli(capsys, "inspect", path, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name,kind,serves,blocks,nextn", [
    ("emb.gguf", "embedded", ["main", "mtp"], 5, 1),
    ("t.gguf", "trunk-only", ["main"], 4, 0),
    ("mtp-t.gguf", "mtp-only", ["mtp"], 5, 1),
])
def test_graph_types_of_converted_files(files, capsys, name, kind, serves, blocks, nextn):
    info = inspect_json(capsys, files / name)
    assert info["arch"] == "qwen35moe" and info["kind"] == kind and info["serves"] == serves
    assert info["block_count"] == blocks and info["nextn_predict_layers"] == nextn and info["problems"] == []
    # Tensor table and sizes agree with gguf-py's own reader.
    r = GGUFReader(str(files / name))
    assert [(t["name"], t["type"], t["shape"], t["bytes"]) for t in info["tensors"]] == [
        (t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.n_bytes)) for t in r.tensors]
    assert info["tensor_bytes"] == sum(int(t.n_bytes) for t in r.tensors)
    assert info["file_bytes"] == (files / name).stat().st_size
    assert sum(v["tensors"] for v in info["by_type"].values()) == len(r.tensors)
    assert info["hparams"]["expert_count"] == 4 and info["hparams"]["embedding_length"] == 64
    assert info["general"]["general.file_type"] == 7


def test_split_model_from_shard_one(files, capsys):
    shards = sorted((files / "split").iterdir())
    info = inspect_json(capsys, shards[0])
    whole = inspect_json(capsys, files / "emb.gguf")
    assert info["shards"] == [str(p) for p in shards] and len(shards) >= 3
    assert info["serves"] == ["main", "mtp"] and info["n_tensors"] == whole["n_tensors"]
    assert {t["shard"] for t in info["tensors"]} == set(range(1, len(shards) + 1))
    code, _, err = run_cli(capsys, "inspect", shards[1])
    assert code == 2 and "give the first shard" in err and len(err.strip().splitlines()) == 1


def test_human_output(files, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: one table row per key (80 columns: tests/cli/test_tables_80.py)
    code, out, _ = run_cli(capsys, "inspect", files / "mtp-t.gguf")
    assert code == 0
    assert "mtp-only" in out and "serves: mtp" in out and "blk.4.nextn.eh_proj.weight" in out
    assert "qwen35moe.attention.recurrent_layers" in out and "[true, true, true, false, false]" in out


def _fake(path, arch: str, block_count: int, nextn: int | None, tensors: list[str]):
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", block_count)
    if nextn is not None:
        w.add_uint32(f"{arch}.nextn_predict_layers", nextn)
    for name in tensors:
        w.add_tensor(name, np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,nextn,tensors,serves,problem", [
    # §4.3 mtp_only: nextn > 0 and no blk.0.attn_norm.weight
    ("glm4moe", 1, ["token_embd.weight", "blk.2.nextn.eh_proj.weight"], ["mtp"], False),
    # §4.3 trunk_only (glm4moe / deepseek2 only): nextn > 0 and blk.{n_layer}.nextn.eh_proj absent
    ("glm4moe", 1, ["blk.0.attn_norm.weight"], ["main"], False),
    ("deepseek2", 1, ["blk.0.attn_norm.weight"], ["main"], False),
    # qwen35 has no trunk_only detection: such a file does not load in llama.cpp
    ("qwen35", 1, ["blk.0.attn_norm.weight"], ["main"], True),
    ("qwen35", None, ["blk.0.attn_norm.weight"], ["main"], False),
    ("qwen35", 1, ["blk.0.attn_norm.weight", "blk.2.nextn.eh_proj.weight"], ["main", "mtp"], False),
])
def test_detection_rules(tmp_path, capsys, arch, nextn, tensors, serves, problem):
    path = _fake(tmp_path / "f.gguf", arch, 3, nextn, tensors)
    info = inspect_json(capsys, path)
    assert info["serves"] == serves
    assert bool(info["problems"]) == problem, info["problems"]


def test_not_a_gguf(tmp_path, capsys):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all, just text" * 4)
    code, _, err = run_cli(capsys, "inspect", tmp_path / "x.gguf")
    assert code == 2 and "not a GGUF" in err and len(err.strip().splitlines()) == 1


TEMPLATE = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"


def test_float32_values_shortest_and_strings_on_one_row(tmp_path, capsys, monkeypatch):
    """A float32 eps prints as 1e-06 (the shortest decimal that reads back as the same float32, not the
    double 9.999999974752427e-07); a chat template's newlines print escaped, so its row stays one row,
    and a value longer than the cell limit is cut with its length given (--json keeps it whole)."""
    from specconv.tables import ELIDE_AT

    w = GGUFWriter(str(tmp_path / "m.gguf"), "qwen35")
    w.add_uint32("qwen35.block_count", 1)
    w.add_float32("qwen35.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_array("qwen35.some_scales", [0.1, 1e-5, 3.0])
    w.add_chat_template(TEMPLATE)
    w.add_string("general.description", "x" * (ELIDE_AT + 40))
    w.add_tensor("blk.0.attn_norm.weight", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = inspect_json(capsys, tmp_path / "m.gguf")
    eps = info["hparams"]["attention.layer_norm_rms_epsilon"]
    stored = GGUFReader(str(tmp_path / "m.gguf")).fields["qwen35.attention.layer_norm_rms_epsilon"].parts[-1][0]
    print(f"eps stored {float(stored)!r}, shown {eps!r}")
    assert eps == 1e-06 and np.float32(eps) == stored and float(stored) != 1e-06
    assert info["hparams"]["some_scales"] == [0.1, 1e-05, 3.0]
    assert info["tokenizer"]["tokenizer.chat_template"] == TEMPLATE
    monkeypatch.setenv("COLUMNS", "400")  # one table line per key
    code, out, _ = run_cli(capsys, "inspect", tmp_path / "m.gguf")
    assert code == 0
    lines = out.splitlines()
    assert any("layer_norm_rms_epsilon" in line and " 1e-06 " in line for line in lines)
    assert "9.99999" not in out and "[0.1, 1e-05, 3.0]" in out
    row = next(line for line in lines if "tokenizer.chat_template" in line)
    assert TEMPLATE.replace("\n", "\\n") in row  # the whole template, escaped, on its key's line
    desc = next(line for line in lines if "general.description" in line)
    assert "x" * ELIDE_AT + f"… ({ELIDE_AT + 40} characters)" in desc and "x" * (ELIDE_AT + 1) not in desc


def test_dry_run_notes_as_marks(files, capsys, monkeypatch):
    """`convert --dry-run`: a note shared by many tensors (the F32 rule) is a mark in the table and one
    legend line under it, so every tensor row is one line even at 80 columns."""
    from tests.fixtures.tiny_qwen35 import build_qwen35

    src = build_qwen35(files / "hf-notes")
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(capsys, "convert", src, "-o", files / "notes.gguf", "--dry-run")
    assert code == 0, err
    code, js, _ = run_cli(capsys, "convert", src, "-o", files / "notes.gguf", "--dry-run", "--json")
    tensors = json.loads(js)["files"][0]["tensors"]
    notes = sorted({t["note"] for t in tensors if t.get("note")})
    assert notes and sum(1 for t in tensors if t.get("note")) > len(notes)
    lines = out.splitlines()
    at = []
    for t in tensors:
        row = [i for i, line in enumerate(lines) if f" {t['name']} " in line]
        assert len(row) == 1, t["name"]
        at.append(row[0])
        cells = lines[row[0]].replace("│", " ").split()
        assert cells[1] == t["type"]
        if t.get("note"):
            assert f"{cells[-1]} {t['note']}" in lines  # the mark and its legend line
    assert at == list(range(at[0], at[0] + len(tensors)))  # one line per tensor: no row wraps
    assert all(sum(1 for line in lines if note in line) == 1 for note in notes)
