"""Which files a Hub id fetches, without a network: Hub ids, the checkpoint's files, and the GGUF model
file and drafter sibling chosen by quant tag as llama.cpp's `-hf` chooses them.

llama.cpp's choice is checked two ways: hand-made repositories with the answers read off
common/download.cpp (docs/reference/hub.md §1.2), and random repositories compared with the
independent re-implementation in tests/fixtures/hub/llamacpp_rules.py.
"""

from __future__ import annotations

import random

import pytest

from specconv.errors import SpecconvError
from specconv.hub.fetch import (
    DRAFT_KEYWORDS,
    HubRef,
    checkpoint_side_files,
    looks_like_hub_id,
    parse_ref,
    pick_model,
    pick_sibling,
    split_set,
    weight_files,
)
from tests.fixtures.hub.llamacpp_rules import lc_find_best_model, lc_find_best_sibling


def test_hub_ids_with_revision_and_quant_tag():
    assert parse_ref("Qwen/Qwen3.5-9B", quant=False) == HubRef("Qwen/Qwen3.5-9B")
    assert parse_ref("Qwen/Qwen3.5-9B@v1.0", quant=False) == HubRef("Qwen/Qwen3.5-9B", "v1.0")
    assert parse_ref("me/X-GGUF:q4_k_m", quant=True) == HubRef("me/X-GGUF", None, "q4_k_m")
    assert parse_ref("me/X-GGUF@refs/pr/3:Q8_0", quant=True) == HubRef("me/X-GGUF", "refs/pr/3", "Q8_0")
    assert str(HubRef("me/X-GGUF", "abc", "Q8_0")) == "me/X-GGUF@abc:Q8_0"
    for bad in ("Qwen3.5-9B", "a/b/c", "me/bad--name", "me/x@", "me/x@has space", "./me/x", "me/.hidden"):
        assert not looks_like_hub_id(bad), bad
        with pytest.raises(SpecconvError) as info:
            parse_ref(bad, quant=True)
        assert "\n" not in str(info.value)
    with pytest.raises(SpecconvError, match="quant tag"):
        parse_ref("me/X-GGUF:Q4*", quant=True)
    # without quant tags, a ':' is part of nothing valid
    assert not looks_like_hub_id("me/X-GGUF:Q8_0")


def test_a_checkpoint_fetches_config_tokenizer_card_and_the_weights_convert_reads():
    paths = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "special_tokens_map.json", "chat_template.jinja", "README.md", "merges.txt", "vocab.json",
             "additional_chat_templates/tool_use.jinja", "model.safetensors.index.json",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors",
             "pytorch_model.bin", "original/consolidated.00.pth", "original/tokenizer.model", ".gitattributes",
             "optimizer.pt", "training_args.bin", "mtp/model.safetensors", "images/figure.png", "LICENSE"]
    assert checkpoint_side_files(paths) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
         "special_tokens_map.json", "chat_template.jinja", "README.md", "merges.txt", "vocab.json",
         "additional_chat_templates/tool_use.jinja"])
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                            "c": "model-00002-of-00002.safetensors"}}
    assert weight_files(paths, index) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # no index: model*.safetensors at the root, else every root .safetensors (convert/checkpoint.py's rule)
    assert weight_files(paths, None) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert weight_files(["consolidated.safetensors", "sub/model.safetensors"], None) == ["consolidated.safetensors"]
    assert weight_files(["pytorch_model.bin"], None) == []


REPO = [
    "README.md",
    "X-Q8_0.gguf",
    "X.BF16.gguf",
    "x-q6_k.gguf",
    "X-Q4_K_M/X-Q4_K_M-00001-of-00003.gguf",
    "X-Q4_K_M/X-Q4_K_M-00002-of-00003.gguf",
    "X-Q4_K_M/X-Q4_K_M-00003-of-00003.gguf",
    "mtp-X-Q8_0.gguf",
    "mtp-X-Q4_K_M.gguf",
    "mtp-X-F16.gguf",
    "eagle3-X-Q8_0.gguf",
    "mmproj-X-F16.gguf",
    "X-imatrix.gguf",
]


@pytest.mark.parametrize("tag, expected", [
    (None, "X-Q4_K_M/X-Q4_K_M-00001-of-00003.gguf"),  # Q4_K_M first, and only shard 1 of a split model
    ("Q8_0", "X-Q8_0.gguf"),
    ("q8_0", "X-Q8_0.gguf"),  # tags match in any case
    ("bf16", "X.BF16.gguf"),  # '.' separates like '-'
    ("Q6_K", "x-q6_k.gguf"),
    ("F16", "X.BF16.gguf"),  # the match is not anchored, in llama.cpp too: F16 also matches BF16
    ("K_M", "X-Q4_K_M/X-Q4_K_M-00001-of-00003.gguf"),
    ("Q5_K_M", None),
])
def test_the_model_file_is_chosen_by_quant_tag_as_llama_cpp_does(tag, expected):
    assert pick_model(REPO, tag) == expected
    if tag is not None:
        assert lc_find_best_model(sorted(REPO), tag) == expected


