"""`specconv mtp` against llama.cpp's own converter and runtime (the independent references).

The tiny Qwen3.5 checkpoint (tests/fixtures/tiny_qwen35.py) is converted by the upstream
`convert_hf_to_gguf.py` of the pinned llama.cpp tree in its three MTP modes (embedded, `--no-mtp`,
`--mtp`), in f32 and q8_0. Those files are what third-party quants and sidecars look like, so:

* extract(embedded) must be the upstream `--mtp` sidecar, byte for byte (also with --outtype q8_0);
* merge(upstream trunk-only, sidecar) must be the upstream embedded file, byte for byte (also onto a
  q8_0 trunk, and with the head re-typed to q8_0 by an override);
* the grafted file must load in llama.cpp, create an MTP context and give the MTP logits of the
  transformers reference (MtpModel), printed as max |Δlogit|.

The upstream converter lives in the llama-cpp-python sdist (peers.md §1.1); the test skips when that
tree is not on the machine (set SPECCONV_LLAMA_CPP_TREE to its vendor/llama.cpp folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specconv.cli import main as cli_main
from tests.fixtures import peers

pytestmark = pytest.mark.slow

TREE = Path(os.environ.get("SPECCONV_LLAMA_CPP_TREE",
                           "/work/.cache/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"))
IDS = [5, 17, 42, 99, 3, 250, 7, 77, 301, 12, 64, 128]

# Runs the upstream converter (one process per file: its mode flags leave state behind). Tiny
# self-trained tokenizers have no known pre-tokenizer hash, so the name is forced (peers.md §1.4).
_DRIVER = r"""
import runpy, sys
tree = sys.argv[1]
sys.path.insert(0, tree); sys.path.insert(1, tree + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    if not (TREE / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp source tree not found at {TREE} (set SPECCONV_LLAMA_CPP_TREE)")
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("upstream")
    src = build_qwen35(root / "src")
    modes = {"embedded": [], "trunk": ["--no-mtp"], "sidecar": ["--mtp"]}
    files, jobs = {}, []
    for outtype in ("f32", "q8_0"):
        for mode, flags in modes.items():
            path = root / f"{mode}-{outtype}.gguf"
            files[(mode, outtype)] = path
            jobs.append([str(src), "--outfile", str(path), "--outtype", outtype, *flags])
    for argv in jobs:
        proc = subprocess.run([sys.executable, "-c", _DRIVER, str(TREE), *argv], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return src, root, files


def mtp(*args) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["mtp", *map(str, args)])
        raise SystemExit(0)
    assert exc.value.code == 0


# --- byte identity with the upstream converter's layouts ----------------------------------------

@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_extract_is_the_upstream_sidecar(upstream, outtype):
    _, root, files = upstream
    out = root / f"mtp-extracted-{outtype}.gguf"
    mtp("extract", files[("embedded", outtype)], "-o", out, "--force")
    assert out.read_bytes() == files[("sidecar", outtype)].read_bytes()


def test_extract_outtype_q8_0_from_f32_is_the_upstream_q8_0_sidecar(upstream):
    _, root, files = upstream
    out = root / "mtp-requantized.gguf"
    mtp("extract", files[("embedded", "f32")], "-o", out, "--outtype", "q8_0", "--force")
    assert out.read_bytes() == files[("sidecar", "q8_0")].read_bytes()


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_merge_rebuilds_the_upstream_embedded_file(upstream, outtype):
    _, root, files = upstream
    side = root / f"mtp-x-{outtype}.gguf"
    mtp("extract", files[("embedded", outtype)], "-o", side, "--force")
    out = root / f"merged-{outtype}.gguf"
    mtp("merge", files[("trunk", outtype)], side, "-o", out, "--force")
    assert out.read_bytes() == files[("embedded", outtype)].read_bytes()


def test_q8_0_head_override_on_q8_0_trunk_is_the_upstream_q8_0_file(upstream):
    # An f32 sidecar grafted onto a q8_0 trunk with the head re-typed to q8_0: the same bytes as
    # upstream's q8_0 conversion (norms stay F32 by the forced rule, as upstream keeps them).
    _, root, files = upstream
    out = root / "merged-q8-override.gguf"
    mtp("merge", files[("trunk", "q8_0")], files[("sidecar", "f32")], "-o", out, "--type-override", ".=q8_0",
        "--force")
    assert out.read_bytes() == files[("embedded", "q8_0")].read_bytes()


# --- llama.cpp runs what we graft -----------------------------------------------------------------

def _mtp_reference(src, hidden):
    from tests.fixtures.hf_reference import hf_mtp_logits_llamacpp_rows

    return hf_mtp_logits_llamacpp_rows(src, IDS, hidden=hidden)


def test_grafted_f32_file_runs_mtp_in_llama_cpp(upstream):
    peers.require_llama_cpp()
    src, root, files = upstream
    out = root / "graft-f32.gguf"
    mtp("merge", files[("trunk", "f32")], files[("sidecar", "f32")], "-o", out, "--force")
    assert peers.llama_mtp_context_ok(out)
    logits, hidden, _ = peers.llama_mtp_logits(out, IDS, return_hidden=True)
    diff = np.abs(logits - _mtp_reference(src, hidden)).max()
    print(f"grafted f32 file, llama.cpp MTP logits vs transformers MtpModel: max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


def test_extracted_sidecar_runs_beside_the_trunk_in_llama_cpp(upstream):
    peers.require_llama_cpp()
    src, root, files = upstream
    side = root / "mtp-side-f32.gguf"
    mtp("extract", files[("embedded", "f32")], "-o", side, "--force")
    assert peers.llama_mtp_context_ok(files[("trunk", "f32")], side)
    logits, hidden, _ = peers.llama_mtp_logits(files[("trunk", "f32")], IDS, side, return_hidden=True)
    diff = np.abs(logits - _mtp_reference(src, hidden)).max()
    print(f"extracted sidecar + trunk, llama.cpp MTP logits vs transformers: max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


def test_graft_onto_q8_0_trunk_runs_in_llama_cpp(upstream):
    peers.require_llama_cpp()
    src, root, files = upstream
    out = root / "graft-q8-trunk.gguf"
    mtp("merge", files[("trunk", "q8_0")], files[("sidecar", "f32")], "-o", out, "--force")
    # The trunk is untouched: its logits are those of the q8_0 trunk-only file, exactly.
    trunk_diff = np.abs(peers.llama_logits(out, IDS) - peers.llama_logits(files[("trunk", "q8_0")], IDS)).max()
    print(f"q8_0 trunk logits, grafted vs trunk-only file: max |dlogit| = {trunk_diff:.2e}")
    assert trunk_diff == 0
    assert peers.llama_mtp_context_ok(out)
    logits, hidden, _ = peers.llama_mtp_logits(out, IDS, return_hidden=True)
    # The head shares the trunk's q8_0 token_embd and output: the reference gets the same values.
    # What remains is llama.cpp's CPU q8_0 matmul quantizing its activations (the LM head input) to
    # q8_0 as well, so agreement is to ~1e-2, not 1e-5; the byte tests above prove the head exact.
    ref_dir = _with_trunk_embeddings(src, files[("trunk", "q8_0")], root / "src-q8-embeddings")
    ref = _mtp_reference(ref_dir, hidden)
    diff = np.abs(logits - ref).max()
    print(f"f32 head on q8_0 trunk, llama.cpp MTP logits vs transformers (q8_0 tables): max |dlogit| = {diff:.2e}"
          f" (logit std {ref.std():.2f})")
    assert diff < 0.1
    assert (logits.argmax(-1) == ref.argmax(-1)).all()


def _with_trunk_embeddings(src: Path, gguf_path: Path, out_dir: Path) -> Path:
    """A copy of the checkpoint whose embedding and LM head are the GGUF's (dequantized) tables."""
    import shutil

    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file

    if out_dir.exists():
        return out_dir
    shutil.copytree(src, out_dir)
    tables = {t.name: dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
              for t in GGUFReader(gguf_path).tensors if t.name in ("token_embd.weight", "output.weight")}
    weights = load_file(out_dir / "model.safetensors")
    weights["model.embed_tokens.weight"] = torch.from_numpy(tables["token_embd.weight"].copy())
    weights["lm_head.weight"] = torch.from_numpy(tables["output.weight"].copy())
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
