"""The conversion benchmark's untimed parts: the generated checkpoint, the ratios, the docs section."""

from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from benchmarks import convert as bench
from benchmarks import convert_report
from tools.synth_qwen35 import write_checkpoint

SMALL = dict(hidden_size=256, intermediate_size=512, vocab_size=4096)


def test_generated_checkpoint_is_a_sharded_release_layout(tmp_path):
    out = write_checkpoint(tmp_path / "c", n_layers=4, seed=3, shard_bytes=4_000_000, **SMALL)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    total, names = 0, set()
    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert index["weight_map"][name] == shard and str(t.dtype) == "torch.bfloat16"
                if t.dim() == 2:
                    assert t.float().std() > 0  # random, not a constant fill
                total += t.numel() * 2
                names.add(name)
    assert index["metadata"]["total_size"] == total
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = config["text_config"]
    assert text["linear_num_value_heads"] == 2 * text["linear_num_key_heads"]  # V-head re-tiling is exercised
    assert "lm_head.weight" in names and "mtp.fc.weight" in names
    assert any(n.startswith("mtp.layers.0.self_attn.") for n in names)
    assert {n.split(".")[3] for n in names if n.startswith("model.language_model.layers.")} == {"0", "1", "2", "3"}


def test_checkpoint_is_written_once_and_reused(tmp_path):
    out = write_checkpoint(tmp_path / "c", n_layers=4, **SMALL)
    stamp = os.stat(next(out.glob("*.safetensors"))).st_mtime_ns
    assert write_checkpoint(tmp_path / "c", n_layers=4, **SMALL) == out
    assert os.stat(next(out.glob("*.safetensors"))).st_mtime_ns == stamp
    write_checkpoint(tmp_path / "c", n_layers=8, **SMALL)  # other parameters: regenerated
    assert json.loads((out / "synth.json").read_text())["n_layers"] == 8


def test_size_target_picks_enough_layers():
    from tools.synth_qwen35 import layers_for, tensor_shapes, text_config

    n = layers_for(30_000_000, **SMALL)
    size = lambda layers: sum(2 * __import__("math").prod(s)  # noqa: E731
                              for s in tensor_shapes(text_config(n_layers=layers, **SMALL)).values())
    assert n % 4 == 0 and size(n) >= 30_000_000 > size(n - 4)


def _run(wall, rss):
    return {"wall_s": wall, "peak_rss_bytes": rss}


def test_medians_and_ratios():
    ours = bench.summary([_run(3.0, 300), _run(2.0, 100), _run(5.0, 200)])
    assert (ours["wall_s"], ours["wall_min"], ours["wall_max"], ours["rss_bytes"]) == (3.0, 2.0, 5.0, 200)
    row = {"ours": ours, "llama.cpp": bench.summary([_run(12.0, 800)]), "floor": bench.summary([_run(2.0, 10)])}
    r = bench.ratios(row)
    assert r == {"speedup_vs_llama": 4.0, "rss_vs_llama": 0.25, "time_vs_floor": 1.5}
    assert bench.ratios({"ours": ours}) == {}


def test_report_rewrites_only_its_own_section(tmp_path):
    docs = tmp_path
    other = "<!-- BEGIN spec_decode: x -->\nspec table\n<!-- END spec_decode -->\n"
    (docs / "benchmarks.md").write_text("# Benchmarks\n\n" + other)
    res = {"date": "2026-01-01", "machine": {"cores": 2, "memory_gb": 24, "python": "3.11", "torch": "2"},
           "repeats": 3, "threads": 0,
           "checkpoint": {"bytes": 2.2e9, "shards": 5, "layers": 32, "hidden": 1024, "vocab": 248320, "mtp_layers": 1},
           "rows": {"bf16": {"ours": bench.summary([_run(5.0, 3e8)]), "llama.cpp": bench.summary([_run(20.0, 1.4e9)]),
                             "floor": bench.summary([_run(4.0, 3e7)]),
                             "tensors": {"identical": 71, "same_type": 71, "same_order": True}}}}
    res["rows"]["bf16"]["ratios"] = bench.ratios(res["rows"]["bf16"])
    convert_report.write(res, docs)
    first = (docs / "benchmarks.md").read_text()
    assert other in first and "| bf16 | 4.00× | 0.21× | 1.25× | 71 of 71 (same order: yes) |" in first
    res["rows"]["bf16"]["ours"] = bench.summary([_run(10.0, 3e8)])
    res["rows"]["bf16"]["ratios"] = bench.ratios(res["rows"]["bf16"])
    convert_report.write(res, docs)
    second = (docs / "benchmarks.md").read_text()
    assert other in second and second.count(convert_report.BEGIN) == 1 and "| bf16 | 2.00× |" in second
    assert json.loads((docs / "convert_benchmark.json").read_text())["rows"]["bf16"]["ours"]["wall_s"] == 10.0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the tree sampler reads /proc")
def test_peak_rss_launcher_sees_a_child_allocation(tmp_path):
    """tools/peak_rss.py reports a 200 MB allocation of its child, and the child's exit code."""
    import subprocess
    import sys

    result = tmp_path / "r.json"
    code = "import time; b = bytearray(200_000_000); time.sleep(0.3)"
    subprocess.run([sys.executable, str(bench.ROOT / "tools" / "peak_rss.py"), str(result), "--",
                    sys.executable, "-c", code], check=True)
    r = json.loads(result.read_text())
    assert r["returncode"] == 0 and 200e6 <= r["peak_rss_bytes"] < 300e6 and r["wall_s"] >= 0.3
