"""Shared helpers of the runtime tests (no tests here): GGUF files of the tiny fixtures, devices,
and transformers' own token-by-token decoding as the reference for our token-by-token decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specconv.runtime.device import available_devices
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.hf_reference import load_hf
from tests.fixtures.tiny_qwen35 import build_qwen35
from tests.fixtures.tiny_tools import logits_token_by_token

DEVICES = [pytest.param(d, id=d) for d in ("cpu", "cuda")]
N_POSITIONS = 64


def skip_unless_device(device: str):
    if device not in available_devices():
        pytest.skip(f"no {device} device here")


def prompt_ids(n: int = N_POSITIONS, seed: int = 0) -> np.ndarray:
    """Token ids drawn over the whole vocabulary of the tiny models (special ids excluded)."""
    return np.random.default_rng(seed).integers(0, 509, n)


_files: dict[tuple, object] = {}


def tiny_gguf(tmp_path_factory, *, moe=False, layout="save_pretrained", mtp="embed", outtype="f32", **build):
    """(checkpoint dir, GGUF path(s)) of a tiny Qwen3.5 converted by `specconv convert`, cached per session.

    mtp="separate" returns (trunk, sidecar) paths.
    """
    key = (moe, layout, mtp, outtype, repr(sorted(build.items())))  # repr: build may hold a dict (text_over)
    if key not in _files:
        root = tmp_path_factory.mktemp("rt-" + "-".join(str(k) for k in key[:4]))
        src = build_qwen35(root / "hf", moe=moe, layout=layout, **build)
        out = root / "gguf"
        out.mkdir()
        if mtp == "separate":
            convert_gguf(src, out / "model.gguf", outtype=outtype, mtp="separate")
            sidecars = sorted(out.glob("mtp-*.gguf"))
            trunks = sorted(p for p in out.glob("*.gguf") if not p.name.startswith("mtp-"))
            assert len(sidecars) == 1 and len(trunks) == 1, sorted(out.iterdir())
            _files[key] = (src, (trunks[0], sidecars[0]))
        else:
            _files[key] = (src, convert_gguf(src, out / "model.gguf", outtype=outtype, mtp=mtp))
    return _files[key]


def hf_logits_token_by_token(model_dir, ids) -> np.ndarray:
    """transformers' cached decoding, one token per forward (its recurrent Gated DeltaNet path)."""
    return logits_token_by_token(load_hf(model_dir)[0], ids)


def max_abs(a, b) -> float:
    a = a.detach().cpu().double().numpy() if torch.is_tensor(a) else np.asarray(a, np.float64)
    b = b.detach().cpu().double().numpy() if torch.is_tensor(b) else np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def parity(ours, reference, floor: float, tol: float = 1e-4) -> tuple[float, float]:
    """(max |Δ|, 95th percentile of the per-row max |Δ|) and the assertion of the parity tests:
    the 95th percentile within `tol`, and the maximum within max(tol, 2·floor), where `floor` is the
    reference's own float32 irreproducibility (e.g. transformers batched vs cached) on this input."""
    a = ours.detach().cpu().double().numpy() if torch.is_tensor(ours) else np.asarray(ours, np.float64)
    b = np.asarray(reference, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    per_row = np.abs(a - b).reshape(a.shape[0], -1).max(-1)
    worst, p95 = float(per_row.max()), float(np.percentile(per_row, 95))
    assert p95 <= tol, f"95% of rows should be within {tol}: p95 = {p95:.2e}"
    assert worst <= max(tol, 2 * floor), f"max {worst:.2e} > max({tol}, 2 x reference noise {floor:.2e})"
    return worst, p95
