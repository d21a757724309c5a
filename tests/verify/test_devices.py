"""Every tensor verify's transformers checks build is built on a named device, never torch's default one.

On a GPU the reference sits on `cuda` while the CPU is torch's default device, so a tensor built
without `device=` (token ids, positions, a zero row) meets the reference's weights on another device
(`specconv demo` stopped with "index is on cpu, different from other tensors on cuda:0" in
`mtp_parity`). Without a GPU the same mistake shows by making the default device `meta`: the
reference and the runtime stay on the CPU, and a tensor built on the default device is a meta tensor
that no CPU weight can be used with. Loading (the reference, its MTP layers and blocks, the drafters'
own references) and the runtime's calls run on the CPU; everything `run_hf_checks` computes between
them runs under the meta default: the trunk and MTP parity (qwen35), chained MTP blocks (mimo2), an
EAGLE-3 head against its checkpoint (Llama target) and a DFlash drafter against its checkpoint (Qwen3
target). The same checks pass, so nothing in them depends on where torch puts an unplaced tensor.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specconv.runtime import Context
from specconv.runtime.drafters.dflash import DFlashDrafter
from specconv.verify import VerifyOptions, chained_mtp, dflash_reference, eagle3_reference, parity, run
from tests.fixtures.gguf_files import convert_gguf


def _on_cpu(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.device("cpu"):
            return fn(*args, **kwargs)

    return call


@pytest.fixture
def meta_default(monkeypatch):
    """run_hf_checks under a meta default device; loading and the runtime on the CPU. Returns the
    checks that ran that way."""
    for owner, name in ((parity, "load_reference"), (parity, "load_mtp_reference"), (chained_mtp, "load_blocks"),
                        (chained_mtp, "block_view"), (Context, "decode"), (Context, "encode"),
                        (DFlashDrafter, "__init__"), (DFlashDrafter, "start"), (DFlashDrafter, "block_logits"),
                        (eagle3_reference.Eagle3Reference, "__init__"), (dflash_reference.DFlashReference, "__init__")):
        monkeypatch.setattr(owner, name, _on_cpu(getattr(owner, name)))
    ran = []
    real = run.run_hf_checks

    def hf_checks_on_meta(report, *args, **kwargs):
        before = len(report.checks)
        with torch.device("meta"):
            real(report, *args, **kwargs)
        ran.extend(report.checks[before:])

    monkeypatch.setattr(run, "run_hf_checks", hf_checks_on_meta)
    return ran


def _verify(**options):
    report = run.run_verify(VerifyOptions(n_predict=2, draft_max=2, device="cpu", **options))
    return report, {c.name: c for c in report.checks}


def _assert_ran(ran, report, *names):
    print("\n".join(f"{c.name}: {c.passed} {c.detail[:120]}" for c in ran))
    failed = [c for c in report.checks if not c.passed]
    assert report.passed, failed
    assert {n for n in names} <= {c.name for c in ran}, [c.name for c in ran]


def test_trunk_and_mtp_parity_build_their_tensors_on_the_reference_device(meta_default, tmp_path):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    src = build_qwen35(tmp_path / "hf")
    report, _ = _verify(model=convert_gguf(src, tmp_path / "q.gguf"), hf=src)
    _assert_ran(meta_default, report, "parity: trunk logits vs transformers", "parity: MTP head vs transformers MtpModel")


def test_chained_mtp_blocks_build_their_tensors_on_the_reference_device(meta_default, tmp_path):
    from tests.fixtures.tiny_chained import build_tiny

    src = build_tiny(tmp_path / "hf", "mimo2")
    report, _ = _verify(model=convert_gguf(src, tmp_path / "m.gguf"), hf=src)
    _assert_ran(meta_default, report, "parity: MTP block 0 vs transformers", "parity: MTP block 2 vs transformers")


def test_eagle3_head_check_builds_its_tensors_on_the_reference_device(meta_default, tmp_path):
    from tests.fixtures.tiny_eagle3 import build_eagle3_head, build_llama_target

    target = build_llama_target(tmp_path / "llama", n_layers=8)
    head = build_eagle3_head(tmp_path / "head", target, layout="speculators", layer_ids=[1, 4, 6], seed=5)
    report, _ = _verify(model=convert_gguf(target, tmp_path / "t.gguf"), hf=target, draft_hf=head,
                        draft=convert_gguf(head, tmp_path / "h.gguf", extra_args=["--target", str(target)]))
    _assert_ran(meta_default, report, "parity: trunk logits vs transformers", "parity: EAGLE-3 head vs its checkpoint")


def test_dflash_check_builds_its_tensors_on_the_reference_device(meta_default, tmp_path):
    from tests.fixtures import tiny_dflash

    t_dir, t_gguf, d_dir, d_gguf = tiny_dflash.built(tmp_path, "qwen3")
    report, _ = _verify(model=t_gguf, hf=t_dir, draft=d_gguf, draft_hf=d_dir)
    _assert_ran(meta_default, report, "parity: trunk logits vs transformers", "parity: DFlash drafter vs its checkpoint")
