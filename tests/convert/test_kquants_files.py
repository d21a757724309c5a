"""Whole K-quant files: `specconv convert --outtype q4_k_m` (one pass) against llama.cpp's quantize
tool run on our lossless (f32, or bf16) file of the same checkpoint.

llama.cpp's quantize is `llama_model_quantize` of llama-cpp-python 0.3.36 with its default
parameters (no importance matrix). The checkpoints are Qwen3.5 dense and MoE (8 experts, GQA 4,
one MTP layer) at shapes whose rows hold 256-element blocks, with FFN-down rows of 352 (a K-quant
block does not fit: the tool's fallbacks), and rows that are all zero, constant, or one outlier; and
the nextn families glm4moe, deepseek2 (tiny: rows of 64, so fallbacks everywhere, and at hidden
256) and glm4moelite, Gemma 4 (altup / laurel / per-layer tensors the tool never quantizes) and its
assistant drafter. The claim tested is the strongest one: the files are equal byte for byte (tensor types, block
bytes, tensor order, shapes, KV and its order). On a mismatch the test lists the tensors that differ.
"""

from __future__ import annotations

import json

import pytest

from specconv.convert.quant_rules import KQUANT_FILE_TYPES
from tests.fixtures.kquant_files import assert_same_file, converted, models, quantize  # noqa: F401 (fixtures)
from tests.fixtures.gguf_files import convert_gguf

pytestmark = [pytest.mark.peer, pytest.mark.slow]

ALL_TYPES = [t for t in KQUANT_FILE_TYPES if t != "q2_k_s"]  # Q2_K_S needs an imatrix: test_kquants_imatrix.py


def _check(converted, quantize, tmp_path, model: str, file_type: str, mtp: str = "embed", lossless: str = "f32"):
    base = converted(model, lossless, mtp)
    ours = converted(model, file_type, mtp)
    for kind, path in ours.items():
        assert_same_file(path, quantize(base[kind], tmp_path / f"llama-{kind}.gguf", file_type))


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("file_type", ALL_TYPES)
@pytest.mark.parametrize("model", ["qwen35", "qwen35moe"])
def test_every_file_type_equals_llama_quantize(converted, quantize, tmp_path, model, file_type):
    _check(converted, quantize, tmp_path, model, file_type)


@pytest.mark.parametrize("file_type", ["q4_k_m", "q6_k"])
@pytest.mark.parametrize("model", ["qwen35", "qwen35moe"])
def test_trunk_and_mtp_sidecar_equal_llama_quantize(converted, quantize, tmp_path, model, file_type):
    """--mtp separate: each file equals the tool's output for our f32 file of the same kind; the
    sidecar is quantized with its own counters, as the tool sees it."""
    _check(converted, quantize, tmp_path, model, file_type, mtp="separate")


@pytest.mark.parametrize("file_type", ["q4_k_m", "q5_k_m", "q6_k"])
@pytest.mark.parametrize("model", ["glm4moe", "deepseek2", "glm4moe-256", "deepseek2-256", "glm4moelite", "gemma4",
                                   "gemma4-assistant"])
def test_nextn_families_equal_llama_quantize(converted, quantize, tmp_path, model, file_type):
    _check(converted, quantize, tmp_path, model, file_type)


def test_bf16_checkpoint_equals_llama_quantize_of_the_bf16_file(converted, quantize, tmp_path):
    """From a bf16 checkpoint the lossless file is bf16 (unquantized tensors stay BF16 in both)."""
    _check(converted, quantize, tmp_path, "qwen35-bf16", "q4_k_m", lossless="bf16")


def test_file_type_kv_and_mtp_types(converted):
    from gguf import GGUFReader

    reader = GGUFReader(converted("qwen35moe", "Q4_K_M")["model"])  # upper case accepted
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("general.")}
    assert fields["general.file_type"] == 15 and fields["general.quantization_version"] == 2
    assert list(reader.fields)[-2:] == ["general.quantization_version", "general.file_type"]
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # what the MTP head gets (docs/convert.md): the trunk's rules, as the last layer; 8 experts -> Q8_0 attn_v
    assert types["blk.4.nextn.eh_proj.weight"] == "Q4_K"
    assert types["blk.4.attn_v.weight"] == "Q8_0" and types["output.weight"] == "Q6_K"
    assert types["blk.4.ffn_gate_inp.weight"] == "F32"


