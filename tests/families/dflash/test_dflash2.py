"""DFlash2 drafters (z-lab `DFlash2DraftModel`: dynamic block convolutions, a candidate selector,
soft-capped scaled logits, sliding-window layers) against llama.cpp 0c1e570 (llama-cpp-python):
the converted file equals llama.cpp's converter's, and the runtime's logits, selector lattice and
walked drafts equal llama.cpp's on it (docs/dflash.md). Every measured difference is printed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters.dflash import DFlashDrafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate
from tests.fixtures import tiny_dflash as tiny
from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream
from tests.fixtures.tiny_qwen3 import gguf_contents as _read

torch.set_num_threads(1)
TOL = 1e-4
IDS, MASK, TARGETS, built, max_abs = tiny.IDS, tiny.MASK, tiny.TARGETS, tiny.built, tiny.max_abs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash2")


def _llama_dflash2(peers, t_gguf, d_gguf, features, block, pos0):
    """llama.cpp's DFlash2 block: (logits, lattice rows) — the lattice is what draft-dflash walks."""
    return peers.llama_dflash_block(t_gguf, d_gguf, tiny.as_numpy(features), block, pos0, lattice=True)


def _walk(lattice_rows, k, n):
    """llama.cpp's draft-dflash walk over packed lattice rows [cands(k) | scores(k x k)]."""
    pred, out = 0, []
    for i in range(1, n):
        row = lattice_rows[i, k + pred * k: k + (pred + 1) * k]
        pred = int(np.argmax(row))
        out.append(int(lattice_rows[i, pred]))
    return out


@pytest.mark.peer
def test_dflash2_converts_and_runs_like_llama_cpp(root, tmp_path, llama_peer):
    """DFlash2 (convolutions, candidate selector, soft-capped scaled logits, a sliding-window layer,
    is_causal false): our file equals llama.cpp converter's; llama.cpp loads it and builds the draft
    context (iSWA cache); the runtime's block logits, selector candidates and scores (aligned by token
    id: ggml's top-k is unordered) and the walked drafts equal llama.cpp's; speculative greedy output
    equals plain greedy."""
    t_dir, t_gguf, _, _ = built(root, "qwen3")
    d_dir = tiny.build_dflash(tmp_path / "d2", t_dir, layer_ids=TARGETS["qwen3"][1], mask_token_id=MASK, v2=True,
                              window=6)
    ours = convert_gguf(d_dir, tmp_path / "ours.gguf", extra_args=["--target", str(t_dir)])
    theirs = convert_gguf_upstream(d_dir, tmp_path / "theirs.gguf", pre="qwen2",
                                   extra_args=["--target-model-dir", str(t_dir)])
    kv_a, t_a = _read(ours)
    kv_b, t_b = _read(theirs)
    assert [t[:3] for t in t_a] == [t[:3] for t in t_b] and all(a[3] == b[3] for a, b in zip(t_a, t_b))
    assert kv_a == kv_b
    mask = "tokenizer.ggml.mask_token_id"
    assert [k for k in kv_a if k != mask] == [k for k in kv_b if k != mask]
    assert {"blk.0.attn_conv_base", "blk.1.ffn_conv_proj.weight", "selector_hidden.weight"} <= {t[0] for t in t_a}
    assert kv_a["dflash.selector_top_k"] == 4 and kv_a["dflash.attention.causal"] is False

    target = load_model(t_gguf, device="cpu")
    drafter = DFlashDrafter(load_model(ours, device="cpu", share_from=target), target, 64, 7)
    prefix, id_last = IDS[:-1], IDS[-1]  # 19 context rows: the window of 6 masks most of them in layer 0
    out = Context(target, GraphType.MAIN, n_ctx=64).decode(prefix, hidden=drafter.target_hidden)
    drafter.start(prefix, torch.cat([out.hidden[x] for x in drafter.target_hidden], -1))
    logits, y = drafter.block_forward(id_last)
    from specconv.runtime.graphs import dflash as graph

    cands, scores = graph.lattice(drafter.head.weights, drafter.hp, logits, y, id_last)
    ll_logits, lat = _llama_dflash2(llama_peer, t_gguf, ours, torch.cat([out.hidden[x] for x in drafter.target_hidden], -1),
                                    [id_last] + [MASK] * 7, len(prefix))
    k, worst = 4, 0.0
    for i in range(1, 8):
        ll_c, our_c = [int(c) for c in lat[i, :k]], [int(c) for c in cands[i]]
        assert sorted(ll_c) == sorted(our_c), f"row {i}: candidates differ"
        ll_s = lat[i, k:k + k * k].reshape(k, k)
        prev_ll = [id_last] if i == 1 else [int(c) for c in lat[i - 1, :k]]
        prev_ours = [id_last] if i == 1 else [int(c) for c in cands[i - 1]]
        for p in prev_ours:
            for c in our_c:
                a = float(scores[i][prev_ours.index(p), our_c.index(c)])
                worst = max(worst, abs(a - float(ll_s[prev_ll.index(p) if i > 1 else 0, ll_c.index(c)])))
    d_logits = max_abs(logits, ll_logits)
    walk = drafter.selector_walk(id_last, 7)
    print(f"\n[dflash2] {len(t_a)} tensors / {len(kv_a)} KV pairs as llama.cpp's converter writes them; runtime vs "
          f"llama.cpp: logits {d_logits:.2e}, selector scores {worst:.2e}; drafts equal: {walk == _walk(lat, k, 8)}")
    assert d_logits <= TOL and worst <= TOL and walk == _walk(lat, k, 8)
    plain = generate(target, IDS[:8], 20).tokens
    res = speculative_generate(target, build_drafter("dflash", target, n_ctx=64, draft_max=7, draft_path=ours),
                               IDS[:8], 20, SpecConfig(draft_max=7))
    assert res.tokens == plain and res.stats["speculative"]["drafted"] > 0
