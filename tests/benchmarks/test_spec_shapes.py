"""benchmarks/spec_shapes.py on one small shape: the checkpoint built and converted, spec_scale's
measurement run on it, the table row consistent, and the docs section written between its own markers.

Evidence: t(1) for both runtimes, t(4)/t(1) > 0, the synthetic drafter's tokens equal to plain decoding,
the speed-up below its bound's ceiling of k + 1 tokens per forward; a second write replaces the section.
"""

from __future__ import annotations

from benchmarks import spec_shapes

from tests.fixtures.peers import require_llama_cpp


def test_one_small_shape(tmp_path, monkeypatch):
    require_llama_cpp()
    monkeypatch.setitem(spec_shapes.SHAPES, "h256-v4k", {"hidden_size": 256, "intermediate_size": 512,
                                                         "vocab_size": 4096})
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nkept\n")
    argv = ["--workdir", str(tmp_path), "--shapes", "h256-v4k", "--layers", "4", "--threads", "1", "--repeats", "1",
            "-n", "12", "--docs", str(docs)]
    [row] = spec_shapes.main(argv)
    print(row)
    assert row["hidden"] == 256 and row["vocab"] == 4096 and row["blocks"] == 4
    assert row["t1_ms"] > 0 and row["llama_t1_ms"] > 0 and row["t4_t1"] > 0 and row["llama_t4_t1"] > 0
    assert row["exact"] is True
    assert 0 < row["speedup"] < 4 + 1
    spec_shapes.main(argv)
    text = docs.read_text()
    assert text.count(spec_shapes.BEGIN) == 1 and "kept" in text and "| h256-v4k (4 blocks) |" in text
