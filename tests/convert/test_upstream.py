"""`specconv convert` against llama.cpp's own converter (`convert_hf_to_gguf.py` of the pinned tree, an
independent writer of the same format): on the tiny fixtures the two write the very same bytes (KV,
tensor order, types and data), for every MTP layout upstream has (embedded, `--no-mtp`, `--mtp`).

Skips unless SPECCONV_LLAMA_CPP_SRC names the tree (tests/run.sh sets it; the sdist copy on the
development machine is used when present)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.gguf_files import assert_same_file_as_upstream, convert_gguf, convert_gguf_upstream


pytestmark = pytest.mark.slow

DEFAULT_TREE = Path("/work/.cache/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
UPSTREAM_FLAGS = {"embed": [], "none": ["--no-mtp"], "only": ["--mtp"]}


@pytest.fixture(autouse=True)
def _upstream_tree(monkeypatch):
    if not os.environ.get("SPECCONV_LLAMA_CPP_SRC") and (DEFAULT_TREE / "convert_hf_to_gguf.py").is_file():
        monkeypatch.setenv("SPECCONV_LLAMA_CPP_SRC", str(DEFAULT_TREE))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.fixtures.tiny_qwen35 import build_qwen35

    root = tmp_path_factory.mktemp("upstream-src")
    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            # The same folder name for every build: general.name comes from it in both converters.
            cache[key] = build_qwen35(root / f"{len(cache)}" / "Tiny", **kw)
        return cache[key]

    return get


# Each upstream run takes seconds (a fresh interpreter importing torch): a covering subset, not the full
# product (every mode x {f32, q8_0} x three checkpoint kinds, and f16/bf16/auto, were all identical once: 21 of 21).
@pytest.mark.parametrize("mode,outtype,moe,layout", [
    ("embed", "f32", False, "release"),
    ("none", "q8_0", True, "release"),
    ("only", "q8_0", True, "release"),
    ("embed", "q8_0", True, "save_pretrained"),
    ("only", "f32", False, "save_pretrained"),
    ("embed", "q8_0", True, "release-sharded"),  # shards + index: the same reading order as upstream
])
def test_same_bytes_as_llama_cpp_converter(checkpoints, tmp_path, mode, outtype, moe, layout):
    src = checkpoints(moe=moe, layout=layout.split("-")[0], sharded=layout.endswith("-sharded"))
    theirs = convert_gguf_upstream(src, tmp_path / "up.gguf", outtype=outtype, extra_args=UPSTREAM_FLAGS[mode])
    ours = convert_gguf(src, tmp_path / "ours.gguf", outtype=outtype, mtp=mode)
    assert_same_file_as_upstream(ours, theirs)


@pytest.mark.parametrize("outtype", ["bf16", "auto"])
def test_same_bytes_other_outtypes(checkpoints, tmp_path, outtype):
    src = checkpoints(moe=False, layout="release", tie=True, rope_style="top_level")
    theirs = convert_gguf_upstream(src, tmp_path / "up.gguf", outtype=outtype)
    ours = convert_gguf(src, tmp_path / "ours.gguf", outtype=outtype)
    assert_same_file_as_upstream(ours, theirs)


def test_separate_is_upstreams_two_runs(checkpoints, tmp_path):
    src = checkpoints(moe=True, layout="release")
    (tmp_path / "up").mkdir()
    trunk = convert_gguf_upstream(src, tmp_path / "up" / "m.gguf", outtype="q8_0", extra_args=["--no-mtp"])
    sidecar = convert_gguf_upstream(src, tmp_path / "up" / "mtp-m.gguf", outtype="q8_0", extra_args=["--mtp"])
    convert_gguf(src, tmp_path / "ours" / "m.gguf", outtype="q8_0", mtp="separate")
    assert_same_file_as_upstream(tmp_path / "ours" / "m.gguf", trunk)
    assert_same_file_as_upstream(tmp_path / "ours" / "mtp-m.gguf", sidecar)


def test_directory_names_match_upstream(checkpoints, tmp_path):
    """-o DIR/: the embedded file is named as upstream names it, Name-Size-TYPE.gguf, with the same bytes.
    The --mtp file is upstream's bytes under the project's one scheme (docs/reference/gguf-layout.md):
    mtp- + the name of the trunk it belongs to, size label included (upstream drops the label)."""
    src = checkpoints(moe=False, layout="release")
    for folder in ("up", "ours", "trunk"):
        (tmp_path / folder).mkdir()
    convert_gguf_upstream(src, tmp_path / "up", outtype="q8_0")
    convert_gguf_upstream(src, tmp_path / "up", outtype="q8_0", extra_args=["--mtp"])
    convert_gguf(src, str(tmp_path / "ours") + "/", outtype="q8_0", mtp="embed")
    convert_gguf(src, str(tmp_path / "ours") + "/", outtype="q8_0", mtp="only")
    convert_gguf(src, str(tmp_path / "trunk") + "/", outtype="q8_0", mtp="none")
    [up_main] = [p.name for p in (tmp_path / "up").iterdir() if not p.name.startswith("mtp-")]
    [up_mtp] = [p.name for p in (tmp_path / "up").iterdir() if p.name.startswith("mtp-")]
    [trunk] = [p.name for p in (tmp_path / "trunk").iterdir()]
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted([up_main, "mtp-" + trunk])
    print(f"upstream: {up_main}, {up_mtp}; ours: {up_main}, mtp-{trunk}")
    assert_same_file_as_upstream(tmp_path / "ours" / up_main, tmp_path / "up" / up_main)
    assert_same_file_as_upstream(tmp_path / "ours" / ("mtp-" + trunk), tmp_path / "up" / up_mtp)
