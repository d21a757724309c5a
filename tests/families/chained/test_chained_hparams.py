"""One hparams dataclass per chained-MTP family (HyV3HParams, Step35HParams, Mimo2HParams): the plugin
builds it from config.json and the checkpoint's tensor names (`from_config`), the graph from the
converted file's GGUF metadata (`from_kv`), and both give every quantity the file can state under one
name and the same value. The fields a file cannot state are listed below with the reason; for them
the test checks what the file side holds instead.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specconv.archs.hy_v3 import HyV3, HyV3HParams
from specconv.archs.mimo2 import MiMo2
from specconv.archs.mimo2_hparams import Mimo2HParams
from specconv.archs.step35 import Step35
from specconv.archs.step35_hparams import Step35HParams
from specconv.runtime.gguf_file import GGUFModelFile
from specconv.runtime.graphs import hy_v3, mimo2, step35
from tests.fixtures import chained_reference as ref_mod
from tests.fixtures import tiny_chained as tiny
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_tools import plugin_on

# fields the file cannot state, and why
NOT_IN_FILE = {
    "from_file": "says which of the two built it",
    "vocab_size": "no GGUF key states it: the embedding's rows do (the shapes read vocab_dim, 'V' for a file)",
    "tie_word_embeddings": "a file states it by lacking output.weight, not by a key",
    "mtp_layers_in_config": "config.json's own statement; the file records the count the checkpoint holds",
    # the graph binds these to each block's tensors, so a block runs whichever FFN the file holds
    "intermediate_size": "bound per block from the tensors (feed_forward_length is checked below)",
    "moe_intermediate_size": "bound per block from the tensors (expert_feed_forward_length is checked below)",
    "shared_expert_intermediate_size": "bound per block from the tensors",
    "moe_layers": "a block with ffn_gate_inp is routed",
}
# the step35 and mimo2 graphs bind each block's expert count to its router's rows and check the
# routing block by block, as they did before the dataclass was shared (hy_v3 reads expert_count)
EXPERTS_PER_BLOCK = {"num_experts": "bound per block from the router (expert_count is checked below)"}

FAMILIES = {"hy_v3": (HyV3, HyV3HParams, hy_v3, NOT_IN_FILE),
            "step35": (Step35, Step35HParams, step35, NOT_IN_FILE | EXPERTS_PER_BLOCK),
            "mimo2": (MiMo2, Mimo2HParams, mimo2, NOT_IN_FILE | EXPERTS_PER_BLOCK),
            "step37": (Step35, Step35HParams, step35, NOT_IN_FILE | EXPERTS_PER_BLOCK)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, plugin, from_config's hparams, from_kv's hparams of the converted file, its kv)."""
    name = request.param
    plugin_cls, hparams_cls, graph, _ = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    if name == "step37":  # the 3.7 layout: nested text_config, tensors under model.language_model.
        src = tiny.step37_release(tiny.build_tiny(root / "hf35", "step35"), root / "hf")
        gguf = convert_gguf(src, root / "step37.gguf")
    else:
        src, files = ref_mod.converted(name, root)
        gguf = files["embed"]
    plugin = plugin_on(plugin_cls, src)[0]
    kv = GGUFModelFile(gguf).kv
    assert graph.GRAPH.HParams is hparams_cls  # the graph runs the plugin's dataclass
    return name, plugin, hparams_cls.from_config(plugin.checkpoint), hparams_cls.from_kv(kv), kv


def test_from_kv_equals_from_config(pair):
    name, plugin, config, file, _ = pair
    assert type(config) is type(file) and not config.from_file and file.from_file
    assert config == plugin.hp  # the plugin converts from this very instance
    fields = [f.name for f in dataclasses.fields(config)]
    compared = [f for f in fields if f not in FAMILIES[name][3]]
    differ = {f: (getattr(config, f), getattr(file, f)) for f in compared
              if _as_stored(getattr(config, f)) != getattr(file, f)}
    print(f"\n{name}: {len(compared)} of {len(fields)} fields equal from config.json and from the file; "
          f"not in the file: {sorted(set(fields) - set(compared))}")
    assert not differ
    assert config.num_nextn_predict_layers == tiny.K_MTP["step35" if name == "step37" else name] > 0


def _as_stored(value):
    """A config.json value as a GGUF file holds it: floats as float32."""
    if isinstance(value, list):
        return [_as_stored(v) for v in value]
    return float(np.float32(value)) if isinstance(value, float) else value


def test_what_the_file_cannot_state(pair):
    """The fields left out above: the file side holds None (bound per block from the tensors) or its
    default, and the FFN widths config.json gives are the ones the file's metadata states."""
    name, plugin, config, file, kv = pair
    arch = config.arch
    assert file.vocab_size == 0 and file.vocab_dim == "V" and config.vocab_dim == config.vocab_size > 0
    assert file.moe_layers is None and file.intermediate_size is None and file.moe_intermediate_size is None
    assert config.moe_layers and config.mtp_layers_in_config in (None, config.num_nextn_predict_layers)
    assert kv[f"{arch}.feed_forward_length"] == config.intermediate_size
    assert kv[f"{arch}.expert_feed_forward_length"] == config.moe_intermediate_size
    assert kv[f"{arch}.expert_count"] == config.num_experts and file.num_experts in (0, config.num_experts)
    if f"{arch}.expert_shared_feed_forward_length" in kv:
        assert kv[f"{arch}.expert_shared_feed_forward_length"] == config.shared_expert_intermediate_size
    assert config.tie_word_embeddings == ("output.weight" not in {t.name for t in plugin.tensor_plan()})
