"""Whole files with an importance matrix: `specconv convert --outtype T --imatrix F` (one pass) and
`specconv quantize --imatrix F` against llama.cpp's quantize with the same imatrix on our f32 file.

Two references:
* llama.cpp's `llama-quantize` built from the llama.cpp vendored in the llama-cpp-python 0.3.36
  sdist (tools/llamacpp_quantize.py; it reads the imatrix file itself, in both formats). Building
  it takes minutes of CPU, so these tests use a build already in ~/.cache/specconv and build one
  only when SPECCONV_BUILD_LLAMA_TOOLS=1 (tests/run.sh sets it: CI builds once and runs them);
  otherwise they skip, saying so.
* `llama_model_quantize` of llama-cpp-python given the weights our reader loaded (and the tool's
  quantize.imatrix.* KV as overrides): needs no build, so it always runs where llama-cpp-python is.
Models: Qwen3.5 dense and MoE (8 experts, one MTP layer) and GLM-4.5 (nextn) at rows of 256 and
multiples, FFN-down rows of 352 where the tool falls back to Q4_0/Q5_0/Q5_1 (weighted too). The
imatrix holds random positive sums for every quantized tensor but one (quantized without weights)
and one expert without activations (weights 1). The claim: the files are equal byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specconv import cli as cli_module
from specconv.convert import imatrix as im
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.kquant_files import (assert_same_file, converted, llama_tool, models,  # noqa: F401 (fixtures)
                                         quantize_in_process, run_llama_quantize)

pytestmark = [pytest.mark.peer, pytest.mark.slow]


@pytest.fixture(scope="module")
def llama_quantize():
    return llama_tool("quantize")


def imatrix_for(gguf: Path, folder: Path, seed: int = 0) -> dict[str, Path]:
    """Random positive sums for the f32 file's matrices (all but one), in both formats."""
    from specconv.runtime.gguf_reader import open_gguf

    rng = np.random.default_rng(seed)
    sums, counts = {}, {}
    names = [t for t in open_gguf(gguf) if len(t.shape) >= 2 and t.name.endswith("weight")]
    for t in names[:-1]:  # the last one has no entry
        n_mat = t.shape[2] if len(t.shape) == 3 else 1
        sums[t.name] = (rng.gamma(1.0, size=(n_mat, t.shape[0])) * 10.0 ** rng.uniform(0, 3)).astype(np.float32)
        counts[t.name] = rng.integers(1, 3000, size=n_mat)
        if n_mat > 1:
            counts[t.name][1] = 0  # an expert the calibration never routed to
    folder.mkdir(parents=True, exist_ok=True)
    im.write_gguf(folder / "imatrix.gguf", sums, counts, ["calibration.txt"], chunk_count=5)
    im.write_legacy(folder / "imatrix.dat", sums, counts, chunk_size=512, chunk_count=5, dataset="calibration.txt")
    return {"gguf": folder / "imatrix.gguf", "dat": folder / "imatrix.dat"}


