"""Shared helpers of the runtime tests (no tests here): GGUF files of the tiny fixtures, devices,
transformers' own token-by-token decoding as the reference for our token-by-token decoding, and the
parity rule of each compute dtype (`dtype_parity`)."""

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
# (device, compute dtype): each device's default (float32 on the CPU, bfloat16 on CUDA), and bfloat16
# on the CPU, so that the CUDA default's rule is checked where every machine can run it
DEVICE_DTYPES = [pytest.param(d, None, id=d) for d in ("cpu", "cuda")] + [pytest.param("cpu", "bf16", id="cpu-bf16")]
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


def hf_logits_token_by_token(model_dir, ids, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """transformers' cached decoding, one token per forward (its recurrent Gated DeltaNet path)."""
    return logits_token_by_token(load_hf(model_dir, dtype=dtype)[0], ids)


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


# A model computed in a 16-bit float is held to the rounding of that dtype, measured: transformers
# itself in the same dtype, on the same input and weights, against its float32 self. Our per-row
# max |Δ| from transformers' float32 result may be LOW_PRECISION_MULTIPLE times transformers' own,
# at the 95th percentile and at the maximum. Both round every weight and activation to the dtype but
# in different places (our reductions, norms and recurrent state stay in float32), hence a multiple
# above 1; measured on the tiny Qwen3.5 models in bfloat16, ours / transformers' is 0.6-1.7.
LOW_PRECISION_MULTIPLE = 2.0


def _values(x) -> np.ndarray:
    return x.detach().cpu().double().numpy() if torch.is_tensor(x) else np.asarray(x, np.float64)


def row_errors(ours, reference) -> np.ndarray:
    """Per-row max |Δ| over everything but the first dimension."""
    a, b = _values(ours), _values(reference)
    assert a.shape == b.shape, (a.shape, b.shape)
    return np.abs(a - b).reshape(a.shape[0], -1).max(-1)


def dtype_parity(label: str, dtype: torch.dtype, ours, reference, *, floor: float = 0.0, low=None,
                 tol: float = 1e-4) -> tuple[float, float]:
    """The parity assertion of the compute dtype `dtype`, its figures printed; returns (max, p95) of
    the per-row max |Δ| of `ours` from `reference` (transformers' float32 result).

    float32 / float64: `parity` (95 % of rows within `tol`, the worst within max(tol, 2 x floor)).
    A 16-bit float: `low()` is transformers' own result in `dtype` for the same rows; ours may be
    LOW_PRECISION_MULTIPLE times its p95 and its max from `reference`."""
    if dtype in (torch.float32, torch.float64):
        worst, p95 = parity(ours, reference, floor, tol)
        print(f"[{label}] {str(dtype).removeprefix('torch.')}: max|Δ| {worst:.2e}, p95 {p95:.2e} "
              f"(bound p95 {tol:.0e}, max {max(tol, 2 * floor):.1e})")
        return worst, p95
    assert low is not None, f"{label}: computed in {dtype}, the rule needs transformers' own {dtype} result"
    ours_rows, noise_rows = row_errors(ours, reference), row_errors(low(), reference)
    worst, p95 = float(ours_rows.max()), float(np.percentile(ours_rows, 95))
    noise_max, noise_p95 = float(noise_rows.max()), float(np.percentile(noise_rows, 95))
    k = LOW_PRECISION_MULTIPLE
    print(f"[{label}] {str(dtype).removeprefix('torch.')}: ours vs transformers float32 max|Δ| {worst:.3f}, "
          f"p95 {p95:.3f}; transformers' own {str(dtype).removeprefix('torch.')} noise max {noise_max:.3f}, "
          f"p95 {noise_p95:.3f}; bound {k:g}x: max {k * noise_max:.3f}, p95 {k * noise_p95:.3f}")
    assert p95 <= k * noise_p95, f"{label}: p95 {p95:.3f} > {k:g} x transformers' own {dtype} p95 {noise_p95:.3f}"
    assert worst <= k * noise_max, f"{label}: max {worst:.3f} > {k:g} x transformers' own {dtype} max {noise_max:.3f}"
    return worst, p95
