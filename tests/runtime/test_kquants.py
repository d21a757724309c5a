"""K-quant files as people publish them: made by llama.cpp's quantize tool from our bf16 output.

On the bundled (trained) Qwen3.5 + MTP model:
* the Q4_K_M trunk loads with its tensors in their stored types (Q4_K, Q6_K and the fallback types
  llama.cpp picks for rows a K-quant block cannot hold) and our logits agree with llama.cpp's on the
  same file within the bound stated below; greedy tokens are identical;
* `specconv verify` passes on the Q4_K_M trunk with an f16 `mtp-` sidecar;
* peak RSS of `specconv generate` grows with the file's size, not with parameters × 4 bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specconv import cli as cli_module
from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.generate import generate
from specconv.runtime.stored import StoredWeight
import specconv
from tests.fixtures import peers
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.paths import ROOT

torch.set_num_threads(1)
BUNDLED = Path(specconv.__file__).resolve().parent / "data" / "tiny-qwen35-mtp"
# llama.cpp multiplies K-quant weights with activations quantized to 8 bits (q8_K blocks), we with
# float32 activations: measured max |Δlogit| 0.16 over 48 positions of held-out text, logits of
# std ~4 (a swapped tensor moves them by > 5).
MAX_DIFF_VS_LLAMA_CPP = 0.5


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    """llama.cpp's quantize tool (through llama-cpp-python) on a GGUF file."""
    peers.require_llama_cpp()
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    assert rc == 0, f"llama_model_quantize returned {rc}"
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquants")
    bf16 = convert_gguf(BUNDLED, root / "trunk-bf16.gguf", outtype="bf16", mtp="none")
    convert_gguf(BUNDLED, root / "model-f16.gguf", outtype="f16", mtp="separate")
    sidecar = next(root.glob("mtp-*.gguf"))
    return {"bf16": bf16, "q4_k_m": quantize(bf16, root / "trunk-Q4_K_M.gguf", "Q4_K_M"), "mtp_f16": sidecar}


def prompt(n: int = 48) -> list[int]:
    """The first n tokens of a held-out stdlib file (text the bundled model was not trained on)."""
    from tokenizers import Tokenizer

    from specconv.demo.bundled import heldout_files

    files = heldout_files(BUNDLED)
    text = files[0].read_text(encoding="utf-8") if files else "def fibonacci(n):\n    if n < 2:\n        return n\n" * 8
    return Tokenizer.from_file(str(BUNDLED / "tokenizer.json")).encode(text).ids[:n]


@pytest.mark.peer
def test_q4_k_m_trunk_runs_stored_and_agrees_with_llama_cpp(files):
    model = load_model(files["q4_k_m"], device="cpu")
    types = {model.file.tensor_type(n).name for n in model.file.tensors}
    stored = {type(w).__name__ for w in model.weights.values()}
    assert {"Q4_K", "Q6_K"} <= types and "StoredWeight" in stored
    assert all(not isinstance(w, StoredWeight) or w.raw.dtype == torch.uint8 for w in model.weights.values())
    ids = prompt()
    ours = Context(model, GraphType.MAIN, n_ctx=len(ids)).decode(ids).logits.numpy()
    ref = peers.llama_logits(files["q4_k_m"], ids)
    diff = float(np.abs(ours - ref).max())
    ours_tokens = generate(model, ids[:16], 24).tokens
    ref_tokens = peers.llama_greedy(files["q4_k_m"], ids[:16], 24)
    print(f"\n[Q4_K_M bundled model] tensor types {sorted(types)}; max|Δlogit| vs llama.cpp on the same file "
          f"{diff:.3e} (logit std {ours.std():.2f}); greedy 24 tokens equal: {ours_tokens == ref_tokens}")
    assert diff <= MAX_DIFF_VS_LLAMA_CPP
    assert ours_tokens == ref_tokens


@pytest.mark.peer
def test_verify_passes_on_a_q4_k_m_trunk_with_an_f16_sidecar(files, tmp_path):
    report = tmp_path / "report.json"
    result = CliRunner().invoke(cli_module.cli, [
        "verify", str(files["q4_k_m"]), "--mtp", str(files["mtp_f16"]), "-n", "12", "--report", str(report)])
    data = json.loads(report.read_text())
    failed = [c for c in data["checks"] if not c["passed"]]
    print(f"\n[verify Q4_K_M + f16 mtp-] exit {result.exit_code}; {len(data['checks'])} checks; "
          f"acceptance {data['speculative'].get('acceptance_rate')}; failed: {failed}")
    assert result.exit_code == 0 and data["passed"], result.output


def _peak_rss(path: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"rss-{path.stem}{''.join(extra)}.json"
    cmd = [sys.executable, str(ROOT / "tools" / "peak_rss.py"), str(out), "--",
           sys.executable, "-m", "specconv", "generate", str(path), "--tokens", "1,2,3,4,5,6,7,8", "-n", "2",
           "--device", "cpu", "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_peak_memory_grows_with_the_file_not_with_parameters(tmp_path):
    """Two generated Qwen3.5-shaped q8_0 files (4 and 12 layers): the stored run's peak RSS grows
    by about the file's growth; the dense run's by about the parameters' growth × 4 bytes."""
    sys.path.insert(0, str(ROOT / "tools"))
    from synth_qwen35 import write_checkpoint

    sizes = {}
    for layers in (4, 12):
        src = write_checkpoint(tmp_path / f"hf{layers}", n_layers=layers, hidden_size=512, intermediate_size=2048,
                               vocab_size=8192)
        sizes[layers] = convert_gguf(src, tmp_path / f"m{layers}.gguf", outtype="q8_0", mtp="none")
    file_growth = sizes[12].stat().st_size - sizes[4].stat().st_size
    params_growth = file_growth / (34 / 32)  # q8_0: 34 bytes per 32 values
    stored = {k: _peak_rss(p, tmp_path)["peak_rss_bytes"] for k, p in sizes.items()}
    dense = {k: _peak_rss(p, tmp_path, "--weights", "dense")["peak_rss_bytes"] for k, p in sizes.items()}
    grow_stored, grow_dense = stored[12] - stored[4], dense[12] - dense[4]
    print(f"\n[memory] file growth {file_growth / 1e6:.0f} MB; peak RSS growth stored {grow_stored / 1e6:.0f} MB "
          f"({grow_stored / file_growth:.2f}x), dense {grow_dense / 1e6:.0f} MB ({grow_dense / file_growth:.2f}x)")
    assert grow_stored <= 1.2 * file_growth + 50e6  # the bound: 1.2 x the file + a constant
    assert grow_dense >= 0.8 * 4 * params_growth
