"""Repository naming: Hub-accepted ids and paths, quant tags, and llama.cpp's -hf file resolution.

llama.cpp's resolver (common/download.cpp at the pinned commit, docs/reference/hub.md §1.2) is
re-implemented from its source in tests/fixtures/hub/llamacpp_rules.py as small pure functions, independently of specconv's naming
code, and the names specconv produces are run through it.
"""

from __future__ import annotations


import gguf
import pytest

from specconv.errors import SpecconvError
from specconv.hub.naming import (
    Role,
    file_type_tag,
    parse_size,
    repo_file_name,
    shard_paths,
    validate_repo_id,
    validate_repo_path,
    validate_revision,
)
from tests.fixtures.hub.llamacpp_rules import lc_find_best_model, lc_find_best_sibling, lc_is_model, lc_split_index



def test_quant_tags_follow_the_gguf_file_type_enum():
    # values from the GGUF spec's llama_ftype table
    assert file_type_tag(0) == "F32"
    assert file_type_tag(1) == "F16"
    assert file_type_tag(7) == "Q8_0"
    assert file_type_tag(15) == "Q4_K_M"
    assert file_type_tag(32) == "BF16"
    assert file_type_tag(int(gguf.LlamaFileType.GUESSED)) is None
    assert file_type_tag(99999) is None


def test_file_names_keep_the_quant_tag_last_and_prefix_drafts():
    assert repo_file_name("Qwen3.5-9B", "Q8_0", Role.TRUNK) == "Qwen3.5-9B-Q8_0.gguf"
    assert repo_file_name("Qwen3.5-9B", "Q8_0", Role.EMBEDDED) == "Qwen3.5-9B-Q8_0.gguf"
    assert repo_file_name("Qwen3.5-9B", "Q8_0", Role.SIDECAR) == "mtp-Qwen3.5-9B-Q8_0.gguf"
    assert repo_file_name("gemma-4", "BF16", Role.ASSISTANT) == "mtp-gemma-4-assistant-BF16.gguf"
    assert repo_file_name("Llama", "F16", Role.EAGLE3) == "eagle3-Llama-F16.gguf"
    with pytest.raises(SpecconvError, match="mtp-"):
        repo_file_name("my-mtp-model", "Q8_0", Role.TRUNK)
    with pytest.raises(SpecconvError, match="quant tag"):
        repo_file_name("X", "q8_0", Role.TRUNK)


@pytest.mark.parametrize("tag", ["Q8_0", "BF16", "Q4_K_M", "F16"])
def test_llama_cpp_resolves_the_model_and_its_sidecar(tag):
    trunk = repo_file_name("Qwen3.5-9B", tag, Role.TRUNK)
    sidecar = repo_file_name("Qwen3.5-9B", tag, Role.SIDECAR)
    other = repo_file_name("Qwen3.5-9B", "Q4_0", Role.TRUNK)
    other_side = repo_file_name("Qwen3.5-9B", "Q4_0", Role.SIDECAR)
    files = sorted(["README.md", other_side, sidecar, other, trunk])
    assert lc_find_best_model(files, tag) == trunk
    assert not lc_is_model(sidecar)
    assert lc_find_best_sibling(files, trunk, "mtp-", tag) == sidecar


def test_llama_cpp_picks_shard_one_and_finds_a_root_sidecar_for_a_split_model():
    trunk = repo_file_name("Qwen3.5-397B", "Q8_0", Role.TRUNK)
    shards = shard_paths(trunk, 3, Role.TRUNK)
    assert shards == [
        "Qwen3.5-397B-Q8_0/Qwen3.5-397B-Q8_0-00001-of-00003.gguf",
        "Qwen3.5-397B-Q8_0/Qwen3.5-397B-Q8_0-00002-of-00003.gguf",
        "Qwen3.5-397B-Q8_0/Qwen3.5-397B-Q8_0-00003-of-00003.gguf",
    ]
    sidecar = repo_file_name("Qwen3.5-397B", "Q8_0", Role.SIDECAR)
    files = sorted(shards[::-1] + [sidecar, "mtp-Qwen3.5-397B-Q4_0.gguf"])
    model = lc_find_best_model(files, "Q8_0")
    assert model == shards[0]
    assert lc_find_best_sibling(files, model, "mtp-", "Q8_0") == sidecar
    # drafts stay at the root even when split, so discovery (model folder or ancestors) still sees them
    side_shards = shard_paths(sidecar, 2, Role.SIDECAR)
    assert all("/" not in p for p in side_shards)
    assert lc_find_best_sibling(side_shards + shards, model, "mtp-", "Q8_0") in side_shards


@pytest.mark.parametrize("repo", ["me/Tiny-GGUF", "team/qwen3.5_9b-mtp.GGUF", "a/b"])
def test_valid_repo_ids(repo):
    assert validate_repo_id(repo) == repo


@pytest.mark.parametrize(
    "repo",
    ["noslash", "a/b/c", "../x", "me/..", "me/a--b", "me/a..b", "me/x.git", "me/-x", "me/x y", "/x", "me/" + "a" * 97, ""],
)
def test_repo_ids_the_hub_rejects_are_refused(repo):
    with pytest.raises(SpecconvError):
        validate_repo_id(repo)


@pytest.mark.parametrize(
    "path", ["../x.gguf", "a/../../x", "/etc/passwd", "a//b", ".git/config", "a\\b.gguf", "x y.gguf", "./a", "", "a/.git/x"]
)
def test_repo_paths_with_traversal_or_odd_characters_are_refused(path):
    with pytest.raises(SpecconvError, match="refusing"):
        validate_repo_path(path)


def test_revisions():
    assert validate_revision("refs/pr/3") == "refs/pr/3"
    assert validate_revision("dev/q8") == "dev/q8"
    for bad in ["../main", "a b", "x.lock", "-x", "a//b"]:
        with pytest.raises(SpecconvError):
            validate_revision(bad)


def test_sizes_use_decimal_units_like_gguf_split():
    assert parse_size("50G") == 50 * 10**9
    assert parse_size("48GB") == 48 * 10**9
    assert parse_size("1.5M") == 1_500_000
    assert parse_size("4096") == 4096
    for bad in ["", "G", "-1G", "0", "5X"]:
        with pytest.raises(SpecconvError):
            parse_size(bad)


def test_shard_names_match_gguf_py_and_llama_cpp():
    # gguf-py's own writer names shards with SHARD_NAME_FORMAT; llama.cpp parses the same pattern
    assert shard_paths("M-Q8_0.gguf", 2, Role.TRUNK)[1].endswith(gguf.SHARD_NAME_FORMAT.format("M-Q8_0", 2, 2))
    for p in shard_paths("M-Q8_0.gguf", 12, Role.TRUNK):
        index, count = lc_split_index(p)
        assert count == 12 and 1 <= index <= 12
