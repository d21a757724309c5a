"""`specconv imatrix` against llama.cpp's own `llama-imatrix` (built from the vendored llama.cpp,
tools/llamacpp_quantize.py; skipped unless built or SPECCONV_BUILD_LLAMA_TOOLS=1) on the same F32
GGUF and text, and the files both make quantized by llama.cpp's `llama-quantize`:

* the values: the same tensors, the same counts, sums within IMATRIX_REL of each other — llama.cpp's
  activations come from its own float32 kernels (F32 KV cache, no flash attention here), summed into
  float32; ours from the runtime's float32 forward, summed in float64;
* the format: llama-imatrix's sums and counts written by our writer are its file byte for byte, and
  llama-quantize given either file writes the same bytes;
* our file is accepted by llama-quantize and by `specconv quantize`, which write the same bytes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specconv import cli as cli_module
from specconv.convert import imatrix as im
from tests.fixtures.imatrix_inputs import checkpoints, text  # noqa: F401 (fixtures)
from tests.fixtures.kquant_files import assert_same_file, converted, llama_tool, models, run_llama_quantize  # noqa: F401

pytestmark = [pytest.mark.peer, pytest.mark.slow]
# measured figures: docs/imatrix.md §4
IMATRIX_REL = 1e-4  # per tensor, ‖ours − llama‖ / ‖llama‖: the goal on the bundled model
VALUE_REL = 1e-3  # per value, |ours − llama| / llama
F32_OF_F64 = 1e-5  # per value, our float32 sums against our float64 ones (the bundled model)


@pytest.fixture(scope="module")
def llama_imatrix():
    return llama_tool("imatrix")


@pytest.fixture(scope="module")
def llama_quantize():
    return llama_tool("quantize")


def run_llama_imatrix(exe: Path, model: Path, text: Path, out: Path, ctx: int, chunks: int, *extra) -> Path:
    r = subprocess.run([str(exe), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks",
                        str(chunks), "-o", str(out), "--no-ppl", "-t", "2", *extra], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def run_ours(model: Path, text: Path, out: Path, ctx: int, chunks: int, *extra) -> Path:
    r = CliRunner().invoke(cli_module.cli, ["imatrix", str(model), "--text", str(text), "--ctx", str(ctx), "--chunks",
                                            str(chunks), "-o", str(out), *extra])
    assert r.exit_code == 0, r.output
    return out


def read_raw(path: Path) -> tuple[dict, dict, dict]:
    """(sums {name: [experts, row]}, counts {name: [experts]}, KV) of an imatrix GGUF, by gguf-py."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    sums, counts = {}, {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        values = np.array(t.data, dtype=np.float32).reshape(int(t.shape[-1]) if len(t.shape) > 1 else 1, -1)
        (sums if kind == "in_sum2" else counts)[base] = values if kind == "in_sum2" else values.reshape(-1)
    kv = {}
    for key in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"):
        field = reader.fields[key]
        parts = [bytes(field.parts[i]).decode() if key == "imatrix.datasets" else int(field.parts[i][0])
                 for i in field.data]
        kv[key] = parts if key == "imatrix.datasets" else parts[0]
    return sums, counts, kv


def compare(ours: Path, theirs: Path) -> dict:
    """Same tensors, KV and counts; the largest differences of the sums: per value |a − b| / b, and per
    tensor ‖a − b‖ / ‖b‖ (each with the tensor it is in)."""
    a_sums, a_counts, a_kv = read_raw(ours)
    b_sums, b_counts, b_kv = read_raw(theirs)
    assert sorted(a_sums) == sorted(b_sums), sorted(set(a_sums) ^ set(b_sums))
    assert a_kv == b_kv
    value, tensor = (0.0, ""), (0.0, "")
    for name in b_sums:
        assert np.array_equal(a_counts[name], b_counts[name]), (name, a_counts[name], b_counts[name])
        a, b = a_sums[name].astype(np.float64), b_sums[name].astype(np.float64)
        positive = b > 0
        assert np.array_equal(a > 0, positive), name
        value = max(value, (float(np.max(np.abs(a - b)[positive] / b[positive])), name))
        tensor = max(tensor, (float(np.linalg.norm(a - b) / np.linalg.norm(b)), name))
    return {"value": value, "tensor": tensor, "n": len(b_sums)}


def _line(label: str, d: dict) -> str:
    return (f"{label}: {d['n']} tensors, counts equal; per tensor ‖Δ‖/‖ref‖ ≤ {d['tensor'][0]:.2e} "
            f"({d['tensor'][1]}), per value |Δ|/ref ≤ {d['value'][0]:.2e} ({d['value'][1]})")


@pytest.mark.parametrize("name,ctx,chunks,per_tensor,per_value", [
    ("bundled", 128, 8, IMATRIX_REL, VALUE_REL), ("bundled", 512, 8, 10 * IMATRIX_REL, 10 * VALUE_REL),
    ("dense", 64, 4, IMATRIX_REL, VALUE_REL), ("moe", 64, 4, IMATRIX_REL, VALUE_REL)])
