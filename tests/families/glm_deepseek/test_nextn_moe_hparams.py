"""One hyperparameter dataclass per nextn-MoE family (archs/nextn_moe_hparams.py and its subclasses in
archs/glm4moe.py, deepseek2.py, dsa.py): the plugin builds it from config.json (`from_config`), the
runtime graph from the converted file's GGUF metadata (`from_kv`), and on every tiny checkpoint of
the glm4moe, deepseek2 (DeepSeek-V3, GLM-4.7-Flash) and DSA (GLM-5, DeepSeek-V3.2) families both
give the same value to every field but the few a file cannot state (`UNKNOWABLE`, each with its
reason). Floats are compared as the float32 the file stores."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from specconv.archs import plugin_class_for
from specconv.archs.base import Checkpoint
from specconv.archs.nextn_moe_hparams import NextnMoeHParams
from specconv.runtime.gguf_file import GGUFModelFile
from specconv.runtime.graphs import graph_for
from tests.fixtures.gguf_files import convert_gguf

# field -> why GGUF metadata cannot say it (the dataclass's own default stands in for it)
UNKNOWABLE = {
    "from_file": "says which of the two readings built the object",
    "tie_word_embeddings": "a tied file lacks output.weight; no key states it",
    "attention_bias": "no key states it; a file's blocks may hold the biases (glm4moe loads them when present)",
    "use_qk_norm": "no key states it; a file's blocks may hold the q/k norms (loaded when present)",
    "rope_interleave": "a file always holds adjacent-pair rope rows: a rotate-half checkpoint's are reordered "
                       "when converted (archs/deepseek2.py)",
}


def _glm_deepseek(family, **over):
    def build(root):
        from tests.fixtures.tiny_glm_deepseek import build_tiny

        return build_tiny(root, family, **over)
    return build


def _dsa(family, **over):
    def build(root):
        from tests.fixtures.tiny_dsa import build_tiny

        return build_tiny(root, family, **over)
    return build


CASES = {
    "glm4moe": _glm_deepseek("glm4moe"),  # q/k/v biases, q/k norms, 4 expert groups
    # the family sweep's shapes: no q/k norm, 12 query / 2 KV heads of 16, top-3 of 8 experts in 2 groups
    "glm4moe-shapes": _glm_deepseek("glm4moe", glm_tokens=True, seed=1, use_qk_norm=False, num_attention_heads=12,
                                    num_key_value_heads=2, head_dim=16, num_experts_per_tok=3, n_group=2,
                                    topk_group=1),
    "glm4moe-plain": _glm_deepseek("glm4moe", attention_bias=False, use_qk_norm=False, copies=False),
    "deepseek2": _glm_deepseek("deepseek2"),
    "deepseek2-yarn": _glm_deepseek("deepseek2", yarn=True, seed=1, num_attention_heads=8, num_key_value_heads=8,
                                    q_lora_rank=24, num_experts_per_tok=3, n_group=2, topk_group=1),
    "deepseek2-no-q-lora": _glm_deepseek("deepseek2", q_lora_rank=None),
    "deepseek2-rotate-half": _glm_deepseek("deepseek2", rope_interleave=False),
    "glm47flash": _glm_deepseek("glm4moelite"),
    "glm47flash-transformers-config": _glm_deepseek("glm4moelite", lite_config="transformers"),  # mlp_layer_types
    "glm-dsa-shared": _dsa("glm-dsa", indexer_types=["full", "shared", "full"]),
    "deepseek32": _dsa("deepseek32"),
}


def _same(a, b) -> bool:
    """Equal, floats as float32 (the file's), dataclasses (rope scaling) field by field."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.float32(a) == np.float32(b)
    return a == b


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_and_file_give_the_same_hparams(case, tmp_path):
    source = CASES[case](tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    plugin = plugin_class_for(config)
    from_config = plugin.HParams.from_config(config)
    file = GGUFModelFile(convert_gguf(source, tmp_path / "m.gguf"))
    graph = graph_for(file.arch)
    from_kv = graph.HParams.from_kv(file.kv)

    # one class from plugin to graph: the plugin's is the graph's or (a family's config defaults) a
    # subclass adding no field
    assert isinstance(from_config, graph.HParams) and isinstance(from_config, NextnMoeHParams)
    names = [f.name for f in dataclasses.fields(from_kv)]
    assert names == [f.name for f in dataclasses.fields(from_config)]
    assert from_config.arch == file.arch and from_kv.from_file and not from_config.from_file

    differ = {n: (getattr(from_config, n), getattr(from_kv, n)) for n in names
              if not _same(getattr(from_config, n), getattr(from_kv, n))}
    compared = [n for n in names if n not in UNKNOWABLE]
    print(f"{case}: {type(from_config).__name__} vs {type(from_kv).__name__}: {len(compared)} fields equal; "
          f"the file cannot state {sorted(set(differ) & set(UNKNOWABLE))}")
    assert not {n: d for n, d in differ.items() if n not in UNKNOWABLE}
    # what the file cannot state takes the dataclass default, never a value read from elsewhere
    defaults = {f.name: f.default for f in dataclasses.fields(from_kv)}
    assert all(getattr(from_kv, n) == defaults[n] for n in set(UNKNOWABLE) - {"from_file"} if n in defaults)

    # the plugin converts with exactly this object
    assert plugin(Checkpoint(config, {})).hp == from_config
