"""Hostile files of the families added after the first validation set (tests/robustness/test_hostile_files.py):
hy_v3, step35, mimo2, glm-dsa, deepseek32, DFlash / DFlash2 drafters, GLM-4.7-Flash, EAGLE-3 over
Qwen3, Qwen3 / Qwen3-MoE. Each rule of runtime/validate.py and of the graphs' checks has a crafted
file (a valid seed from tools/fuzz_seeds.py edited as a document) that must give a one-line
SpecconvError naming the file and the key or tensor; and every tensor any graph loads has an
expected shape (a graph without shape rules fails here).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGUFValueType as V

from tests.fixtures.paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))

from fuzz_mutate import Doc  # noqa: E402

from tests.fixtures.hostile import load, refused, set_kv, tensor  # noqa: E402

torch.set_num_threads(1)
FAMILIES = ["hy_v3-embed", "step35-embed", "mimo2-embed", "glm-dsa-embed", "deepseek32-embed", "dflash", "dflash2",
            "glm47flash-embed", "eagle3-qwen3", "qwen3", "qwen3moe"]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    from fuzz_seeds import build_seeds

    return build_seeds(tmp_path_factory.mktemp("seeds"), FAMILIES)


def path_of(seeds, file: str) -> Path:
    return next(p for _, paths in seeds.values() for p in paths if p.name == file)


def edited(seeds, file: str, tmp_path: Path, edit) -> Path:
    doc = Doc.parse(path_of(seeds, file))
    edit(doc)
    out = tmp_path / file
    out.write_bytes(doc.to_bytes())
    return out


def array(doc: Doc, key: str, values, sub=V.UINT32) -> None:
    set_kv(doc, key, list(values), V.ARRAY, sub)


def dims(name: str, new):
    return lambda d: setattr(tensor(d, name), "dims", list(new))


def drop(name: str):
    return lambda d: d.tensors.remove(tensor(d, name))


def kv(key: str, value, vtype=None):
    return lambda d: set_kv(d, key, value, vtype)


def both(key1: str, key2: str, value):
    return lambda d: (set_kv(d, key1, value), set_kv(d, key2, value))


def target_of(seeds, seed: str):
    return load(seeds[seed][1][0])


# ---- coverage: every graph and every tensor it loads ------------------------------------------------

def test_every_graph_has_shape_rules():
    """Every graph states the shapes of its tensors (Graph.expected_shapes, from its family's table)."""
    from specconv.runtime.graphs import graph_for, supported_archs

    missing = sorted(a for a in supported_archs() if not callable(graph_for(a).expected_shapes))
    assert not missing, f"graphs without expected tensor shapes: {missing}"


def test_every_loaded_tensor_has_an_expected_shape(tmp_path_factory):
    """Each seed of every family, loaded as the fuzzer runs it: every tensor its graphs need has a
    rule (its family's tensor table), and the seed passes them."""
    from fuzz_seeds import SEEDS, build_seeds

    from specconv.runtime.graphs import supported_archs

    built = build_seeds(tmp_path_factory.mktemp("all"), list(SEEDS))
    covered = set()
    for name, (kind, paths) in built.items():
        target = load(paths[0])
        models = [target] + ([load(paths[1], share_from=target)] if len(paths) > 1 else [])
        for m in models:
            needed = m._needed()
            expected = m.graph.expected_shapes(m.hparams)
            without = [n for n in needed if n not in expected]
            assert not without, f"{name}: {m.paths[0].name} ({m.hparams.arch}) loads tensors without a shape rule: {without[:5]}"
            covered.add(m.hparams.arch)
    print(f"every needed tensor has a shape rule, arches loaded: {sorted(covered)}")
    assert covered == set(supported_archs())


# ---- per-layer arrays (validate.check_kv) --------------------------------------------------------------

def test_step35_head_count_is_a_per_layer_array(seeds, tmp_path):
    f = "step35-embed.gguf"
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "step35.attention.head_count", [4, 6, 6, 4, 6])),
            "KV step35.attention.head_count has 5 entries for block_count 6")
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "step35.attention.head_count", [4, 0, 6, 4, 6, 4])),
            "KV step35.attention.head_count = 0 is outside")
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "step35.attention.head_count_kv", [2, 4, 2, 2, 2, 2])),
            "KV step35.attention.head_count 6 is not a multiple of head_count_kv 4 (block 1)")
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "step35.swiglu_clamp_exp", [0.0, float("nan")] + [0.0] * 4,
                                                      V.FLOAT32)), "KV step35.swiglu_clamp_exp = nan is outside")
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "step35.swiglu_clamp_shexp", [0.0] * 3, V.FLOAT32)),
            "KV step35.swiglu_clamp_shexp has 3 entries for block_count 6")