@pytest.fixture(scope="module")
def imatrices(converted, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("imatrix")
    cache: dict = {}

    def get(model: str) -> dict[str, Path]:
        if model not in cache:
            cache[model] = imatrix_for(converted(model, "f32")["model"], root / model)
        return cache[model]

    return get


def _convert(src: Path, out: Path, file_type: str, imatrix: Path, *extra) -> Path:
    return convert_gguf(src, out, outtype=file_type, extra_args=["--imatrix", str(imatrix), *extra])


@pytest.mark.parametrize("fmt", ["gguf", "dat"])
@pytest.mark.parametrize("model,file_type", [("qwen35", "q4_k_m"), ("qwen35moe", "q4_k_m"), ("qwen35moe", "q2_k_s"),
                                             ("qwen35", "q3_k_m"), ("glm4moe-256", "q5_k_m"), ("glm4moe-256", "q6_k"),
                                             ("qwen35", "iq4_xs"), ("glm4moe-256", "iq4_nl")])
def test_convert_equals_llama_quantize_with_the_same_imatrix(models, converted, imatrices, llama_quantize, tmp_path,  # noqa: F811
                                                              model, file_type, fmt):
    imatrix = imatrices(model)[fmt]
    ours = _convert(models(model), tmp_path / "ours.gguf", file_type, imatrix)
    theirs = run_llama_quantize(llama_quantize, converted(model, "f32")["model"], tmp_path / "llama.gguf", file_type,
                             imatrix)
    assert_same_file(ours, theirs)


def test_specconv_quantize_equals_llama_quantize(converted, imatrices, llama_quantize, tmp_path):  # noqa: F811
    src, imatrix = converted("qwen35moe", "f32")["model"], imatrices("qwen35moe")["dat"]
    result = CliRunner().invoke(cli_module.cli, ["quantize", str(src), str(tmp_path / "ours.gguf"), "Q3_K_S",
                                                 "--imatrix", str(imatrix)])
    assert result.exit_code == 0, result.output
    assert_same_file(tmp_path / "ours.gguf", run_llama_quantize(llama_quantize, src, tmp_path / "llama.gguf", "q3_k_s",
                                                             imatrix))


def test_reader_and_writer_agree_with_llama_imatrix(converted, imatrices, tmp_path):  # noqa: F811
    """llama-imatrix converts our GGUF imatrix to its legacy format: our writer's .dat of the same sums
    is the same bytes but for the trailing chunk count (which it recounts), our reader gives the same
    weights from both, and those of the GGUF file within the .dat's rounding ((sum / n) * ncall / ncall)."""
    exe = llama_tool("imatrix")
    ours = imatrices("qwen35moe")
    theirs = tmp_path / "theirs.dat"
    r = subprocess.run([str(exe), "-m", str(converted("qwen35moe", "f32")["model"]), "--in-file", str(ours["gguf"]),
                        "-o", str(theirs), "--output-format", "dat", "-c", "512"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    trailer = 8 + len("calibration.txt")
    assert ours["dat"].read_bytes()[:-trailer] == theirs.read_bytes()[:-trailer]
    a, b, g = im.load(ours["dat"]), im.load(theirs), im.load(ours["gguf"])
    assert a.weights.keys() == b.weights.keys() == g.weights.keys()
    assert all(np.array_equal(a.weights[k], b.weights[k]) for k in a.weights)
    worst = max(float(np.max(np.abs(g.weights[k] - a.weights[k]) / np.abs(g.weights[k]))) for k in g.weights)
    print(f"GGUF vs .dat weights: max relative difference {worst:.2e}")
    assert worst < 1e-6


@pytest.fixture(scope="module")
def real_imatrix(converted, tmp_path_factory):  # noqa: F811
    """An imatrix computed by llama-imatrix itself on our f32 Qwen3.5-MoE file (3 chunks of 128 tokens of
    text), in both formats: real activations, experts never routed to, llama-imatrix's own KV."""
    exe = llama_tool("imatrix")
    root = tmp_path_factory.mktemp("real-imatrix")
    text = root / "calibration.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 10 + "def fib(n): return n\n") * 40)
    out = {}
    for fmt in ("gguf", "dat"):
        out[fmt] = root / f"imatrix.{fmt}"
        r = subprocess.run([str(exe), "-m", str(converted("qwen35moe", "f32")["model"]), "-f", str(text), "-c", "128",
                            "-b", "128", "--chunks", "3", "-o", str(out[fmt]), "--output-format", fmt],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("fmt", ["gguf", "dat"])
@pytest.mark.parametrize("file_type", ["q4_k_m", "q3_k_l"])
def test_llama_imatrix_output_gives_llama_quantize_bytes(models, converted, real_imatrix, llama_quantize, tmp_path,  # noqa: F811
                                                         file_type, fmt):
    imatrix = im.load(real_imatrix[fmt])
    print(f"{fmt}: {len(imatrix.weights)} entries, datasets {imatrix.datasets}, {imatrix.chunk_count} chunks")
    ours = _convert(models("qwen35moe"), tmp_path / "ours.gguf", file_type, real_imatrix[fmt])
    theirs = run_llama_quantize(llama_quantize, converted("qwen35moe", "f32")["model"], tmp_path / "llama.gguf",
                             file_type, real_imatrix[fmt])
    assert_same_file(ours, theirs)


def test_q2_k_s_with_a_real_imatrix_needs_mtp_outtype(models, converted, real_imatrix, llama_quantize, tmp_path):  # noqa: F811
    """llama-imatrix never runs the MTP layer, so its imatrix has no entries there, and llama-quantize
    refuses Q2_K_S for the first MTP matrix in its order; we refuse the same tensor (and write nothing)
    and say how to keep the MTP block out of Q2_K_S, which then works."""
    r = subprocess.run([str(llama_quantize), "--imatrix", str(real_imatrix["gguf"]),
                        str(converted("qwen35moe", "f32")["model"]), str(tmp_path / "llama.gguf"), "Q2_K_S", "2"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    refused = next(line for line in (r.stdout + r.stderr).splitlines() if "Missing importance matrix" in line)
    tensor = refused.split("tensor ")[1].split()[0]
    result = CliRunner().invoke(cli_module.cli, ["convert", str(models("qwen35moe")), "-o", str(tmp_path / "a.gguf"),
                                                 "--outtype", "q2_k_s", "--imatrix", str(real_imatrix["gguf"])])
    assert result.exit_code != 0 and f"no entry for {tensor}," in str(result.exception), (tensor, result.exception)
    assert "--mtp-outtype q8_0" in str(result.exception) and not list(tmp_path.glob("a*.gguf"))
    _convert(models("qwen35moe"), tmp_path / "b.gguf", "q2_k_s", real_imatrix["gguf"], "--mtp-outtype", "q8_0")


def test_mtp_outtype_with_an_imatrix(models, converted, real_imatrix, llama_quantize, tmp_path):  # noqa: F811
    """--mtp-outtype q8_0 --imatrix: the MTP block's matrices are the q8_0 conversion's, every other
    tensor is llama-quantize --imatrix's (weighted)."""
    from gguf import GGUFReader

    ours = _convert(models("qwen35moe"), tmp_path / "ours.gguf", "q4_k_m", real_imatrix["gguf"], "--mtp-outtype", "q8_0")
    tool = {t.name: t for t in GGUFReader(run_llama_quantize(llama_quantize, converted("qwen35moe", "f32")["model"],
                                                          tmp_path / "llama.gguf", "q4_k_m", real_imatrix["gguf"])).tensors}
    q8 = {t.name: t for t in GGUFReader(converted("qwen35moe", "q8_0")["model"]).tensors}
    n_mtp = 0
    for t in GGUFReader(ours).tensors:
        mtp_matrix = t.name.startswith("blk.4.") and tool[t.name].tensor_type.name != "F32"
        expected = q8[t.name] if mtp_matrix else tool[t.name]
        n_mtp += mtp_matrix
        assert t.tensor_type == expected.tensor_type and t.data.tobytes() == expected.data.tobytes(), t.name
    assert n_mtp >= 8


@pytest.mark.parametrize("model,file_type", [("qwen35moe", "q4_k_m"), ("qwen35moe", "q2_k_s"), ("glm4moe-256", "q4_k_s")])
def test_convert_equals_llama_model_quantize_with_our_weights(models, converted, imatrices, tmp_path,  # noqa: F811
                                                              model, file_type):
    path = imatrices(model)["gguf"]
    ours = _convert(models(model), tmp_path / "ours.gguf", file_type, path)
    theirs = quantize_in_process(converted(model, "f32")["model"], tmp_path / "llama.gguf", file_type,
                                  im.load(str(path)))
    assert_same_file(ours, theirs)


def test_imatrix_changes_the_bytes_and_ladders_weigh_only_k_quants(models, converted, imatrices, tmp_path):  # noqa: F811
    """A ladder q8_0,q4_k_m with --imatrix: its q8_0 file is the one of the same ladder without it (a
    ladder with a K-quant writes every file in the tool's order), its q4_k_m file the weighted one-type
    run; and the weighted file differs from the unweighted one."""
    src, path = models("qwen35moe"), imatrices("qwen35moe")["gguf"]
    single = _convert(src, tmp_path / "single.gguf", "q4_k_m", path)
    convert_gguf(src, tmp_path / "ladder.gguf", outtype="q8_0,q4_k_m", extra_args=["--imatrix", str(path)])
    assert (tmp_path / "ladder-Q4_K_M.gguf").read_bytes() == single.read_bytes()
    convert_gguf(src, tmp_path / "plain.gguf", outtype="q8_0,q4_k_m")
    assert (tmp_path / "ladder-Q8_0.gguf").read_bytes() == (tmp_path / "plain-Q8_0.gguf").read_bytes()
    assert single.read_bytes() != converted("qwen35moe", "q4_k_m")["model"].read_bytes()


def test_numpy_fallback_writes_the_same_file(models, imatrices, tmp_path):  # noqa: F811
    """SPECCONV_NO_NATIVE=1 (a fresh process: the choice is made at import): convert/kq_weighted.py."""
    src, path = models("qwen35moe"), imatrices("qwen35moe")["gguf"]
    native = _convert(src, tmp_path / "native.gguf", "q5_k_s", path)
    out = tmp_path / "numpy.gguf"
    subprocess.run([sys.executable, "-m", "specconv", "convert", str(src), "-o", str(out), "--outtype", "q5_k_s",
                    "--imatrix", str(path), "--json"], env={**os.environ, "SPECCONV_NO_NATIVE": "1"}, check=True,
                   capture_output=True)
    assert out.read_bytes() == native.read_bytes()


def test_refusals(models, converted, imatrices, tmp_path):  # noqa: F811
    src, f32 = models("qwen35"), converted("qwen35", "f32")["model"]
    runner = CliRunner()
    r = runner.invoke(cli_module.cli, ["convert", str(src), "-o", str(tmp_path / "a.gguf"), "--outtype", "q2_k_s"])
    assert r.exit_code != 0 and "needs an importance matrix" in r.output and not (tmp_path / "a.gguf").exists()
    r = runner.invoke(cli_module.cli, ["quantize", str(f32), str(tmp_path / "b.gguf"), "q2_k_s"])
    assert r.exit_code != 0 and "needs an importance matrix" in r.output
    for t in ("iq2_xs", "IQ3_M", "tq1_0"):
        r = runner.invoke(cli_module.cli, ["quantize", str(f32), str(tmp_path / "c.gguf"), t, "--imatrix",
                                           str(imatrices("qwen35")["gguf"])])
        assert r.exit_code != 0 and "not supported by specconv yet" in r.output, r.output
    r = runner.invoke(cli_module.cli, ["convert", str(src), "-o", str(tmp_path / "d.gguf"), "--outtype", "q8_0",
                                       "--imatrix", str(imatrices("qwen35")["gguf"])])
    assert r.exit_code != 0 and "--imatrix weighs K-quant and IQ4 files" in r.output
    from specconv.runtime.gguf_reader import open_gguf

    name = next(t.name for t in open_gguf(f32) if t.name.endswith("ffn_up.weight"))
    other = tmp_path / "other.gguf"  # as if computed for a wider model
    im.write_gguf(other, {name: np.ones((1, 1024), np.float32)}, {name: [1]})
    r = runner.invoke(cli_module.cli, ["quantize", str(f32), str(tmp_path / "e.gguf"), "q4_k_m", "--imatrix", str(other)])
    assert r.exit_code != 0 and "was the imatrix computed for another model?" in str(r.exception), r.output
    assert not (tmp_path / "e.gguf").exists()