def test_llama_cpp_runs_ours_like_its_own(converted, quantize, tmp_path):
    from tests.fixtures import peers

    ours = converted("qwen35", "q4_k_m")["model"]
    theirs = quantize(converted("qwen35", "f32")["model"], tmp_path / "theirs.gguf", "q4_k_m")
    ids = [5, 17, 42, 99, 3, 250, 7, 77]
    assert peers.llama_greedy(ours, ids, 8) == peers.llama_greedy(theirs, ids, 8)
    assert peers.llama_mtp_context_ok(ours)


@pytest.mark.parametrize("mtp", ["embed", "separate"])
def test_mtp_outtype_keeps_the_head_at_another_type(models, converted, quantize, tmp_path, mtp):
    """--mtp-outtype q8_0: the MTP block's matrices are the q8_0 conversion's, every other tensor is
    the tool's K-quant (its counters still see the MTP block); llama.cpp builds the MTP context."""
    from gguf import GGUFReader

    from tests.fixtures import peers

    src = models("qwen35moe")
    out = convert_gguf(src, tmp_path / "model.gguf", outtype="q4_k_m", mtp=mtp, extra_args=["--mtp-outtype", "q8_0"])
    files = {"model": out} if mtp == "embed" else {"model": out, "sidecar": tmp_path / "mtp-model.gguf"}
    for kind, path in files.items():
        ours = {t.name: t for t in GGUFReader(path).tensors}
        tool = {t.name: t for t in GGUFReader(quantize(converted("qwen35moe", "f32", mtp)[kind],
                                                        tmp_path / f"tool-{kind}.gguf", "q4_k_m")).tensors}
        q8 = {t.name: t for t in GGUFReader(converted("qwen35moe", "q8_0", mtp)[kind]).tensors}
        assert list(ours) == list(tool)
        for name, t in ours.items():
            mtp_matrix = name.startswith("blk.4.") and tool[name].tensor_type.name != "F32"
            expected = q8[name] if mtp_matrix else tool[name]
            assert t.tensor_type == expected.tensor_type, name
            assert t.data.tobytes() == expected.data.tobytes(), name
        if kind == "sidecar" or mtp == "embed":  # the trunk-only file has no MTP block
            assert sum(name.startswith("blk.4.") and t.tensor_type.name == "Q8_0" for name, t in ours.items()) >= 8
    assert peers.llama_mtp_context_ok(out, files.get("sidecar"))
    from specconv.convert.gguf_summary import summarize  # `specconv inspect`: the types of each group

    groups = summarize(files.get("sidecar", out))["by_group"]
    assert groups["mtp"].get("Q8_0", 0) >= 8 and "Q4_K" not in groups["mtp"]


def test_numpy_fallback_writes_the_same_file(models, converted, tmp_path):
    """Without the native encoders (SPECCONV_NO_NATIVE=1, in a fresh process: the choice is made at
    import) the converter writes the same file through convert/kquants.py."""
    import os
    import subprocess
    import sys

    out = tmp_path / "numpy.gguf"
    subprocess.run([sys.executable, "-m", "specconv", "convert", str(models("qwen35moe")), "-o", str(out),
                    "--outtype", "q5_k_m", "--json"], env={**os.environ, "SPECCONV_NO_NATIVE": "1"}, check=True,
                   capture_output=True)
    assert out.read_bytes() == converted("qwen35moe", "q5_k_m")["model"].read_bytes()


def test_threads_do_not_change_the_bytes(models, tmp_path):
    src = models("qwen35moe")
    one = convert_gguf(src, tmp_path / "one.gguf", outtype="q3_k_m", extra_args=["--threads", "1"])
    four = convert_gguf(src, tmp_path / "four.gguf", outtype="q3_k_m", extra_args=["--threads", "4"])
    assert one.read_bytes() == four.read_bytes()


def test_dry_run_plan_and_names(models, tmp_path, converted):
    from click.testing import CliRunner
    from gguf import GGUFReader

    from specconv import cli as cli_module

    src = models("qwen35")
    result = CliRunner().invoke(cli_module.cli, ["convert", str(src), "-o", str(tmp_path) + "/", "--outtype", "q5_k_s",
                                                 "--dry-run", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["outtype"] == "Q5_K_S" and plan["files"][0]["path"].endswith("-Q5_K_S.gguf")
    written = {t.name: t.tensor_type.name for t in GGUFReader(converted("qwen35", "q5_k_s")["model"]).tensors}
    assert {t["name"]: t["type"] for t in plan["files"][0]["tensors"]} == written
