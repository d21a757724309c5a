"""Converting Qwen3-Next streams like the other plugins: peak memory does not grow with the model, and
the time per byte is that of a Qwen3.5-MoE checkpoint of the same size.

Two random bf16 Qwen3-Next checkpoints in the release layout (per-expert tensors, an MTP layer), 4 and
16 layers, names and shapes from transformers' own model on the meta device; each is converted by
`specconv convert` in its own process and its peak resident set read by tools/peak_rss.py, as
tests/convert/test_memory.py does for Qwen3.5. The fused `in_proj_qkvz` split is the largest tensor a
transform copies (its parts are gathered per key head).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.fixtures.peak_memory import MB, THREADS, bytes_on_disk, peak_rss


torch.set_num_threads(1)
SHAPES = dict(hidden_size=512, vocab_size=16384, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
              intermediate_size=1024)


def write_checkpoint(out: Path, n_layers: int, seed: int) -> Path:
    """Random bf16 Qwen3-Next release-layout checkpoint (one file) + a small tokenizer."""
    from safetensors.torch import save_file
    from transformers import Qwen3NextConfig

    from tests.fixtures.tiny_qwen3next import release_config, release_shapes
    from tests.fixtures.tokenizer import train_tokenizer

    cfg = Qwen3NextConfig(num_hidden_layers=n_layers, **SHAPES)
    gen = torch.Generator().manual_seed(seed)
    tensors = release_shapes(cfg)
    data = {n: (torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16) for n, s in tensors.items()}
    out.mkdir(parents=True)
    save_file(data, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**cfg.to_dict(), "architectures": ["Qwen3NextForCausalLM"]}
    (out / "config.json").write_text(json.dumps(release_config(config)))
    train_tokenizer(out, vocab_size=509)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("q3nmem")
    return {n: write_checkpoint(root / f"l{n}", n, n) for n in (4, 16)}


def _largest_qkvz(folder: Path) -> int:
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return max(m["data_offsets"][1] - m["data_offsets"][0] for n, m in header.items() if "in_proj_qkvz" in n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="wait4 rusage semantics are Linux's")
def test_peak_memory_is_independent_of_model_size(checkpoints, tmp_path):
    small, large = checkpoints[4], checkpoints[16]
    common = ["--outtype", "bf16", "--threads", str(THREADS), "--force", "--json"]
    baseline = peak_rss(["convert", str(large), "-o", str(tmp_path / "dry.gguf"), *common, "--dry-run"], tmp_path)
    peaks = {}
    for name, src in (("small", small), ("large", large)):
        peaks[name] = peak_rss(["convert", str(src), "-o", str(tmp_path / f"{name}.gguf"), *common], tmp_path)
    grown = bytes_on_disk(large) - bytes_on_disk(small)
    bound = 32 * MB + THREADS * 12 * MB + 2 * _largest_qkvz(large)
    print(f"qwen3next bf16: checkpoints {bytes_on_disk(small) / MB:.0f} MB and {bytes_on_disk(large) / MB:.0f} MB; "
          f"peak RSS dry-run {baseline / MB:.0f} MB, small {peaks['small'] / MB:.0f} MB, large "
          f"{peaks['large'] / MB:.0f} MB; stated bound over the dry run {bound / MB:.0f} MB")
    assert peaks["large"] - peaks["small"] < 0.10 * grown
    assert peaks["large"] - baseline < bound


def test_throughput_in_line_with_qwen35moe(checkpoints, tmp_path):
    """Seconds per GB of checkpoint, bf16 -> q8_0, against a Qwen3.5-MoE checkpoint of about the same
    size (tools/synth_qwen35.py); the machine is shared, so only a factor of 2 is asserted."""
    from tests.fixtures.gguf_files import convert_gguf
    from tools.synth_qwen35 import write_checkpoint as write_qwen35

    large = checkpoints[16]
    q35 = write_qwen35(tmp_path / "q35", bytes_on_disk(large), seed=1, hidden_size=512, intermediate_size=256,
                       vocab_size=16384, experts=8, experts_used=2)
    rates = {}
    for name, src in (("qwen3next", large), ("qwen35moe", q35)):
        best = float("inf")
        for i in range(2):
            start = time.perf_counter()
            convert_gguf(src, tmp_path / f"{name}{i}.gguf", outtype="q8_0", mtp="embed")
            best = min(best, time.perf_counter() - start)
        rates[name] = best / (bytes_on_disk(src) / 1e9)
    print("conversion to q8_0, seconds per GB of checkpoint (best of 2): "
          + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
    assert rates["qwen3next"] < 2 * rates["qwen35moe"]