def test_values_match_llama_imatrix(checkpoints, text, llama_imatrix, tmp_path,  # noqa: F811
                                    name, ctx, chunks, per_tensor, per_value):
    """Per tensor within `per_tensor`, per value within `per_value`. On the bundled model the largest
    differences (the input of the full-attention block's output projection, and of the FFN after it;
    they grow with the chunk's length) are llama.cpp's: our float32 sums are within F32_OF_F64 of the
    runtime's float64 ones, which equal transformers' in float64 (tests/convert/test_imatrix.py), and
    llama-imatrix's are farther from those. On the tiny random models the Gated DeltaNet layers
    amplify float32 rounding on both sides alike (both printed)."""
    gguf = checkpoints(name)[1]
    ours = run_ours(gguf, text, tmp_path / "ours.gguf", ctx, chunks)
    theirs = run_llama_imatrix(llama_imatrix, gguf, text, tmp_path / "llama.gguf", ctx, chunks, "-ctk", "f32", "-ctv",
                               "f32", "-fa", "off")
    d = compare(ours, theirs)
    exact = compare(ours, run_ours(gguf, text, tmp_path / "f64.gguf", ctx, chunks, "--dtype", "f64"))
    llama_to_f64 = compare(theirs, tmp_path / "f64.gguf")
    print(_line(f"{name} ctx {ctx} vs llama-imatrix", d))
    print(_line(f"{name} ctx {ctx} f32 vs our float64", exact) + f"; llama-imatrix vs our float64: per value "
          f"{llama_to_f64['value'][0]:.2e}")
    assert d["tensor"][0] < per_tensor and d["value"][0] < per_value
    if name == "bundled":
        assert exact["value"][0] < F32_OF_F64 < llama_to_f64["value"][0]


def test_values_with_llama_imatrix_defaults(checkpoints, text, llama_imatrix, tmp_path):  # noqa: F811
    """llama-imatrix as users run it (F16 KV cache, flash attention as it decides): the figure the
    documentation states for that case."""
    gguf = checkpoints("bundled")[1]
    ours = run_ours(gguf, text, tmp_path / "ours.gguf", 128, 8)
    d = compare(ours, run_llama_imatrix(llama_imatrix, gguf, text, tmp_path / "llama.gguf", 128, 8))
    print(_line("bundled vs llama-imatrix with its defaults", d))
    assert d["tensor"][0] < IMATRIX_REL and d["value"][0] < VALUE_REL


def test_our_writer_gives_llama_imatrix_bytes_and_the_same_quants(converted, text, llama_imatrix,  # noqa: F811
                                                                  llama_quantize, tmp_path):
    """llama-imatrix's sums, counts and KV written by convert/imatrix.py are its file byte for byte;
    llama-quantize given either file (under the same name, which it records) writes the same bytes."""
    f32 = converted("qwen35moe", "f32")["model"]
    theirs = run_llama_imatrix(llama_imatrix, f32, text, tmp_path / "llama.gguf", 64, 4)
    sums, counts, kv = read_raw(theirs)
    meta = (kv["imatrix.datasets"], kv["imatrix.chunk_count"], kv["imatrix.chunk_size"])
    for side, write in (("a", lambda p: p.write_bytes(theirs.read_bytes())),
                        ("b", lambda p: im.write_gguf(p, sums, counts, *meta))):
        (tmp_path / side).mkdir()
        write(tmp_path / side / "imatrix.gguf")
        r = subprocess.run([str(llama_quantize), "--imatrix", "imatrix.gguf", str(f32), "q.gguf", "Q4_K_M", "2"],
                           cwd=tmp_path / side, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "b" / "imatrix.gguf").read_bytes() == theirs.read_bytes()
    assert_same_file(tmp_path / "a" / "q.gguf", tmp_path / "b" / "q.gguf")


@pytest.mark.parametrize("file_type", ["q4_k_m", "q3_k_s"])
def test_llama_quantize_and_specconv_quantize_take_our_file(converted, text, llama_quantize, tmp_path,  # noqa: F811
                                                            file_type):
    """Our file (the hidden-256 Qwen3.5-MoE, 8 experts) read by llama-quantize and by `specconv quantize`:
    the same bytes, and not the unweighted file's."""
    f32 = converted("qwen35moe", "f32")["model"]
    ours = run_ours(f32, text, tmp_path / "ours.gguf", 64, 4)
    theirs = run_llama_quantize(llama_quantize, f32, tmp_path / "llama.gguf", file_type, ours)
    r = CliRunner().invoke(cli_module.cli, ["quantize", str(f32), str(tmp_path / "q.gguf"), file_type.upper(),
                                            "--imatrix", str(ours)])
    assert r.exit_code == 0, r.output
    assert_same_file(tmp_path / "q.gguf", theirs)
    assert theirs.read_bytes() != converted("qwen35moe", file_type)["model"].read_bytes()


def test_quants_from_either_imatrix(converted, text, llama_imatrix, llama_quantize, tmp_path):  # noqa: F811
    """Measured, not claimed equal: how much of a Q4_K_M file changes between our imatrix and
    llama-imatrix's of the same text (values a few 1e-6 apart)."""
    f32 = converted("qwen35moe", "f32")["model"]
    ours = run_ours(f32, text, tmp_path / "ours.gguf", 64, 4)
    theirs = run_llama_imatrix(llama_imatrix, f32, text, tmp_path / "llama.gguf", 64, 4, "-ctk", "f32", "-ctv", "f32",
                               "-fa", "off")
    worst = compare(ours, theirs)["value"][0]
    a = run_llama_quantize(llama_quantize, f32, tmp_path / "a.gguf", "q4_k_m", ours).read_bytes()
    b = run_llama_quantize(llama_quantize, f32, tmp_path / "b.gguf", "q4_k_m", theirs).read_bytes()
    assert len(a) == len(b)
    differ = np.count_nonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))
    print(f"Q4_K_M from ours vs llama-imatrix's (values within {worst:.1e}): {differ} of {len(a)} bytes differ")
    assert differ < len(a) // 100
