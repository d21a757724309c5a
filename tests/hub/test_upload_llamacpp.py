"""Re-split shards load in llama.cpp (llama-cpp-python 0.3.36) and compute what the unsplit file does.

llama.cpp is given shard 1 and finds the siblings by name (docs/reference/gguf-layout.md §5); the logits must be
bit-identical because the tensor bytes are.
"""

from __future__ import annotations

import numpy as np

from specconv.hub.plan import build_plan
from specconv.hub.staging import stage
from tests.fixtures.hub.ggufs import write_tiny_llama_gguf
from tests.fixtures.peers import llama_logits, require_llama_cpp


def test_resplit_shards_load_in_llama_cpp_with_identical_logits(tmp_path):
    require_llama_cpp()
    folder = tmp_path / "out"
    folder.mkdir()
    src = write_tiny_llama_gguf(folder / "tiny.gguf")
    size = src.stat().st_size
    plan = build_plan(folder, repo_id="me/Tiny-Llama-GGUF", max_file_size=size // 3)
    (art,) = plan.artifacts
    stage(plan)
    shards = [f.staged for f in art.files]
    print(f"source {size} bytes -> {len(shards)} shards {[p.stat().st_size for p in shards]}")
    assert len(shards) >= 3 and all(p.stat().st_size <= size // 3 for p in shards)

    ids = [1, 300, 17, 42, 301, 250, 99, 305]
    reference = llama_logits(src, ids)
    from_shards = llama_logits(shards[0], ids)
    diff = float(np.max(np.abs(reference - from_shards)))
    print(f"llama.cpp logits, unsplit vs {len(shards)} shards: max |dlogit| = {diff}")
    assert reference.shape == (len(ids), 320) and np.isfinite(reference).all()
    assert np.std(reference) > 0.1  # a real forward, not a constant
    assert diff == 0.0
