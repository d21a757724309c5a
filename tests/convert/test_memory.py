"""Peak memory of a conversion does not grow with the model: two checkpoints, 4 and 24 layers.

Both are Qwen3.5-shaped, random bf16, same tensor shapes (tools/synth_qwen35.py), so they differ
only in how many layers there are. Each is converted by `specconv convert` in its own process and
its peak resident set is read from the OS by tools/peak_rss.py (rusage of the child: its high-water
mark, which counts mapped file pages as well as heap). The baseline is a `--dry-run` of the large one: the same imports, headers,
tokenizer and metadata, no tensor data. The stated bound (docs/convert.md, "Throughput and memory")
is: baseline + 32 MB (the encoding kernels' code pages, worker stacks, allocator slack) +
(2·threads + 2) chunk buffers of ≤ 4 MB + per thread 4 MB of work buffers and a ≤ 4 MB read buffer + twice the largest
tensor a transform copies (here a re-tiled linear-attention projection). Repeated runs of one
checkpoint vary by a few MB, so the growth allowed from 4 to 24 layers is 10 % of the added weights
(mapping the weights without releasing them would add all of them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.fixtures.peak_memory import MB, THREADS, bytes_on_disk, peak_rss


SHAPES = dict(hidden_size=512, intermediate_size=1536, vocab_size=16384)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tools.synth_qwen35 import write_checkpoint

    root = tmp_path_factory.mktemp("memory")
    return {n: write_checkpoint(root / f"l{n}", n_layers=n, seed=n, **SHAPES) for n in (4, 24)}


def _largest_copied_tensor(folder: Path) -> int:
    """The largest re-tiled (copied) source tensor: the linear-attention projections."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    largest = 0
    for shard in set(index["weight_map"].values()):
        with open(folder / shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, meta in header.items():
            if "linear_attn" in name and name.endswith(".weight"):
                begin, end = meta["data_offsets"]
                largest = max(largest, end - begin)
    return largest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="wait4 rusage and madvise semantics are Linux's")
@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_peak_memory_is_independent_of_model_size(checkpoints, tmp_path, outtype):
    small, large = checkpoints[4], checkpoints[24]
    common = ["--outtype", outtype, "--threads", str(THREADS), "--force", "--json"]
    baseline = peak_rss(["convert", str(large), "-o", str(tmp_path / "dry.gguf"), *common, "--dry-run"], tmp_path)
    peaks = {}
    for name, src in (("small", small), ("large", large)):
        peaks[name] = peak_rss(["convert", str(src), "-o", str(tmp_path / f"{name}.gguf"), *common], tmp_path)
        assert (tmp_path / f"{name}.gguf").is_file()
    grown = bytes_on_disk(large) - bytes_on_disk(small)
    bound = 32 * MB + THREADS * 12 * MB + 2 * _largest_copied_tensor(large)  # per worker: read, encoded, work
    print(f"{outtype}: checkpoints {bytes_on_disk(small) / MB:.0f} MB and {bytes_on_disk(large) / MB:.0f} MB; "
          f"peak RSS dry-run {baseline / MB:.0f} MB, small {peaks['small'] / MB:.0f} MB, "
          f"large {peaks['large'] / MB:.0f} MB; stated bound over the dry run {bound / MB:.0f} MB")
    assert peaks["large"] - peaks["small"] < 0.10 * grown
    assert peaks["large"] - baseline < bound
