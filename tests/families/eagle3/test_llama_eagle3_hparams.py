"""One hparams dataclass for LLaMA (archs/llama.py `LlamaHParams`) and one for EAGLE-3 heads
(archs/eagle3.py `Eagle3HParams`): the graph's, read from a converted file (`from_kv`), equals the
plugin's, read from config.json (`from_config`), on every field the file states, for each fixture
of the two families (tests/fixtures/family_sweep.py, tools/family_snapshot.py)."""

from __future__ import annotations

import json

import pytest

from specconv.archs.eagle3_hparams import Eagle3HParams
from specconv.archs.llama import LlamaHParams
from specconv.runtime.gguf_file import GGUFModelFile
from tests.fixtures.family_runner import built, cases
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.hparams_compare import differences
from tools import family_snapshot as fs

# what a file cannot state in its metadata (each checked against the file's tensors below)
LLAMA_UNSTATED = {"tie_word_embeddings": "stated by the tensors: output.weight absent when tied"}
EAGLE3_UNSTATED = {"draft_vocab_size": "stated by the tensors: the rows of output.weight (and d2t's length)"}


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _compare(kind, from_kv, from_config, unstated):
    diffs, n = differences(from_kv, from_config, unstated)
    print(f"\n[{kind}] {n} fields equal from the file and from config.json" + "".join(f"\n    {d}" for d in diffs))
    assert not diffs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hparams")


@pytest.mark.parametrize("case", cases("llama-release", "llama-shapes"), ids=lambda c: c.name)
def test_llama_target_and_head_hparams_from_file_equal_config(case, root):
    b = built(case, root)
    target = GGUFModelFile(b.target)
    from_kv, from_config = LlamaHParams.from_kv(target.kv), LlamaHParams.from_config(_config(b.src))
    _compare(f"{case.name} llama", from_kv, from_config, LLAMA_UNSTATED)
    assert from_config.tie_word_embeddings == ("output.weight" not in target.tensors)

    head = GGUFModelFile(b.draft)
    _check_head(case.name, head, Eagle3HParams.from_config(_config(b.draft_src), _config(b.src)))


def _check_head(name, head: GGUFModelFile, from_config: Eagle3HParams):
    _compare(f"{name} eagle3", Eagle3HParams.from_kv(head.kv), from_config, EAGLE3_UNSTATED)
    rows = int(head.tensors["output.weight"].shape[-1])  # ggml order: the vocabulary is the last dimension
    assert from_config.draft_vocab_size == rows
    if "d2t" in head.tensors:
        assert int(head.tensors["d2t"].shape[0]) == rows


@pytest.mark.parametrize("name", ["eagle3-qwen3-specforge", "eagle3-qwen3-angelslim", "eagle3-draftmodel"])
def test_other_head_layouts_hparams_from_file_equal_config(name, tmp_path):
    """The heads over a Qwen3 target whose configs name layer outputs (SpecForge, AngelSlim) and the
    speculators layout under Eagle3DraftModel."""
    source = {f.name: f for f in fs.families()}[name].build(tmp_path)
    path = convert_gguf(source.draft_src, tmp_path / "head.gguf", extra_args=source.draft_args)
    _check_head(name, GGUFModelFile(path), Eagle3HParams.from_config(_config(source.draft_src), _config(source.src)))
