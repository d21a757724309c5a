"""Our EAGLE-3 (and LLaMA target) GGUFs against llama.cpp's own converter on the same checkpoints.

Tensors must be identical (names, order, types, shapes, bytes: the q/k permutation and the
absolute d2t included) and the metadata equal, except for documented differences on speculators
heads: llama.cpp's converter reads `eagle_aux_hidden_state_layer_ids` only at the top level, so
with the ids in `eagle_config` (layer outputs, which we write + 1) it writes the default layers instead; and it writes
`attention.key_length`/`value_length` only when its config loader knows head_dim.
Skips unless SPECCONV_LLAMA_CPP_SRC names the llama.cpp tree (tests/run.sh sets it).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream
from tests.fixtures.tiny_eagle3 import build_eagle3_head, build_llama_target
from tests.fixtures.tiny_qwen35 import build_qwen35


IGNORED = {"general.name", "general.size_label", "general.basename", "general.finetune", "general.version"}


def _read(path):
    r = GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in IGNORED}
    tensors = [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), np.array(t.data).tobytes()) for t in r.tensors]
    return kv, tensors


def _compare(ours, theirs, allowed=()):
    kv_a, t_a = _read(ours)
    kv_b, t_b = _read(theirs)
    assert [t[:3] for t in t_a] == [t[:3] for t in t_b]
    for a, b in zip(t_a, t_b):
        assert a[3] == b[3], f"{a[0]} differs"
    differ = {k for k in set(kv_a) | set(kv_b) if kv_a.get(k) != kv_b.get(k)}
    assert differ == set(allowed), {k: (kv_a.get(k), kv_b.get(k)) for k in differ}
    return kv_a, kv_b


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("target_kind,layout,rope", [("qwen35", "eagle", None), ("llama", "speculators", None),
                                                     ("llama", "eagle", None), ("qwen35", "eagle", LLAMA3_ROPE)])
def test_eagle3_head_matches_llama_cpp_converter(tmp_path, target_kind, layout, rope):
    target = (build_qwen35(tmp_path / "t", mtp=False) if target_kind == "qwen35"
              else build_llama_target(tmp_path / "t", n_layers=6))
    ids = [1, 2, 4] if layout == "eagle" else [0, 3, 5]
    head = build_eagle3_head(tmp_path / "h", target, layout=layout, layer_ids=ids, rope_scaling=rope)
    ours = convert_gguf(head, tmp_path / "ours.gguf", extra_args=["--target", str(target)])
    pre = "qwen35" if target_kind == "qwen35" else "llama-bpe"
    theirs = convert_gguf_upstream(head, tmp_path / "theirs.gguf", pre=pre,
                                   extra_args=["--target-model-dir", str(target)])
    nested = layout == "speculators"
    # speculators configs are read raw upstream (no AutoConfig): no head_dim, so no key/value_length
    # there, while we always write them (llama.cpp defaults them to n_embd / n_head, the same value)
    lengths = {"eagle3.attention.key_length", "eagle3.attention.value_length"}
    kv_a, kv_b = _compare(ours, theirs, ({"eagle3.target_layers"} | lengths) if nested else ())
    assert kv_a["eagle3.attention.key_length"] == kv_a["eagle3.embedding_length"] // kv_a["eagle3.attention.head_count"]
    # ours: top-level ids as they are (layer inputs), eagle_config ids (layer outputs) + 1
    assert list(kv_a["eagle3.target_layers"]) == ([i + 1 for i in ids] if nested else ids)
    if nested:
        assert list(kv_b["eagle3.target_layers"]) == [2, 3, 3]  # upstream's default: [2, L//2, L-3]
    if rope:  # the generated llama3 factors, first in both files
        assert [t.name for t in GGUFReader(ours).tensors][0] == "rope_freqs.weight"


def test_llama_target_matches_llama_cpp_converter(tmp_path):
    target = build_llama_target(tmp_path / "t", n_layers=4)
    ours = convert_gguf(target, tmp_path / "ours.gguf")
    theirs = convert_gguf_upstream(target, tmp_path / "theirs.gguf", pre="llama-bpe")
    _compare(ours, theirs)