def test_mimo2_head_count_kv_is_a_per_layer_array(seeds, tmp_path):
    f = "mimo2-embed.gguf"
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "mimo2.attention.head_count_kv", [1, 2, 2, 2, 2, 2, 2])),
            "KV mimo2.attention.head_count_kv has 7 entries for block_count 6")
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "mimo2.attention.head_count_kv", [1, 2, 3, 2, 2, 2])),
            "KV mimo2.attention.head_count 4 is not a multiple of head_count_kv 3 (block 2)")
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "mimo2.attention.head_count_kv", [1.0] * 6, V.FLOAT32)),
            "KV mimo2.attention.head_count_kv must be an integer")
    refused(edited(seeds, f, tmp_path, lambda d: array(d, "mimo2.attention.head_count", [4] * 6)),
            "KV mimo2.attention.head_count: the mimo2 graph needs one value, found an array")


def test_hy_v3_takes_one_kv_head_count(seeds, tmp_path):
    refused(edited(seeds, "hy_v3-embed.gguf", tmp_path, lambda d: array(d, "hy_v3.attention.head_count_kv", [2] * 6)),
            "KV hy_v3.attention.head_count_kv: the hy_v3 graph needs one value, found an array")
    refused(edited(seeds, "hy_v3-embed.gguf", tmp_path, kv("hy_v3.attention.head_count_kv", 3)),
            "KV hy_v3.attention.head_count 4 is not a multiple of head_count_kv 3")


def test_dsa_indexer_keys(seeds, tmp_path):
    refused(edited(seeds, "glm-dsa-embed.gguf", tmp_path, kv("glm-dsa.attention.indexer.top_k", 0)),
            "KV glm-dsa.attention.indexer.top_k = 0 is outside")
    refused(edited(seeds, "deepseek32-embed.gguf", tmp_path,
                   kv("deepseek32.attention.indexer.head_count", b"8", V.STRING)),
            "KV deepseek32.attention.indexer.head_count must be an integer")
    refused(edited(seeds, "glm-dsa-embed.gguf", tmp_path, kv("glm-dsa.attention.indexer.types", 1, V.UINT32)),
            "KV glm-dsa.attention.indexer.types must be an array")


def test_dflash_keys_checked_before_use(seeds, tmp_path):
    refused(edited(seeds, "dflash-qwen3.gguf", tmp_path, kv("dflash.block_size", b"8", V.STRING)),
            "KV dflash.block_size must be an integer")
    refused(edited(seeds, "dflash2-qwen3.gguf", tmp_path, kv("dflash.conv_kernel_size", 1 << 20)),
            "KV dflash.conv_kernel_size = 1048576 is outside")
    refused(edited(seeds, "dflash-qwen3.gguf", tmp_path, kv("tokenizer.ggml.mask_token_id", b"509", V.STRING)),
            "KV tokenizer.ggml.mask_token_id must be an integer")
    refused(edited(seeds, "dflash-qwen3.gguf", tmp_path, kv("dflash.attention.head_count_kv", 3)),
            "KV dflash.attention.head_count 4 is not a multiple of head_count_kv 3")


# ---- expected shapes and tensor sets (the families' tables and the graphs' checks) -----------------

