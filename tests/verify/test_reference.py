"""The transformers reference of `verify --hf` at release size: accelerate's device map with disk offload
(forced here on a tiny model by a small max_memory) gives the logits of a plain load, and verify runs on
it; the reference dtype and the parity tolerance follow the compute dtype (docs/verify.md)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from specconv.verify import VerifyOptions, parity, run_verify
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_eagle3 import build_llama_target

PROMPT = [5, 17, 200, 33, 4, 99, 7, 8, 120, 64]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("vref")
    target = build_llama_target(root / "llama8", n_layers=8)
    gguf = convert_gguf(target, root / "target.gguf")
    swapped = shutil.copy(gguf, root / "swapped.gguf")
    reader = GGUFReader(swapped, "r+")
    t = {x.name: x for x in reader.tensors}
    a, b = t["blk.0.ffn_up.weight"].data, t["blk.1.ffn_up.weight"].data
    a_copy = np.array(a)
    a[...], b[...] = b, a_copy
    del reader
    return root, target, gguf, swapped


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_offloaded_reference_equals_the_plain_load(llama):
    import transformers

    _, target, _, _ = llama
    plain = transformers.LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        want = plain(torch.tensor([PROMPT]), output_hidden_states=True)
    with parity.reference_model(target, "llama", torch.float32, max_memory={"cpu": _bytes(plain) // 3}) as (model, bad):
        placed = model.hf_device_map
        with torch.no_grad():
            got = model(torch.tensor([PROMPT], device=parity.input_device(model)), output_hidden_states=True)
    print(f"\ndevice map with max_memory 1/3 of the weights: {placed}")
    assert not bad
    assert "disk" in placed.values() and "cpu" in placed.values()
    assert torch.equal(got.logits, want.logits)
    assert all(torch.equal(x, y) for x, y in zip(got.hidden_states, want.hidden_states))


def test_verify_runs_on_an_offloaded_reference(llama, tmp_path):
    _, target, gguf, _ = llama

    def run(max_memory):
        return run_verify(VerifyOptions(model=gguf, hf=target, prompts=["The quick brown fox jumps"], n_predict=2,
                                        draft_max=1, device="cpu", hf_max_memory=max_memory))

    free, offloaded = run(None), run({"cpu": 400_000})
    detail = next(c.detail for c in offloaded.checks if c.name == "parity: transformers reference loads")
    print(f"\noffloaded reference: {detail}; trunk parity {offloaded.parity['trunk']:.2e}")
    assert offloaded.passed and "disk" in detail
    assert offloaded.parity["trunk"] == free.parity["trunk"] < 1e-4


@pytest.mark.parametrize("dtype,ref", [("f32", "float32"), ("bf16", "bfloat16"), ("f16", "bfloat16")])
def test_reference_dtype_and_tolerance_follow_the_compute_dtype(llama, dtype, ref):
    _, target, gguf, swapped = llama

    def run(model):
        rep = run_verify(VerifyOptions(model=model, hf=target, prompts=["The quick brown fox jumps"], n_predict=2,
                                       draft_max=1, device="cpu", dtype=dtype))
        return rep, {c.name: c for c in rep.checks}

    rep, checks = run(gguf)
    p = rep.parity
    print(f"\n{dtype}: reference {p['reference_dtype']}, {p['criterion']} ≤ {p['tolerance']}: max |Δ| {p['trunk']:.2e}, "
          f"relative RMS {p['trunk_rel_rms']:.3f}")
    assert p["reference_dtype"] == ref and rep.settings["dtype"] == {"f32": "float32", "bf16": "bfloat16",
                                                                        "f16": "float16"}[dtype]
    assert (p["criterion"], p["tolerance"]) == (("max_abs", 2e-3) if dtype == "f32" else ("rel_rms", 0.1))
    assert checks["parity: trunk logits vs transformers"].passed
    bad, checks = run(swapped)
    print(f"{dtype}, blk.0/1 ffn_up swapped: relative RMS {bad.parity['trunk_rel_rms']:.3f}")
    assert not checks["parity: trunk logits vs transformers"].passed


def test_offloaded_reference_with_an_mtp_head():
    """Qwen3.5 with its MTP head: transformers' MtpModel built on the offloaded trunk gives the same parity."""
    from pathlib import Path

    from tests.fixtures import speculative_models

    def run(max_memory):
        return run_verify(VerifyOptions(model=Path(speculative_models.gguf("embedded")),
                                        hf=Path(speculative_models.checkpoint()), prompts=["def f(x):\n    return x"],
                                        n_predict=2, draft_max=1, device="cpu", hf_max_memory=max_memory))

    free, offloaded = run(None), run({"cpu": 300_000})
    detail = next(c.detail for c in offloaded.checks if c.name == "parity: transformers reference loads")
    print(f"\nQwen3.5 + MTP, offloaded reference: {detail}; trunk {offloaded.parity['trunk']:.2e}, "
          f"MTP {offloaded.parity['mtp']:.2e}")
    assert offloaded.passed and "disk" in detail
    assert (offloaded.parity["trunk"], offloaded.parity["mtp"]) == (free.parity["trunk"], free.parity["mtp"])
