"""The qwen35 plugin against llama.cpp's own converter (an independent writer of the same layout).

The pinned upstream `convert_hf_to_gguf.py` (from the llama-cpp-python 0.3.36 sdist) converts the
tiny fixture checkpoints with `--outtype f16`; the plugin's plan must give the same tensor names,
shapes, values (after the same f16 rounding), the same set of tensors kept in F32, and the same
architecture KV. Skips when the source tree is absent (SPECCONV_LLAMA_CPP_SRC names it).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from tests.fixtures import gguf_files
from tests.fixtures.qwen35_synth import plugin_from_dir
from tests.fixtures.tiny_qwen35 import build_qwen35

DEFAULT_TREE = Path("/work/.cache/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")


@pytest.fixture(autouse=True)
def _upstream_tree(monkeypatch):
    if not os.environ.get("SPECCONV_LLAMA_CPP_SRC") and (DEFAULT_TREE / "convert_hf_to_gguf.py").is_file():
        monkeypatch.setenv("SPECCONV_LLAMA_CPP_SRC", str(DEFAULT_TREE))


def field_value(field):
    value = field.contents()
    return [bool(v) for v in value] if isinstance(value, list) and value and isinstance(value[0], (bool, np.bool_)) \
        else value


@pytest.mark.parametrize("kwargs", [
    dict(moe=False, layout="release", tie=True, rope_style="top_level"),
    dict(moe=False, layout="save_pretrained", mtp_in_config=False),
    dict(moe=True, layout="release"),
    dict(moe=True, layout="save_pretrained"),
], ids=["dense-release-tied-rope-top-level", "dense-mtp-from-names", "moe-fused", "moe-per-expert"])
@pytest.mark.slow
def test_plugin_matches_upstream_converter(tmp_path, kwargs):
    src = build_qwen35(tmp_path / "src", **kwargs)
    up = GGUFReader(str(gguf_files.convert_gguf_upstream(src, tmp_path / "up.gguf", outtype="f16")))
    p, tensors = plugin_from_dir(src, header_order=True)
    plans = p.tensor_plan()

    up_tensors = {t.name: t for t in up.tensors}
    # With headers in file order (how the engine reads them), the plan is upstream's tensor order.
    assert [pl.name for pl in plans] == [t.name for t in up.tensors]
    up_f32 = {n for n, t in up_tensors.items() if t.tensor_type == GGMLQuantizationType.F32}
    assert {pl.name for pl in plans if pl.force_type == GGMLQuantizationType.F32} == up_f32

    worst, off_by_one_ulp = 0.0, 0
    for pl in plans:
        ours = torch.from_numpy(np.array(pl.transform([tensors[s].float().numpy() for s in pl.sources])))
        if pl.name not in up_f32:
            ours = ours.half()
        theirs = torch.from_numpy(np.array(up_tensors[pl.name].data)).reshape(pl.shape)
        assert theirs.dtype == ours.dtype, pl.name
        worst = max(worst, (ours.float() - theirs.float()).abs().max().item())
        if pl.name.endswith("ssm_a"):  # -exp(A_log): ours correctly rounded, upstream torch's float32 exp
            ulps = (ours.view(torch.int32).long() - theirs.view(torch.int32).long()).abs()
            assert int(ulps.max()) <= 1, pl.name
            off_by_one_ulp += int(ulps.sum())
        else:
            assert torch.equal(ours, theirs), pl.name
    print(f"{kwargs}: {len(plans)} tensors, max |plugin - upstream| = {worst:.1e}, "
          f"{off_by_one_ulp} ssm_a values 1 ulp apart (torch exp vs correctly rounded)")

    arch = p.gguf_arch
    assert up.fields["general.architecture"].contents() == arch
    up_kv = {k: field_value(f) for k, f in up.fields.items() if k.startswith(arch + ".")}
    ours = {m.key: m.value for m in p.metadata(keep_mtp=True)}
    assert list(ours) == list(up_kv)  # same keys in the same order
    for key, value in ours.items():
        if isinstance(value, float):
            assert np.float32(value) == np.float32(up_kv[key]), key
        else:
            assert value == up_kv[key], key