@pytest.mark.parametrize("file, edit, words", [
    ("hy_v3-embed.gguf", dims("blk.0.attn_q.weight", [96, 64]), ["tensor blk.0.attn_q.weight has the wrong shape",
                                                                 "expected [64, 96]"]),
    ("hy_v3-embed.gguf", dims("blk.1.ffn_gate_exps.weight", [32, 64, 8]), ["tensor blk.1.ffn_gate_exps.weight"]),
    ("hy_v3-embed.gguf", both("hy_v3.attention.key_length", "hy_v3.attention.value_length", 12),
     ["tensor blk.0.attn_q.weight has the wrong shape"]),
    ("step35-embed.gguf", dims("blk.1.attn_gate.weight", [6, 64]), ["tensor blk.1.attn_gate.weight", "expected [64, 6]"]),
    ("step35-embed.gguf", dims("blk.1.ffn_down_shexp.weight", [64, 48]), ["tensor blk.1.ffn_down_shexp.weight"]),
    ("mimo2-embed.gguf", kv("mimo2.attention.value_length", 8), ["has the wrong shape"]),
    ("mimo2-embed.gguf", dims("blk.3.attn_qkv.weight", [176, 64]), ["tensor blk.3.attn_qkv.weight"]),
    ("mimo2-embed.gguf", dims("blk.1.attn_sinks.weight", [2, 2]), ["tensor blk.1.attn_sinks.weight", "expected [4]"]),
    ("glm-dsa-embed.gguf", dims("blk.0.indexer.attn_q_b.weight", [512, 48]), ["tensor blk.0.indexer.attn_q_b.weight"]),
    ("glm-dsa-embed.gguf", dims("blk.1.indexer.proj.weight", [8, 64]), ["tensor blk.1.indexer.proj.weight"]),
    ("deepseek32-embed.gguf", dims("blk.0.indexer.k_norm.bias", [32, 2]), ["tensor blk.0.indexer.k_norm.bias"]),
    ("deepseek32-embed.gguf", dims("blk.0.attn_kv_a_mqa.weight", [40, 64]), ["tensor blk.0.attn_kv_a_mqa.weight"]),
    ("glm47flash-embed.gguf", dims("blk.0.attn_output.weight", [64, 48]), ["tensor blk.0.attn_output.weight"]),
    ("qwen3.gguf", dims("blk.0.attn_q.weight", [128, 64]), ["tensor blk.0.attn_q.weight"]),
    ("qwen3moe.gguf", dims("blk.0.ffn_up_exps.weight", [16, 64, 8]), ["tensor blk.0.ffn_up_exps.weight"]),
])
def test_wrong_shapes(seeds, tmp_path, file, edit, words):
    refused(edited(seeds, file, tmp_path, edit), *words)


@pytest.mark.parametrize("file, edit, words", [
    ("hy_v3-embed.gguf", drop("blk.1.exp_probs_b"), ["missing tensor blk.1.exp_probs_b", "router"]),
    ("hy_v3-embed.gguf", drop("blk.1.ffn_up_shexp.weight"), ["missing tensor blk.1.ffn_up_shexp.weight"]),
    ("step35-embed.gguf", drop("blk.0.ffn_up.weight"), ["missing tensor blk.0.ffn_up.weight", "dense FFN"]),
    ("step35-embed.gguf", drop("blk.2.ffn_down_exps.weight"), ["missing tensor blk.2.ffn_down_exps.weight"]),
    ("mimo2-embed.gguf", drop("blk.1.attn_q.weight"), ["missing tensor blk.1.attn_qkv.weight (or blk.1.attn_q/k/v"]),
    ("mimo2-embed.gguf", drop("blk.2.ffn_gate_exps.weight"), ["missing tensor blk.2.ffn_gate_exps.weight"]),
])
def test_blocks_hold_a_whole_ffn(seeds, tmp_path, file, edit, words):
    refused(edited(seeds, file, tmp_path, edit), *words)


@pytest.mark.parametrize("file, edit, words", [
    ("hy_v3-embed.gguf", kv("hy_v3.expert_used_count", 9), ["hy_v3.expert_used_count 9 must be within 1.."]),
    ("step35-embed.gguf", kv("step35.expert_used_count", 0), ["step35.expert_used_count 0 must be within 1..8"]),
    ("mimo2-embed.gguf", kv("mimo2.expert_group_count", 3), ["mimo2: 3 expert groups", "of the 8 experts"]),
    ("mimo2-embed.gguf", kv("mimo2.expert_group_used_count", 4), ["mimo2: 2 expert groups (4 used)"]),
    ("glm-dsa-embed.gguf", kv("glm-dsa.expert_used_count", 9), ["glm-dsa.expert_used_count 9 must be within 1.."]),
    ("deepseek32-embed.gguf", kv("deepseek32.rope.dimension_count", 7),
     ["deepseek32: attention.key_length_mla 24 must exceed an even rope.dimension_count 7"]),
    ("step35-embed.gguf", kv("step35.rope.dimension_count_swa", 9), ["step35.rope.dimension_count_swa 9 must be even"]),
    ("step35-embed.gguf", kv("step35.rope.dimension_count", 10),
     ["half of step35.rope.dimension_count", "5 must be even"]),
    ("mimo2-embed.gguf", kv("mimo2.rope.dimension_count", 26), ["rope.dimension_count 26 must be even and at most"]),
    ("hy_v3-embed.gguf", both("hy_v3.attention.key_length", "hy_v3.attention.value_length", 25),
     ["hy_v3.attention.key_length (all of it is roped) 25 must be even"]),
    ("dflash-qwen3.gguf", kv("dflash.rope.dimension_count", 18), ["dflash.rope.dimension_count 18"]),
])
def test_hparams_consistency(seeds, tmp_path, file, edit, words):
    refused(edited(seeds, file, tmp_path, edit), *words)


