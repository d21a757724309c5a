"""archs/hparams.py: the one reader of `{arch}.*` GGUF keys every graph's from_kv uses."""

from __future__ import annotations

import pytest

from specconv.archs.errors import SpecconvError
from specconv.archs.hparams import HParamsReader

KV = {"general.architecture": "demo", "demo.block_count": 4, "demo.rope.freq_base": 10000,
      "demo.attention.head_count_kv": [2, 2, 4, 4, 1], "demo.attention.sliding_window_pattern": [True, False],
      "demo.expert_weights_norm": True, "demo.rope.scaling.type": "yarn"}


def test_key_reads_with_the_arch_prefix_and_defaults():
    r = HParamsReader(KV)
    assert (r.arch, r.key("block_count", type=int), r.key("rope.scaling.type", type=str)) == ("demo", 4, "yarn")
    assert r.key("context_length", 0, int) == 0 and r.key("context_length", None) is None
    assert r.has("block_count") and not r.has("context_length")
    freq = r.key("rope.freq_base", type=float)
    assert freq == 10000.0 and isinstance(freq, float)  # an int stored for a float key reads as a float


def test_missing_or_mistyped_keys_are_one_line_errors_naming_the_key():
    r = HParamsReader(KV)
    with pytest.raises(SpecconvError, match=r"^GGUF metadata lacks demo\.embedding_length$"):
        r.key("embedding_length", type=int)
    for name, type_ in (("rope.scaling.type", int), ("expert_weights_norm", int), ("block_count", list),
                        ("attention.sliding_window_pattern", str)):
        with pytest.raises(SpecconvError, match=rf"^GGUF key demo\.{name} must be {type_.__name__}, found "):
            r.key(name, type=type_)


def test_per_layer_takes_a_scalar_for_every_block_or_the_first_n_entries():
    r = HParamsReader(KV)
    assert r.per_layer("block_count", 3) == [4, 4, 4]
    assert r.per_layer("attention.head_count_kv", 4) == [2, 2, 4, 4]
    assert r.per_layer("attention.sliding_window", 2, False, bool) == [False, False]
    with pytest.raises(SpecconvError, match=r"^demo\.attention\.sliding_window_pattern has 2 entries for 4 blocks$"):
        r.per_layer("attention.sliding_window_pattern", 4, type=bool)
    with pytest.raises(SpecconvError, match=r"^GGUF metadata lacks demo\.feed_forward_length$"):
        r.per_layer("feed_forward_length", 4)


def test_a_graph_reports_a_mistyped_key_by_name():
    """step35 and mimo2 read per-block keys themselves (check_kv cannot type them per arch): a string
    where a head count belongs is an error naming the key, not a TypeError inside the graph."""
    from specconv.runtime.graphs import step35
    kv = {"general.architecture": "step35", "step35.block_count": 2, "step35.attention.key_length": 8,
          "step35.attention.head_count": ["4", "4"], "step35.attention.head_count_kv": 1}
    with pytest.raises(SpecconvError, match=r"^GGUF key step35\.attention\.head_count must be int, found '4'$"):
        step35.HParams.from_kv(kv)


def test_the_shared_reads_split_blocks_size_heads_and_count_the_vocabulary():
    kv = {"general.architecture": "demo", "demo.block_count": 5, "demo.nextn_predict_layers": 2,
          "demo.embedding_length": 64, "demo.attention.head_count": 4, "tokenizer.ggml.tokens": ["a"] * 7}
    r = HParamsReader(kv)
    assert r.block_counts() == (3, 2) and HParamsReader({**kv, "demo.nextn_predict_layers": 0}).block_counts() == (5, 0)
    assert r.attention_widths() == (64, 4, 16)  # no key_length: the embedding split over the heads
    assert HParamsReader({**kv, "demo.attention.key_length": 24}).attention_widths() == (64, 4, 24)
    assert r.vocab_size() == 7 and HParamsReader({**kv, "demo.vocab_size": 9}).vocab_size() == 9
    assert HParamsReader({"general.architecture": "demo"}).vocab_size() == 0  # a sidecar without a tokenizer
    r.check_value_length(16)  # not stated: nothing to disagree with
    HParamsReader({**kv, "demo.attention.value_length": 16}).check_value_length(16)
    with pytest.raises(SpecconvError, match=r"^demo: attention\.value_length_swa differs from key_length_swa$"):
        HParamsReader({**kv, "demo.attention.value_length_swa": 8}).check_value_length(16, "_swa")
    with pytest.raises(SpecconvError, match=r"^demo\.nextn_predict_layers \(6\) exceeds block_count \(5\)$"):
        HParamsReader({**kv, "demo.nextn_predict_layers": 6}).block_counts()
