"""One hyperparameter dataclass for Gemma 4 and its assistant (archs/gemma4_hparams.py): the plugin
builds it from config.json, the graph from the converted file's GGUF metadata, and the two agree.

Each tiny checkpoint is converted; `from_kv` of the file must equal `from_config` of config.json on
every field but those config.json and the file state differently, each checked here for what the
file says instead:
* from_file: which of the two built it;
* vocab_size: config.json counts the embedding's rows, the file the tokenizer's tokens (the converter
  trims the rest);
* partial_rotary_factor: the file has it as the rope_freqs tensor (1 for each rotated pair);
* attention_k_eq_v: the file has it as the full layers' missing attn_v.
Numbers the file stores as float32 are compared at float32.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from specconv.archs import plugin_class_for
from specconv.archs.gemma4_hparams import Gemma4AssistantHParams, Gemma4HParams
from specconv.runtime.gguf_file import GGUFModelFile
from specconv.runtime.graphs import graph_for
from tests.fixtures import tiny_gemma4 as g
from tests.fixtures.family_sweep import GEMMA_MOE, NO_PLE
from tests.fixtures.gguf_files import convert_gguf

# case -> (checkpoint builder, its hparams class)
CASES = {
    "hub-conditional": (lambda: g.tiny_gemma4("hub", "conditional"), Gemma4HParams),
    "v5-causal": (lambda: g.tiny_gemma4("v5", "causal"), Gemma4HParams),
    "double-wide": (lambda: g.tiny_gemma4("hub", "conditional", use_double_wide_mlp=True), Gemma4HParams),
    "moe": (lambda: g.tiny_gemma4("hub", "conditional", num_kv_shared_layers=0, **GEMMA_MOE, **NO_PLE),
            Gemma4HParams),
    "assistant-hub": (lambda: g.tiny_assistant("hub"), Gemma4AssistantHParams),
    "assistant-v5": (lambda: g.tiny_assistant("v5"), Gemma4AssistantHParams),
}
CONFIG_ONLY = {"from_file", "vocab_size", "partial_rotary_factor", "attention_k_eq_v"}  # see the docstring
FLOAT32 = {"rms_norm_eps", "rope_theta", "sliding_rope_theta", "final_logit_softcapping"}  # GGUF FLOAT32 keys


def _same(name: str, a, b) -> bool:
    if name in FLOAT32 and a is not None and b is not None:
        return np.float32(a) == np.float32(b)
    return a == b


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_config_equals_from_file(case, tmp_path):
    build, cls = CASES[case]
    src = build()
    config = json.loads((src / "config.json").read_text())
    file = GGUFModelFile(convert_gguf(src, tmp_path / "m.gguf"))
    # one class: the plugin's and the graph's
    assert plugin_class_for(config).HParams is cls and graph_for(file.arch).HParams is cls

    ours, theirs = cls.from_config(config), cls.from_kv(file.kv)
    assert type(theirs) is cls and (ours.from_file, theirs.from_file) == (False, True)
    fields = [f.name for f in dataclasses.fields(cls)]
    differ = {n: (getattr(ours, n), getattr(theirs, n)) for n in fields
              if n not in CONFIG_ONLY and not _same(n, getattr(ours, n), getattr(theirs, n))}
    assert not differ, differ

    # what the file says instead of the config-only fields
    assert theirs.vocab_size == g.VOCAB_REAL and ours.vocab_size == g.VOCAB_ROWS
    assert theirs.partial_rotary_factor is None and theirs.attention_k_eq_v is None
    rope = file.load("rope_freqs.weight").numpy().ravel()
    assert len(rope) == ours.global_head_dim // 2
    assert int((rope == 1.0).sum()) == int(ours.global_head_dim * ours.partial_rotary_factor / 2)
    full_owners = [i for i in range(ours.n_blocks) if ours.owns_kv(i) and not ours.is_sliding(i)]
    has_v = [file.has(f"blk.{i}.attn_v.weight") for i in full_owners]
    assert has_v == [not ours.attention_k_eq_v] * len(full_owners)

    # the derived quantities the tables and graphs read agree too
    for name in ("n_blocks", "input_width", "store"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert [ours.owns_kv(i) for i in range(ours.n_blocks)] == [theirs.owns_kv(i) for i in range(theirs.n_blocks)]
    print(f"{case}: {len(fields) - len(CONFIG_ONLY)} of {len(fields)} fields equal; {theirs.n_blocks} blocks, "
          f"head dims {theirs.head_dim}, FFN widths {theirs.intermediate_size}, KV heads {theirs.num_key_value_heads}")
