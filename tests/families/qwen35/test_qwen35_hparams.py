"""One hyperparameter dataclass for Qwen3.5 / 3.6 (archs/qwen35_hparams.py): what the plugin reads from
config.json (`Qwen35HParams.from_config`, with the MTP blocks the checkpoint holds) is what the
runtime's graph reads back from the converted file (`from_kv`), field for field, on every fixture of
the family sweep and on a YaRN-scaled config. Qwen3-Next's test (tests/families/qwen3next/) runs the
same comparison on its subclass.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from specconv.archs import plugin_class_for
from specconv.archs.base import Checkpoint
from specconv.archs.qwen35_hparams import Qwen35HParams
from specconv.convert.checkpoint import CheckpointReader
from specconv.runtime.gguf_file import GGUFModelFile
from specconv.runtime.graphs import graph_for
from tests.fixtures import family_sweep
from tests.fixtures.gguf_files import convert_gguf

# What GGUF metadata cannot say, and why:
NOT_IN_THE_FILE = {
    "from_file": "says which of the two readers built the object",
    "tie_word_embeddings": "a tied file has no output.weight; its metadata has no key for it (checked below)",
}


def _as_stored(value):
    """A field's value as GGUF keeps it: floats are written float32 (rms_norm_eps, rope_theta, rope scaling)."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: _as_stored(v) for k, v in value.items()}
    return value


def _plugin(src: Path):
    """The plugin on checkpoint `src` as the converter makes it (every shard's headers, names normalised)."""
    reader = CheckpointReader(src)
    try:
        cls = plugin_class_for(reader.config)
        headers, _, skipped = reader.headers(cls.normalize_name)
        return cls(Checkpoint(reader.config, headers, skipped, source_dir=str(src)))
    finally:
        reader.close()


def assert_file_reads_back_the_config(src: Path, gguf: Path) -> int:
    """The plugin's hparams of checkpoint `src` equal the graph's of its converted file `gguf` on every
    field the file can know; returns how many fields were compared."""
    config = json.loads((src / "config.json").read_text())
    plugin = _plugin(src)
    hp = plugin.hp
    # the plugin keeps config.json's hparams, with the MTP block count its checkpoint holds
    assert hp == replace(plugin.HParams.from_config(config, plugin.gguf_arch),
                         num_nextn_predict_layers=plugin.n_mtp_layers)
    file = GGUFModelFile(gguf)
    graph = graph_for(file.arch)
    assert graph.HParams is type(hp)  # one class, from the plugin to the graph
    from_file = graph.HParams.from_kv(file.kv)
    assert from_file.from_file and not hp.from_file
    assert from_file.vocab_dim == "V" and hp.vocab_dim == hp.vocab_size  # the tables' vocabulary dimension
    assert ("output.weight" not in file.tensors) == hp.tie_word_embeddings
    want, got = _as_stored(asdict(hp)), _as_stored(asdict(from_file))
    for name in NOT_IN_THE_FILE:
        del want[name], got[name]
    assert got == want
    return len(want)


def check_sweep_case(case: family_sweep.Case, tmp_path: Path) -> None:
    """Build and convert a sweep fixture, then hold its file to its config."""
    built = case.build(tmp_path)
    compared = assert_file_reads_back_the_config(built.src, built.target)
    print(f"\n[{case.name}] {compared} fields equal from config.json and from the file "
          f"(not compared: {', '.join(NOT_IN_THE_FILE)})")


SWEEP = {c.name: c for c in family_sweep.CASES if c.family in ("qwen35", "qwen35moe")}


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_converted_file_reads_back_the_config_hparams(name, tmp_path):
    check_sweep_case(SWEEP[name], tmp_path)


def test_yarn_rope_scaling_reads_back(tmp_path):
    """A YaRN config: every rope.scaling key written is read back into the same RopeScaling."""
    from tests.fixtures.tiny_qwen35 import build_qwen35

    src = build_qwen35(tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=512,
                                     beta_fast=32.0, beta_slow=1.0, attention_factor=0.8, extrapolation_factor=1.0)
    (src / "config.json").write_text(json.dumps(config))
    hp = Qwen35HParams.from_config(config, "qwen35")
    assert hp.rope_scaling is not None and hp.rope_scaling.kind == "yarn"
    compared = assert_file_reads_back_the_config(src, convert_gguf(src, tmp_path / "m.gguf"))
    print(f"\n[yarn] {compared} fields equal, rope scaling {hp.rope_scaling}")
