"""archs/rope_scaling.py: rope scaling from config.json, read once for qwen3, qwen35 and the nextn MoE families."""

from __future__ import annotations

import pytest

from specconv.archs.config_reader import ConfigReader
from specconv.archs.errors import SpecconvError
from specconv.archs.rope_scaling import RopeScaling, rope_scaling_of, yarn_mscale

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "mscale_all_dim": 1.0}


def _read(config, **kw):
    return rope_scaling_of(ConfigReader(config), "Demo", **kw)


def test_the_three_places_a_type_is_written_read_alike():
    want = RopeScaling("yarn", 4.0, 4096, beta_fast=32)
    assert _read(YARN) == _read({"rope_parameters": YARN}) == want
    assert _read({"rope_scaling": {**YARN, "type": "yarn", "rope_type": None}}) == want  # pre-v5 `type`
    assert _read({"rope_parameters": YARN}, mscale=True).mscale_all_dim == 1.0  # DeepSeek's, only when asked
    assert _read({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}) == RopeScaling("linear", 2.0)
    assert _read({}) is None and _read({"rope_type": "default"}) is None
    assert _read({"rope_type": "mrope"}, unscaled=("default", "mrope")) is None


def test_mscale_pair_becomes_the_attention_factor_unless_the_family_writes_mscale_all_dim():
    """transformers' _compute_yarn_parameters: with both mscale and mscale_all_dim and no
    attention_factor, cos/sin carry yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all_dim); one of
    them alone leaves the default. DeepSeek's families keep mscale_all_dim for their own key instead."""
    pair = {**YARN, "mscale": 0.8, "mscale_all_dim": 1.2}
    got = _read(pair)
    assert got.attn_factor == pytest.approx((0.08 * 1.3862944 + 1) / (0.12 * 1.3862944 + 1), rel=1e-6)
    assert got.attn_factor == yarn_mscale(4.0, 0.8) / yarn_mscale(4.0, 1.2) and got.mscale_all_dim is None
    assert _read({**pair, "attention_factor": 1.5}).attn_factor == 1.5  # the file's own factor wins
    assert _read(YARN).attn_factor is None  # mscale_all_dim alone: transformers' default factor
    deepseek = _read(pair, mscale=True)
    assert deepseek.attn_factor is None and deepseek.mscale_all_dim == 1.2


@pytest.mark.parametrize("config, kw, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, {}, r"rope scaling type 'dynamic' is not supported for Demo"),
    ({"rope_type": "linear"}, {}, r"'linear' is not supported for Demo \(supported: default; linear, yarn with a"),
    ({"rope_type": "linear", "factor": 2.0}, {"kinds": ("yarn",)}, r"'linear' is not supported for Demo"),
    ({"rope_type": "mrope"}, {}, r"'mrope' is not supported"),
    ({"rope_type": "yarn", "factor": 2.0}, {}, r"^config.json: yarn rope scaling needs 'original_max_position_emb"),
    ({**YARN, "truncate": False}, {}, r"^config.json: yarn rope scaling with 'truncate': false is not supported"),
])
def test_unsupported_or_incomplete_scaling_is_a_one_line_error(config, kw, match):
    with pytest.raises(SpecconvError, match=match):
        _read(config, **kw)
