"""`specconv mtp` on glm4moe and deepseek2 files (nextn blocks with their own embedding / head copies).

Files come from `specconv convert` on the tiny GLM-4.5 / DeepSeek-V3 fixtures
(tests/fixtures/tiny_glm_deepseek.py). Besides the round trip (byte identity with the converter's
sidecar and embedded file, and llama.cpp MTP logits against transformers' MtpModel), these families
exercise the "stripped" layout that some quantization tools produce: the KV still declares the
nextn layer but its tensors are gone; llama.cpp loads such glm4moe / deepseek2 files as trunk-only,
and `mtp merge` must restore the embedded file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from specconv.cli import main as cli_main
from tests.fixtures import peers

pytestmark = pytest.mark.slow

IDS = [5, 17, 42, 99, 3, 250, 7, 77, 301, 12]


def mtp(*args) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["mtp", *map(str, args)])
        raise SystemExit(0)
    assert exc.value.code == 0


@pytest.fixture(scope="module", params=["glm4moe", "deepseek2"])
def family_files(request, tmp_path_factory):
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_glm_deepseek import build_tiny

    root = tmp_path_factory.mktemp(request.param)
    src = build_tiny(root / "src", request.param)
    files = {}
    for mode, flag in (("embedded", "embed"), ("trunk", "none"), ("sidecar", "only")):
        path = root / f"{mode}.gguf"
        convert_gguf(src, path, mtp=flag)
        prefixed = path.with_name("mtp-" + path.name)  # `--mtp only -o NAME` may write mtp-NAME
        files[mode] = path if path.exists() or not prefixed.exists() else prefixed
    return request.param, src, root, files


def strip_head(src: Path, dst: Path) -> Path:
    """Copy a GGUF with gguf-py, keeping every KV pair but dropping the nextn block's tensors."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n = reader.fields[f"{arch}.block_count"].contents() - reader.fields[f"{arch}.nextn_predict_layers"].contents()
    writer = GGUFWriter(dst, arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = GGUFValueType(f.types[0])
        writer.add_key_value(f.name, f.contents(), vtype, GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if not t.name.startswith(f"blk.{n}."):
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_round_trip_is_byte_identical(family_files):
    family, _, root, files = family_files
    side = root / "mtp-x.gguf"
    mtp("extract", files["embedded"], "-o", side, "--force")
    assert side.read_bytes() == files["sidecar"].read_bytes()
    names = {t.name for t in GGUFReader(side).tensors}
    print(f"{family} sidecar tensors: {len(names)}, nextn: {sorted(n for n in names if '.nextn.' in n)}")
    assert any(n.endswith("nextn.embed_tokens.weight") for n in names)  # the fixture ships the copies
    out = root / "merged.gguf"
    mtp("merge", files["trunk"], side, "-o", out, "--force")
    assert out.read_bytes() == files["embedded"].read_bytes()


def test_grafted_file_runs_mtp_in_llama_cpp(family_files):
    peers.require_llama_cpp()
    from tests.fixtures.tiny_glm_deepseek import hf_mtp_llamacpp_rows

    family, src, root, files = family_files
    out = root / "graft.gguf"
    mtp("merge", files["trunk"], files["sidecar"], "-o", out, "--force")
    assert peers.llama_mtp_context_ok(out)
    logits, hidden, _ = peers.llama_mtp_logits(out, IDS, return_hidden=True)
    diff = np.abs(logits - hf_mtp_llamacpp_rows(src, IDS, hidden)).max()
    print(f"{family} grafted file, llama.cpp MTP logits vs transformers MtpModel: max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


def test_stripped_file_loads_as_trunk_and_merge_restores_it(family_files):
    peers.require_llama_cpp()
    family, _, root, files = family_files
    stripped = strip_head(files["embedded"], root / "stripped.gguf")
    # llama.cpp's glm4moe / deepseek2 loaders accept it as a trunk-only file ...
    trunk_diff = np.abs(peers.llama_logits(stripped, IDS) - peers.llama_logits(files["embedded"], IDS)).max()
    print(f"{family} stripped file: trunk logits vs embedded file {trunk_diff:.2e}")
    assert trunk_diff == 0
    # ... and the graft puts the head back where it was.
    out = root / "restored.gguf"
    mtp("merge", stripped, files["sidecar"], "-o", out, "--force")
    assert out.read_bytes() == files["embedded"].read_bytes()


def test_head_embedding_and_output_copies_in_q4_0(family_files):
    # The nextn block's own embedding and LM head copies re-typed to q4_0, the rest of the head and
    # the whole trunk as they were; llama.cpp still builds the MTP graph and its MTP logits follow a
    # transformers reference given the same (dequantized q4_0) tables. What remains is llama.cpp's
    # CPU q4_0 matmul rounding its activations to q8_0.
    peers.require_llama_cpp()
    from tests.fixtures.tiny_glm_deepseek import hf_mtp_llamacpp_rows

    family, src, root, files = family_files
    out = root / "graft-q4.gguf"
    mtp("merge", files["trunk"], files["sidecar"], "-o", out, "--force",
        "--type-override", r"nextn\.(embed_tokens|shared_head_head)\.weight$=q4_0")
    reader = GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    original = {t.name: t.tensor_type.name for t in GGUFReader(files["embedded"]).tensors}
    changed = {n for n in types if types[n] != original[n]}
    assert {n.split(".", 2)[2] for n in changed} == {"nextn.embed_tokens.weight", "nextn.shared_head_head.weight"}
    assert all(types[n] == "Q4_0" for n in changed)
    assert peers.llama_mtp_context_ok(out)
    logits, hidden, _ = peers.llama_mtp_logits(out, IDS, return_hidden=True)
    ref_dir = _with_head_tables(src, reader, root / "src-q4-head")
    ref = hf_mtp_llamacpp_rows(ref_dir, IDS, hidden)
    f32_ref = hf_mtp_llamacpp_rows(src, IDS, hidden)
    diff = np.abs(logits - ref).max()
    print(f"{family} head with q4_0 embedding/output copies: llama.cpp MTP logits vs transformers with the "
          f"same tables max |dlogit| = {diff:.2e}; vs the f32 head {np.abs(logits - f32_ref).max():.2e} "
          f"(logit std {ref.std():.2f})")
    assert diff < 0.1
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def _with_head_tables(src: Path, reader: GGUFReader, out_dir: Path) -> Path:
    """A copy of the checkpoint for transformers' MtpModel with the GGUF's nextn tables.

    MtpModel shares the main model's embedding and LM head (the release copies equal them), so the
    dequantized nextn embed_tokens / shared_head_head go into `model.embed_tokens` / `lm_head`; the
    trunk is not run (the hidden rows come from llama.cpp).
    """
    import shutil

    import torch
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out_dir, dirs_exist_ok=True)
    tables = {t.name.split(".", 2)[2]: dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
              for t in reader.tensors if t.name.endswith(("nextn.embed_tokens.weight", "nextn.shared_head_head.weight"))}
    targets = {"model.embed_tokens.weight": "nextn.embed_tokens.weight", "lm_head.weight": "nextn.shared_head_head.weight"}
    replaced = 0
    for shard in sorted(out_dir.glob("*.safetensors")):
        weights = load_file(shard)
        for hf_name, gguf_name in targets.items():
            if hf_name in weights:
                weights[hf_name] = torch.from_numpy(tables[gguf_name].copy())
                replaced += 1
        save_file(weights, shard, metadata={"format": "pt"})
    assert replaced == 2
    return out_dir
