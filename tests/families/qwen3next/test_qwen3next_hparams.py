"""One hyperparameter dataclass for Qwen3-Next (`Qwen3NextHParams`, archs/qwen3next.py: Qwen3.5's fields
read with Qwen3-Next's rules): what the plugin reads from config.json is what the runtime's graph
reads back from the converted file, field for field, on the family sweep's fixtures (the comparison
of tests/families/qwen35/test_qwen35_hparams.py); a file with rope scaling is refused by name.
"""

from __future__ import annotations

import json

import pytest

from specconv.archs import SpecconvError
from specconv.archs.qwen35_hparams import Qwen35HParams
from specconv.archs.qwen3next import Qwen3NextHParams
from tests.families.qwen35.test_qwen35_hparams import assert_file_reads_back_the_config, check_sweep_case
from tests.fixtures import family_sweep
from tests.fixtures.gguf_files import convert_gguf

SWEEP = {c.name: c for c in family_sweep.CASES if c.family == "qwen3next"}


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_converted_file_reads_back_the_config_hparams(name, tmp_path):
    check_sweep_case(SWEEP[name], tmp_path)


def test_configured_interval_and_width_are_what_the_file_holds(tmp_path):
    """transformers' save_pretrained layout: layer_types with period 2 and no full_attention_interval.
    Qwen3-Next writes the configured interval (transformers' default 4, where Qwen3.5 writes the period)
    and config.json's intermediate_size (which Qwen3.5-MoE leaves out); the file reads back the same."""
    from tests.fixtures.tiny_qwen3next import build_qwen3next

    src = build_qwen3next(tmp_path / "hf", layout="transformers", layer_types=["linear_attention", "full_attention"] * 2)
    config = json.loads((src / "config.json").read_text())
    assert "full_attention_interval" not in config
    hp = Qwen3NextHParams.from_config(config, "qwen3next")
    assert hp.full_attention_interval == 4 and hp.recurrent == (True, False, True, False)
    assert Qwen35HParams.from_config(config, "qwen3next").full_attention_interval == 2  # Qwen3.5's rule
    assert hp.intermediate_size == config["intermediate_size"] > 0
    compared = assert_file_reads_back_the_config(src, convert_gguf(src, tmp_path / "m.gguf"))
    print(f"\n[transformers layout] {compared} fields equal; interval {hp.full_attention_interval}, "
          f"feed_forward_length {hp.intermediate_size}")


def test_rope_scaling_in_the_file_is_refused():
    kv = {"general.architecture": "qwen3next", "qwen3next.block_count": 2, "qwen3next.embedding_length": 8,
          "qwen3next.attention.head_count": 2, "qwen3next.attention.head_count_kv": 1,
          "qwen3next.attention.key_length": 4, "qwen3next.attention.value_length": 4,
          "qwen3next.attention.layer_norm_rms_epsilon": 1e-6, "qwen3next.ssm.conv_kernel": 4,
          "qwen3next.ssm.state_size": 4, "qwen3next.ssm.group_count": 1, "qwen3next.ssm.time_step_rank": 2,
          "qwen3next.ssm.inner_size": 8, "qwen3next.expert_count": 4, "qwen3next.expert_used_count": 2,
          "qwen3next.expert_feed_forward_length": 8, "qwen3next.expert_shared_feed_forward_length": 8}
    assert Qwen3NextHParams.from_kv(kv).rope_scaling is None
    with pytest.raises(SpecconvError, match="rope.scaling.type is 'yarn'"):
        Qwen3NextHParams.from_kv({**kv, "qwen3next.rope.scaling.type": "yarn", "qwen3next.rope.scaling.factor": 4.0})
