"""`specconv mtp` on files written by a converter, run by llama.cpp and by our runtime.

The tiny Qwen3.5 checkpoint (tests/fixtures/tiny_qwen35.py) is converted in the three MTP layouts
(embedded, trunk-only, `mtp-` sidecar), in f32 and q8_0, by two independent writers: llama.cpp's own
`convert_hf_to_gguf.py` (what third-party quants and sidecars look like; needs SPECCONV_LLAMA_CPP_SRC)
and `specconv convert`. For each writer:

* extract(embedded) is that converter's sidecar, byte for byte (also with --outtype q8_0 from f32);
* merge(trunk-only, sidecar) is that converter's embedded file, byte for byte (also onto a q8_0 trunk,
  and with an f32 head re-typed to q8_0 by an override);
* the grafted file loads in llama.cpp, creates an MTP context and gives the MTP logits of the
  transformers reference (MtpModel); our runtime gives the same MTP logits from the grafted file as
  from the trunk + sidecar pair. Measured max |Δlogit| values are printed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specconv.cli import main as cli_main
from tests.fixtures import peers

pytestmark = pytest.mark.slow

IDS = [5, 17, 42, 99, 3, 250, 7, 77, 301, 12, 64, 128]
MODES = {"embedded": ("embed", []), "trunk": ("none", ["--no-mtp"]), "sidecar": ("only", ["--mtp"])}


def _convert_all(writer, root, *, moe=False, outtypes=("f32", "q8_0")):
    from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream
    from tests.fixtures.tiny_qwen35 import build_qwen35

    src = build_qwen35(root / "src", moe=moe)
    files = {}
    for outtype in outtypes:
        for mode, (ours, theirs) in MODES.items():
            path = root / f"{mode}-{outtype}.gguf"
            if writer == "upstream":
                files[(mode, outtype)] = convert_gguf_upstream(src, path, outtype=outtype, extra_args=theirs)
            else:
                convert_gguf(src, path, outtype=outtype, mtp=ours)
                # `specconv convert --mtp only -o DIR/NAME.gguf` may name its sidecar DIR/mtp-NAME.gguf
                prefixed = path.with_name("mtp-" + path.name)
                files[(mode, outtype)] = path if path.exists() or not prefixed.exists() else prefixed
    return src, root, files


@pytest.fixture(scope="module", params=["upstream", "specconv"])
def converted(request, tmp_path_factory):
    """(checkpoint dir, work dir, {(mode, outtype): path}) of the dense model from one converter.

    "upstream": llama.cpp's convert_hf_to_gguf.py (skips unless SPECCONV_LLAMA_CPP_SRC is set);
    "specconv": `specconv convert` (skips until the command is registered).
    """
    return _convert_all(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=["upstream", "specconv"])
def converted_moe(request, tmp_path_factory):
    """The same for the Qwen3.5-MoE fixture (f32 only)."""
    return _convert_all(request.param, tmp_path_factory.mktemp(request.param + "-moe"), moe=True, outtypes=("f32",))


def mtp(*args) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["mtp", *map(str, args)])
        raise SystemExit(0)
    assert exc.value.code == 0


# --- byte identity with the converter's own layouts ------------------------------------------------

@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_extract_is_the_converters_sidecar(converted, outtype):
    _, root, files = converted
    out = root / f"mtp-extracted-{outtype}.gguf"
    mtp("extract", files[("embedded", outtype)], "-o", out, "--force")
    assert out.read_bytes() == files[("sidecar", outtype)].read_bytes()


def test_extract_outtype_q8_0_from_f32_is_the_q8_0_sidecar(converted):
    _, root, files = converted
    out = root / "mtp-requantized.gguf"
    mtp("extract", files[("embedded", "f32")], "-o", out, "--outtype", "q8_0", "--force")
    assert out.read_bytes() == files[("sidecar", "q8_0")].read_bytes()


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_merge_rebuilds_the_embedded_file(converted, outtype):
    _, root, files = converted
    side = root / f"mtp-x-{outtype}.gguf"
    mtp("extract", files[("embedded", outtype)], "-o", side, "--force")
    out = root / f"merged-{outtype}.gguf"
    mtp("merge", files[("trunk", outtype)], side, "-o", out, "--force")
    assert out.read_bytes() == files[("embedded", outtype)].read_bytes()


def test_q8_0_head_override_on_q8_0_trunk_is_the_q8_0_file(converted):
    # An f32 sidecar grafted onto a q8_0 trunk with the head re-typed to q8_0: the same bytes as the
    # converter's q8_0 embedded file (norms stay F32 by the forced rule, as converters keep them).
    _, root, files = converted
    out = root / "merged-q8-override.gguf"
    mtp("merge", files[("trunk", "q8_0")], files[("sidecar", "f32")], "-o", out, "--type-override", ".=q8_0",
        "--force")
    assert out.read_bytes() == files[("embedded", "q8_0")].read_bytes()


# --- llama.cpp runs what we graft -----------------------------------------------------------------

def _mtp_reference(src, hidden):
    from tests.fixtures.hf_reference import hf_mtp_logits_llamacpp_rows

    return hf_mtp_logits_llamacpp_rows(src, IDS, hidden=hidden)


def test_grafted_f32_file_runs_mtp_in_llama_cpp(converted):
    peers.require_llama_cpp()
    src, root, files = converted
    out = root / "graft-f32.gguf"
    mtp("merge", files[("trunk", "f32")], files[("sidecar", "f32")], "-o", out, "--force")
    assert peers.llama_mtp_context_ok(out)
    logits, hidden, _ = peers.llama_mtp_logits(out, IDS, return_hidden=True)
    diff = np.abs(logits - _mtp_reference(src, hidden)).max()
    print(f"grafted f32 file, llama.cpp MTP logits vs transformers MtpModel: max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


def test_extracted_sidecar_runs_beside_the_trunk_in_llama_cpp(converted):
    peers.require_llama_cpp()
    src, root, files = converted
    side = root / "mtp-side-f32.gguf"
    mtp("extract", files[("embedded", "f32")], "-o", side, "--force")
    assert peers.llama_mtp_context_ok(files[("trunk", "f32")], side)
    logits, hidden, _ = peers.llama_mtp_logits(files[("trunk", "f32")], IDS, side, return_hidden=True)
    diff = np.abs(logits - _mtp_reference(src, hidden)).max()
    print(f"extracted sidecar + trunk, llama.cpp MTP logits vs transformers: max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


def test_graft_onto_q8_0_trunk_runs_in_llama_cpp(converted):
    peers.require_llama_cpp()
    src, root, files = converted
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


# --- our runtime --------------------------------------------------------------------------------

def _runtime_mtp_logits(target_path, mtp_path=None):
    """(MTP logits, target post-norm hidden) from specconv.runtime, llama.cpp's row convention."""
    from specconv.runtime import Context, GraphType, load_model
    from specconv.runtime.mtp_rows import mtp_rows

    target = load_model(target_path, device="cpu")
    head = target if mtp_path is None else load_model(mtp_path, device="cpu")
    h = Context(target, GraphType.MAIN, n_ctx=len(IDS)).decode(IDS).hidden["post_norm"]
    toks, rows, pos = mtp_rows(IDS, h, "llama.cpp")
    logits = Context(head, GraphType.MTP, n_ctx=len(IDS)).decode(toks, pos, hidden_in=rows).logits
    return logits.float().cpu().numpy(), h.float().cpu().numpy()