def test_without_q4_k_m_or_q8_0_the_first_model_file_is_taken():
    files = ["b-BF16.gguf", "a-Q6_K.gguf", "mtp-a-Q6_K.gguf", "a-Q3_K-00002-of-00002.gguf"]
    assert pick_model(files, None) == "a-Q6_K.gguf"
    assert pick_model(["mtp-a-Q8_0.gguf", "mmproj-F16.gguf"], None) is None


def test_a_split_model_brings_all_its_shards_and_nothing_else():
    first = pick_model(REPO, "Q4_K_M")
    assert split_set(REPO, first) == [f"X-Q4_K_M/X-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split_set(REPO, "X-Q8_0.gguf") == ["X-Q8_0.gguf"]


@pytest.mark.parametrize("tag, model, keyword, expected", [
    ("Q8_0", "X-Q8_0.gguf", "mtp-", "mtp-X-Q8_0.gguf"),  # exact tag
    ("Q4_K_M", "X-Q4_K_M/X-Q4_K_M-00001-of-00003.gguf", "mtp-", "mtp-X-Q4_K_M.gguf"),  # a folder up is allowed
    (None, "X.BF16.gguf", "mtp-", "mtp-X-F16.gguf"),  # no tag: closest bits to the model's (16)
    ("Q6_K", "x-q6_k.gguf", "mtp-", "mtp-X-Q4_K_M.gguf"),  # closest bits, |6-4| = |6-8|: the first listed
    ("Q5_K_M", "x-q6_k.gguf", "mtp-", "mtp-X-Q4_K_M.gguf"),  # |5-4| < |5-8|
    ("Q8_K", "x-q6_k.gguf", "mtp-", "mtp-X-Q8_0.gguf"),
    ("Q8_0", "X-Q8_0.gguf", "eagle3-", "eagle3-X-Q8_0.gguf"),
    ("Q8_0", "X-Q8_0.gguf", "dflash-", None),
])
def test_the_drafter_sibling_is_chosen_as_llama_cpp_does(tag, model, keyword, expected):
    assert pick_sibling(REPO, model, keyword, tag) == expected
    if tag is not None:  # without a tag llama.cpp compares bits with the model file's; the re-implementation with 0
        assert lc_find_best_sibling(sorted(REPO), model, keyword, tag) == expected


def test_a_sibling_in_the_models_own_folder_beats_one_above_it_and_one_beside_it_is_never_taken():
    files = ["mtp-X-Q8_0.gguf", "Q8/X-Q8_0.gguf", "Q8/mtp-X-Q4_0.gguf", "other/mtp-X-Q8_0.gguf"]
    assert pick_sibling(files, "Q8/X-Q8_0.gguf", "mtp-", "Q8_0") == "Q8/mtp-X-Q4_0.gguf"  # deeper beats exact
    assert pick_sibling(files[:1] + files[3:], "Q8/X-Q8_0.gguf", "mtp-", "Q8_0") == "mtp-X-Q8_0.gguf"
    assert pick_sibling(["other/mtp-X-Q8_0.gguf"], "X-Q8_0.gguf", "mtp-", "Q8_0") is None


def test_random_repositories_resolve_like_the_independent_llama_cpp_reimplementation():
    rng = random.Random(1234)
    tags = ["Q4_K_M", "Q8_0", "Q6_K", "BF16", "F16", "Q4_0", "Q5_K_S", "IQ4_XS"]
    checked = 0
    for _ in range(800):
        names = set()
        for _ in range(rng.randint(1, 9)):
            folder = rng.choice(["", "", "sub/", "sub/deep/"])
            prefix = rng.choice(["", "", "mtp-", "eagle3-", "dflash-", "mmproj-"])
            sep = rng.choice(["-", "-", "."])
            stem = f"{prefix}Model{sep}{rng.choice(tags)}"
            count = rng.choice([1, 1, 1, 2, 3])
            if count == 1:
                names.add(f"{folder}{stem}.gguf")
            else:
                names.update(f"{folder}{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))
        files = sorted(names)
        tag = rng.choice(tags)
        model = pick_model(files, tag)
        assert model == lc_find_best_model(files, tag), files
        if model is None:
            continue
        for keyword in DRAFT_KEYWORDS.values():
            assert pick_sibling(files, model, keyword, tag) == lc_find_best_sibling(files, model, keyword, tag), files
            checked += 1
    print(f"{checked} sibling choices agree with the re-implementation")
    assert checked > 300
