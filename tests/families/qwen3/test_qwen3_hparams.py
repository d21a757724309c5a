"""One hparams dataclass for Qwen3 and Qwen3-MoE (archs/qwen3.py `Qwen3HParams`): the graph's, read
from a converted file (`from_kv`), equals the plugin's, read from config.json (`from_config`), on
every field the file states: the sweep's fixtures (tests/fixtures/family_sweep.py) and the configs
that switch what the metadata holds (YaRN and linear rope scaling, norm_topk_prob false)."""

from __future__ import annotations

import json

import pytest

from specconv.archs.qwen3 import Qwen3HParams
from specconv.runtime.gguf_file import GGUFModelFile
from tests.fixtures.family_runner import built, cases
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.hparams_compare import differences
from tests.fixtures.tiny_qwen3 import build_qwen3

UNSTATED = {"tie_word_embeddings": "stated by the tensors: output.weight absent when tied"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16.0,
        "attention_factor": 1.25}
VARIANTS = {"yarn": {"rope_scaling": YARN}, "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            "moe-no-norm-topk": {"moe": True, "norm_topk_prob": False}}


def _check(name, src, gguf):
    config = json.loads((src / "config.json").read_text())
    moe = "Qwen3MoeForCausalLM" in config["architectures"]
    file = GGUFModelFile(gguf)
    from_kv, from_config = Qwen3HParams.from_kv(file.kv), Qwen3HParams.from_config(config, moe=moe)
    diffs, n = differences(from_kv, from_config, UNSTATED)
    print(f"\n[{name}] {n} fields equal from the file and from config.json (rope scaling "
          f"{from_config.rope_scaling}, norm_topk_prob {from_config.norm_topk_prob})"
          + "".join(f"\n    {d}" for d in diffs))
    assert not diffs
    assert from_config.tie_word_embeddings == ("output.weight" not in file.tensors)
    return from_config


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hparams")


@pytest.mark.parametrize("case", cases("qwen3-release", "qwen3-shapes", "qwen3moe-release", "qwen3moe-shapes"),
                         ids=lambda c: c.name)
def test_sweep_fixture_hparams_from_file_equal_config(case, root):
    b = built(case, root)
    _check(case.name, b.src, b.target)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metadata_variants_hparams_from_file_equal_config(variant, tmp_path):
    src = build_qwen3(tmp_path / "hf", **VARIANTS[variant])
    hp = _check(variant, src, convert_gguf(src, tmp_path / "model.gguf"))
    assert (hp.rope_scaling is not None) == ("rope_scaling" in VARIANTS[variant])  # the variant is what it says
    assert hp.norm_topk_prob == VARIANTS[variant].get("norm_topk_prob", True)
