"""`specconv quantize IN OUT TYPE` against llama.cpp's quantize tool on the same input file.

Inputs: our f32 and bf16 files (Qwen3.5-MoE and dense at K-quant shapes, built by
tests/convert/test_kquants_files.py's writer) and llama.cpp's own converter's f16 file of the tiny
Qwen3.5 fixture (when SPECCONV_LLAMA_CPP_SRC names its tree, as tests/run.sh sets it). Every output
must equal the tool's byte for byte; a quantized input is refused unless --allow-requantize.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specconv import cli as cli_module
from tests.fixtures.kquant_files import assert_same_file, quantize, write_qwen35  # noqa: F401 (fixture)
from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream

pytestmark = [pytest.mark.peer, pytest.mark.slow]


def _quantize(src, dst, file_type, *extra):
    result = CliRunner().invoke(cli_module.cli, ["quantize", str(src), str(dst), file_type, "--json", *extra])
    return result


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    root = tmp_path_factory.mktemp("requantize")
    moe = write_qwen35(root / "moe", moe=True, n_layers=4)
    dense_bf16 = write_qwen35(root / "dense-bf16", moe=False, n_layers=4, dtype="bfloat16")
    return {"moe-f32": convert_gguf(moe, root / "moe-f32.gguf", outtype="f32"),
            "dense-bf16": convert_gguf(dense_bf16, root / "dense-bf16.gguf", outtype="bf16"),
            "moe-separate": convert_gguf(moe, root / "sep.gguf", outtype="f32", mtp="separate").with_name("mtp-sep.gguf")}


@pytest.mark.parametrize("source,file_type", [("moe-f32", "q4_k_m"), ("moe-f32", "Q3_K_L"), ("moe-f32", "q6_k"),
                                              ("dense-bf16", "q5_k_m"), ("dense-bf16", "q2_k"),
                                              ("moe-separate", "q4_k_s")])
def test_requantized_file_equals_llama_quantize(lossless, quantize, tmp_path, source, file_type):  # noqa: F811
    src = lossless[source]
    result = _quantize(src, tmp_path / "ours.gguf", file_type)
    assert result.exit_code == 0, result.output
    assert_same_file(tmp_path / "ours.gguf", quantize(src, tmp_path / "llama.gguf", file_type.lower()))


def test_llama_cpp_converters_file(quantize, tmp_path):  # noqa: F811
    """Anyone's file: llama.cpp's converter's f16 output of the tiny Qwen3.5 (rows of 64: fallbacks)."""
    from tests.fixtures.tiny_qwen35 import build_qwen35

    src = convert_gguf_upstream(build_qwen35(tmp_path / "hf", moe=True, layout="release"), tmp_path / "up.gguf",
                                outtype="f16")
    result = _quantize(src, tmp_path / "ours.gguf", "q4_k_m")
    assert result.exit_code == 0, result.output
    assert_same_file(tmp_path / "ours.gguf", quantize(src, tmp_path / "llama.gguf", "q4_k_m"))


def test_quantized_input_is_refused_unless_allowed(lossless, tmp_path):
    q8 = tmp_path / "q8.gguf"
    assert _quantize(lossless["moe-f32"], tmp_path / "q6.gguf", "q6_k").exit_code == 0
    result = _quantize(tmp_path / "q6.gguf", q8, "q4_k_m")
    assert result.exit_code != 0 and "already Q6_K" in str(result.exception or result.output)
    assert not q8.exists() and not list(tmp_path.glob(".q8*"))
    allowed = _quantize(tmp_path / "q6.gguf", q8, "q4_k_m", "--allow-requantize")
    assert allowed.exit_code == 0, allowed.output
    from gguf import GGUFReader

    assert GGUFReader(q8).fields["general.file_type"].contents() == 15