def test_dflash_shapes_and_selector(seeds, tmp_path):
    f1, f2 = "dflash-qwen3.gguf", "dflash2-qwen3.gguf"
    refused(edited(seeds, f1, tmp_path, lambda d: array(d, "dflash.target_layers", [1, 3], V.INT32)),
            "tensor fc.weight has the wrong shape: expected [128, 64], found [192, 64]")
    refused(edited(seeds, f1, tmp_path, dims("blk.1.ffn_gate.weight", [96, 64])), "tensor blk.1.ffn_gate.weight")
    refused(edited(seeds, f2, tmp_path, dims("blk.0.attn_conv_proj.weight", [16, 64])),
            "tensor blk.0.attn_conv_proj.weight", "expected [64, 16]")
    refused(edited(seeds, f2, tmp_path, dims("blk.1.ffn_conv_base", [2, 64, 2])), "tensor blk.1.ffn_conv_base")
    refused(edited(seeds, f2, tmp_path, dims("selector_hidden.weight", [8, 64])), "tensor selector_hidden.weight")
    refused(edited(seeds, f2, tmp_path, kv("dflash.selector_top_k", 600)),
            "dflash.selector_top_k 600 exceeds the 512 tokens of selector_successor.weight")


def test_eagle3_over_qwen3_shapes(seeds, tmp_path):
    target = target_of(seeds, "eagle3-qwen3")
    refused(edited(seeds, "eagle3-qwen3.gguf", tmp_path, dims("fc.weight", [64, 192])), "tensor fc.weight",
            share_from=target)


def test_valid_seeds_still_load(seeds):
    """The rules refuse nothing the converter writes (the fuzzer's seeds of these families)."""
    for name, (_, paths) in seeds.items():
        target = load(paths[0])
        if len(paths) > 1:
            load(paths[1], share_from=target)


def test_dflash2_selector_rows_match_the_shared_vocabulary(seeds, tmp_path):
    """A DFlash2 file without its own embedding, output and token list drafts from the target's
    vocabulary: its selector, indexed by those token ids, must have a row for each (else a candidate
    indexes past it). With its own token list the file's validation already compares the two."""
    from specconv.archs.errors import SpecconvError
    from specconv.runtime.drafters.dflash import check_drafter_fits_target

    target = target_of(seeds, "dflash2")
    file = "dflash2-qwen3.gguf"
    rank = int(load(path_of(seeds, file), share_from=target).hparams.selector_rank)

    def shrink_selector_and_share(doc):
        for name in ("token_embd.weight", "output.weight"):
            if any(t.name == name for t in doc.tensors):
                drop(name)(doc)
        for name in ("selector_successor.weight", "selector_predecessor.weight"):
            dims(name, [rank, target.vocab_size - 12])(doc)
        doc.kvs = [e for e in doc.kvs if not e.key.startswith("tokenizer.ggml.") or e.key.endswith("mask_token_id")]

    head = load(edited(seeds, file, tmp_path, shrink_selector_and_share), share_from=target)
    with pytest.raises(SpecconvError) as info:
        check_drafter_fits_target(target, head)
    msg = str(info.value)
    print(msg)
    assert "\n" not in msg and file in msg and f"{target.vocab_size - 12} token rows" in msg, msg
    check_drafter_fits_target(target, load(path_of(seeds, file), share_from=target))  # the seed itself fits