def test_runtime_mtp_logits_unchanged_by_grafting(converted):
    src, root, files = converted
    side = root / "mtp-rt.gguf"
    mtp("extract", files[("embedded", "f32")], "-o", side, "--force")
    out = root / "graft-rt.gguf"
    mtp("merge", files[("trunk", "f32")], side, "-o", out, "--force")
    grafted, h = _runtime_mtp_logits(out)
    pair, _ = _runtime_mtp_logits(files[("trunk", "f32")], side)
    original, _ = _runtime_mtp_logits(files[("embedded", "f32")])
    vs_ref = np.abs(grafted - _mtp_reference(src, h)).max()
    print(f"runtime MTP logits: grafted vs original embedded {np.abs(grafted - original).max():.2e}, "
          f"vs trunk + extracted sidecar {np.abs(grafted - pair).max():.2e}, vs transformers {vs_ref:.2e}")
    assert np.array_equal(grafted, original)
    assert np.abs(grafted - pair).max() < 1e-5
    assert vs_ref < 1e-4


def test_runtime_runs_head_grafted_onto_q8_0_trunk(converted):
    # The runtime dequantizes to float32 and so has no activation rounding: with the same q8_0
    # embedding / LM head tables, the grafted f32 head must match transformers to float32 noise.
    src, root, files = converted
    out = root / "graft-q8-rt.gguf"
    mtp("merge", files[("trunk", "q8_0")], files[("sidecar", "f32")], "-o", out, "--force")
    logits, h = _runtime_mtp_logits(out)
    ref_dir = _with_trunk_embeddings(src, files[("trunk", "q8_0")], root / "src-q8-embeddings")
    diff = np.abs(logits - _mtp_reference(ref_dir, h)).max()
    print(f"runtime, f32 head on q8_0 trunk vs transformers (q8_0 tables): max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


# --- MoE (qwen35moe) ------------------------------------------------------------------------------

def test_moe_round_trip_and_llama_cpp_mtp(converted_moe):
    src, root, files = converted_moe
    side = root / "mtp-moe-x.gguf"
    mtp("extract", files[("embedded", "f32")], "-o", side, "--force")
    assert side.read_bytes() == files[("sidecar", "f32")].read_bytes()
    out = root / "moe-merged.gguf"
    mtp("merge", files[("trunk", "f32")], side, "-o", out, "--force")
    assert out.read_bytes() == files[("embedded", "f32")].read_bytes()
    peers.require_llama_cpp()
    assert peers.llama_mtp_context_ok(out)
    logits, hidden, _ = peers.llama_mtp_logits(out, IDS, return_hidden=True)
    diff = np.abs(logits - _mtp_reference(src, hidden)).max()
    print(f"qwen35moe grafted file, llama.cpp MTP logits vs transformers: max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


# --- specconv verify ----------------------------------------------------------------------------

VERIFY_FAST = ["-n", "6", "--draft-max", "2", "--device", "cpu"]


def _verify(root: Path, *args) -> tuple[int, dict]:
    import json

    prompts = root / "prompts.txt"
    prompts.write_text("def f(x):\\n    return x\nimport os\n")
    report = root / "verify-report.json"
    with pytest.raises(SystemExit) as exc:
        cli_main(["verify", *map(str, args), "--prompts", str(prompts), "--report", str(report), *VERIFY_FAST])
    return exc.value.code, json.loads(report.read_text())


def _once(root: Path) -> None:
    if not root.name.startswith("specconv"):
        pytest.skip("verify runs once per session, on the specconv-converted files")


def test_verify_passes_head_grafted_onto_q8_0_trunk(converted):
    # No --hf: a q8_0 trunk is not expected to match the f32 checkpoint to parity tolerance; the
    # structure, greedy exactness of MTP speculation and the statistics checks must all pass.
    src, root, files = converted
    _once(root)
    out = root / "graft-q8-verify.gguf"
    mtp("merge", files[("trunk", "q8_0")], files[("sidecar", "f32")], "-o", out, "--force")
    code, report = _verify(root, out)
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}
    print(f"verify on the q8_0 graft: exit {code}, {len(report['checks'])} checks, failed {failed}")
    assert code == 0 and report["passed"] and not failed
    assert report["speculative"]["exact"] is True


def test_verify_with_parity_passes_f32_graft_and_extracted_sidecar(converted):
    src, root, files = converted
    _once(root)
    side = root / "mtp-verify.gguf"
    mtp("extract", files[("embedded", "f32")], "-o", side, "--force")
    out = root / "graft-f32-verify.gguf"
    mtp("merge", files[("trunk", "f32")], side, "-o", out, "--force")
    for args in ((out,), (files[("trunk", "f32")], "--mtp", side)):
        code, report = _verify(root, *args, "--hf", src)
        print(f"verify {' '.join(Path(str(a)).name for a in args)} --hf: exit {code}, "
              f"parity {report['parity']['max_abs_logit_diff']:.2e}")
        assert code == 0 and report["passed"], [c for c in report["checks"] if not c["passed"]]
