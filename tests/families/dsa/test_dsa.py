"""GLM-5 (`glm-dsa`) and DeepSeek-V3.2 (`deepseek32`): conversion and llama.cpp (docs/dsa.md).

Tiny release-layout checkpoints (tests/fixtures/tiny_dsa.py) whose 40-token prompt is longer than
`index_topk` (8), so the indexer's selection decides the attention, convert in every MTP mode:

* the files hold the indexer tensors of every full layer and of the nextn block, the indexer keys,
  and (GLM) exactly what llama.cpp's own converter writes, tensor for tensor;
* llama.cpp runs them: trunk logits (one batch and token by token) within 1e-4 of transformers;
  its MTP head runs dense MLA (no indexer, src/models/glm-dsa.cpp `graph_mtp`), so it equals
  transformers' MtpModel on the rows that see ≤ index_topk keys and our runtime's dense MTP on all;
* the head-size constraint behind llama.cpp's `GGML_ASSERT(ggml_can_mul_mat(a, b))` on tiny shapes:
  the indexer head must be a power of two ≥ 64 (docs/dsa.md);
* GLM "shared" indexer layers: the per-layer list is written and both runtimes follow it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specconv.archs import SpecconvError
from specconv.runtime.gguf_reader import open_gguf
from tests.fixtures import tiny_dsa as tiny
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.paths import ROOT

torch.set_num_threads(1)
N, TOPK = tiny.N_LAYERS, tiny.TOPK
IDS = [int(x) for x in np.random.default_rng(0).integers(0, tiny.VOCAB - 6, 40)]
INDEXER = ("attn_q_b", "attn_k", "k_norm", "proj")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dsa")


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_release_layout_and_modes(root, family):
    src, files = tiny.converted(family, root)
    hf = load_file(str(src / "model.safetensors"))
    assert f"model.layers.{N}.self_attn.indexer.wk.weight" in hf and "model.layers.1.mlp.experts.0.up_proj.weight" in hf
    emb, none, only = (open_gguf(files[m]) for m in ("embed", "none", "only"))
    assert emb.arch == family and emb.block_count() == N + 1 and emb.nextn_layers() == 1
    assert none.block_count() == N and none.get(f"{family}.nextn_predict_layers") is None
    for i in range(N + 1):
        for part in INDEXER:
            assert f"blk.{i}.indexer.{part}.weight" in emb.tensors, (i, part)
        assert f"blk.{i}.indexer.k_norm.bias" in emb.tensors
    assert emb.tensors["blk.1.indexer.attn_q_b.weight"].shape[::-1] == (8 * 64, 48)
    mtp_names = {n for n in emb.tensors if n.startswith(f"blk.{N}.")}
    assert set(none.tensors) == set(emb.tensors) - mtp_names
    assert set(only.tensors) == mtp_names | {"token_embd.weight", "output_norm.weight", "output.weight"}
    g = lambda k: emb.get(f"{family}.{k}")  # noqa: E731
    assert (g("attention.indexer.head_count"), g("attention.indexer.key_length"), g("attention.indexer.top_k")) == \
        (8, 64, TOPK)
    assert g("expert_gating_func") == 2 and g("attention.key_length_mla") == 24 and g("attention.q_lora_rank") == 48
    # transformers saves `indexer_types` for GLM (all full here); llama.cpp's converter writes it then too
    assert g("attention.indexer.types") == ([True] * N if family == "glm-dsa" else None)
    sep, side = open_gguf(files["separate"]), open_gguf(files["mtp-separate"])
    for a, b in ((sep, none), (side, only)):
        assert set(a.tensors) == set(b.tensors)
        assert all(np.array_equal(a.tensors[n].raw(), b.tensors[n].raw()) for n in a.tensors)


@pytest.mark.parametrize("mode, flag", [("embed", None), ("none", "--no-mtp"), ("only", "--mtp")])
def test_glm_files_equal_llamacpp_converter(root, tmp_path, mode, flag):
    """llama.cpp's GlmMoeDsaModel converter writes the same tensors in the same order with the same
    bytes, and the same keys but `expert_gating_func` (ours explicit 2 = sigmoid; llama.cpp's glm-dsa
    loader defaults the missing key to sigmoid, so both files run alike)."""
    from tests.fixtures.gguf_files import convert_gguf_upstream
    from tests.fixtures.tiny_tools import differing_keys

    src, files = tiny.converted("glm-dsa", root)
    up = open_gguf(convert_gguf_upstream(src, tmp_path / "up.gguf", pre="glm4", extra_args=[flag] if flag else []))
    ours = open_gguf(files[mode])
    assert differing_keys(up, ours, "glm-dsa") == {"glm-dsa.expert_gating_func"}
    print(f"glm-dsa --mtp {mode}: llama.cpp's converter writes the same {len(up.tensors)} tensors and keys "
          f"(but expert_gating_func)")
    if mode == "embed":  # our runtime reads the missing key as llama.cpp does (sigmoid)
        from specconv.runtime import Context, GraphType, load_model

        run = lambda p: Context(load_model(p, device="cpu"), GraphType.MAIN, n_ctx=64).decode(IDS).logits  # noqa: E731
        assert torch.equal(run(tmp_path / "up.gguf"), run(files["embed"]))


def test_deepseek32_llamacpp_converter_needs_add_bos_token_attribute(root, tmp_path):
    """llama.cpp's DeepseekV32Model converter asserts `tokenizer.add_bos_token`; under transformers 5
    a byte-level tokenizer loads as `TokenizersBackend`, which does not carry that attribute even
    with `add_bos_token: true` in tokenizer_config.json (and a BOS-adding post-processor), so the
    converter stops there. Ours writes the file (the other tests load it in llama.cpp)."""
    from transformers import AutoTokenizer

    from tests.fixtures.gguf_files import convert_gguf_upstream

    src, _ = tiny.converted("deepseek32", root)
    assert json.loads((src / "tokenizer_config.json").read_text())["add_bos_token"] is True
    tok = AutoTokenizer.from_pretrained(str(src))
    assert tok("ab").input_ids[0] == tok.bos_token_id and not getattr(tok, "add_bos_token", False)
    with pytest.raises(AssertionError, match="add_bos_token"):
        convert_gguf_upstream(src, tmp_path / "up.gguf", pre="deepseek-v3")


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_llamacpp_trunk_and_mtp_match_transformers(root, family, llama_peer):
    src, files = tiny.converted(family, root)
    margins = tiny.hf_index_margins(src, IDS)
    assert min(margins) > 1e-4, margins  # no near-tie: the selection is well defined
    ref, hidden = tiny.hf_trunk(src, IDS)
    for mode in ("embed", "none", "separate"):
        diff = float(np.abs(llama_peer.llama_logits(files[mode], IDS) - ref).max())
        print(f"{family} llama.cpp vs transformers trunk ({mode}): max |Δlogit| = {diff:.3g}")
        assert diff < 1e-4
    one = float(np.abs(llama_peer.llama_logits(files["embed"], IDS, one_by_one=True) - ref).max())
    print(f"{family} llama.cpp token by token vs transformers: max |Δlogit| = {one:.3g}; "
          f"smallest top-k margin {min(margins):.2g}")
    assert one < 1e-4
    ref_mtp = tiny.hf_mtp_llamacpp_rows(src, IDS, hidden)
    for target, head in (("embed", None), ("separate", "mtp-separate"), ("none", "only")):
        head_path = None if head is None else files[head]
        assert llama_peer.llama_mtp_context_ok(files[target], head_path)
        got = llama_peer.llama_mtp_logits(files[target], IDS, head_path, hidden=hidden)
        rows = np.abs(got - ref_mtp).max(axis=1)
        print(f"{family} llama.cpp MTP ({target}+{head or 'embedded'}) vs MtpModel: rows 0..{TOPK - 1} "
              f"{rows[:TOPK].max():.3g}, later rows {rows[TOPK:].max():.3g} (llama.cpp's MTP has no indexer)")
        assert rows[:TOPK].max() < 1e-4


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_llamacpp_mtp_head_is_dense(root, family, llama_peer):
    """llama.cpp's MTP graph is dense MLA: it equals our runtime's MTP graph with the selection
    switched off (index_topk ≥ the rows), on every row, and differs from the sparse head where the
    selection drops keys. Ours follows transformers (the indexer runs in the nextn block)."""
    from specconv.runtime import Context, GraphType, load_model
    from tests.fixtures.hf_reference import llamacpp_mtp_rows

    src, files = tiny.converted(family, root)
    _, hidden = tiny.hf_trunk(src, IDS)
    got = llama_peer.llama_mtp_logits(files["embed"], IDS, hidden=hidden)
    model = load_model(files["embed"], device="cpu")
    t, rows, pos = llamacpp_mtp_rows(IDS, hidden)
    sparse = Context(model, GraphType.MTP, n_ctx=64).decode(t, pos, hidden_in=torch.tensor(rows)).logits.numpy()
    model.hparams.index_topk = len(IDS)
    dense = Context(model, GraphType.MTP, n_ctx=64).decode(t, pos, hidden_in=torch.tensor(rows)).logits.numpy()
    d_dense, d_sparse = float(np.abs(got - dense).max()), float(np.abs(got - sparse).max())
    print(f"{family} llama.cpp MTP vs our dense MTP: {d_dense:.3g}; vs our sparse (transformers') MTP: {d_sparse:.3g}")
    assert d_dense < 1e-4 and d_sparse > 0.1


def test_indexer_head_size_llamacpp_constraint(tmp_path, llama_peer):
    """llama.cpp rotates the indexer's q and k by a Hadamard matrix of side 64·2^j, the largest such
    power of two dividing the head size, or 64 (src/llama-kv-cache.cpp `build_input_k_rot`), and
    multiplies it with the D-wide heads: D = 32 aborts its graph with GGML_ASSERT(ggml_can_mul_mat(a, b))
    (the failure measured on tiny shapes). Our runtime has no such constraint and matches transformers."""
    from specconv.runtime import Context, GraphType, load_model
    from specconv.verify.dsa_ties import EarliestOnTies

    src = tiny.build_tiny(tmp_path / "hf", "glm-dsa", index_head_dim=32)
    path = convert_gguf(src, tmp_path / "d32.gguf", mtp="none")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.fixtures import peers; "
            f"peers.require_llama_cpp(); peers.llama_logits({str(path)!r}, {IDS[:12]!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode != 0 and "ggml_can_mul_mat(a, b)" in proc.stderr, proc.stderr[-2000:]
    with EarliestOnTies(tiny.load_hf(src)[0]) as ties:  # this prompt has an exact tie (docs/dsa.md "Ties")
        ref, _ = tiny.hf_trunk(src, IDS)
    ours = Context(load_model(path, device="cpu"), GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy()
    diff = float(np.abs(ours - ref).max())
    print(f"index_head_dim 32: llama.cpp aborts (exit {proc.returncode}, ggml_can_mul_mat); runtime vs "
          f"transformers {diff:.3g} (rows with an exact tie at the top-k boundary: {ties.rows})")
    assert diff < 1e-4


def test_glm_shared_indexer_layers(tmp_path, llama_peer):
    """GLM-5.2-style `indexer_types`: a shared layer has no indexer tensors and reuses the previous
    full layer's selection; the list is written (`attention.indexer.types`) and llama.cpp and our
    runtime both match transformers."""
    from specconv.runtime import Context, GraphType, load_model

    src = tiny.build_tiny(tmp_path / "hf", "glm-dsa", indexer_types=["full", "shared", "full"])
    path = convert_gguf(src, tmp_path / "shared.gguf", mtp="embed")
    f = open_gguf(path)
    assert f.get("glm-dsa.attention.indexer.types") == [True, False, True]
    assert "blk.1.indexer.proj.weight" not in f.tensors and f"blk.{N}.indexer.proj.weight" in f.tensors
    ref, hidden = tiny.hf_trunk(src, IDS)
    model = load_model(path, device="cpu")
    ours = float(np.abs(Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy() - ref).max())
    llama = float(np.abs(llama_peer.llama_logits(path, IDS) - ref).max())
    print(f"glm-dsa full/shared/full: runtime vs transformers {ours:.3g}, llama.cpp vs transformers {llama:.3g}")
    assert ours < 1e-4 and llama < 1e-4


def _plugin(src, change, family="glm-dsa"):
    from specconv.archs import plugin_class_for
    from tests.fixtures.tiny_tools import plugin_on

    cfg = {**json.loads((src / "config.json").read_text()), **change}
    return plugin_on(plugin_class_for(cfg), src, cfg)[0]


@pytest.mark.parametrize("family, change, message", [
    ("glm-dsa", {"index_head_dim": 4}, "exceeds index_head_dim"),
    ("glm-dsa", {"indexer_types": ["shared", "full", "full"]}, "indexer_types\\[0\\]"),
    ("glm-dsa", {"indexer_types": ["full", "full"]}, "indexer_types"),
    ("glm-dsa", {"index_topk": 0}, "index_topk"),
    ("deepseek32", {"q_lora_rank": None}, "q_lora_rank"),
    ("glm-dsa", {"indexer_types": ["full", "shared", "full"]}, "shared"),  # layer 1 holds indexer tensors
])
def test_bad_configs_are_refused(root, family, change, message):
    src, _ = tiny.converted(family, root)
    with pytest.raises(SpecconvError, match=message):
        _plugin(src, change, family).tensor_plan()


YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_yarn_rope(root, family, llama_peer):
    """YaRN as DeepSeek-V3.2 ships it (mscale = mscale_all_dim): the indexer ropes with the main
    attention's tables. Our runtime matches transformers for both families, trunk and MTP; llama.cpp
    matches for deepseek32, while its glm-dsa graph is far off with YaRN (it reads no
    rope.scaling.yarn_log_multiplier and its attention factor differs; GLM-5 releases use plain rope)."""
    from specconv.runtime import Context, GraphType, load_model
    from tests.fixtures.hf_reference import llamacpp_mtp_rows

    src, files = tiny.converted(family, root, rope_parameters=YARN)
    assert open_gguf(files["embed"]).get(f"{family}.rope.scaling.type") == "yarn"
    ref, hidden = tiny.hf_trunk(src, IDS)
    model = load_model(files["embed"], device="cpu")
    ours = float(np.abs(Context(model, GraphType.MAIN, n_ctx=64).decode(IDS).logits.numpy() - ref).max())
    t, rows, pos = llamacpp_mtp_rows(IDS, hidden)
    mtp = Context(model, GraphType.MTP, n_ctx=64).decode(t, pos, hidden_in=torch.tensor(rows)).logits.numpy()
    ours_mtp = float(np.abs(mtp - tiny.hf_mtp_llamacpp_rows(src, IDS, hidden)).max())
    llama = float(np.abs(llama_peer.llama_logits(files["embed"], IDS) - ref).max())
    print(f"{family} YaRN: runtime vs transformers trunk {ours:.3g}, MTP {ours_mtp:.3g}; "
          f"llama.cpp vs transformers {llama:.3g}")
    assert ours < 1e-4 and ours_mtp < 1e-4
    assert llama < 1e-4 if family == "deepseek32" else llama > 0.1


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_release_scale_headers(family):
    """The releases' own dimensions (transformers' config defaults: GLM-5 78 + 1 blocks, DeepSeek-V3.2
    61 + 1), headers only: indexer tensors and keys, MLA KV, and llama.cpp's head-size condition."""
    from specconv.archs.dsa import DeepseekV32, GlmMoeDsa
    from tests.fixtures.tiny_glm_deepseek import release_scale_plugin

    config_cls, model_cls = tiny._classes(family)
    cfg = config_cls()
    tiny._mtp_fields(cfg)
    plugin_cls = GlmMoeDsa if family == "glm-dsa" else DeepseekV32
    n = cfg.num_hidden_layers
    plugin = release_scale_plugin(cfg, model_cls, plugin_cls, model_cls.__name__, n, tied_copies=True)
    kv = {m.key: m.value for m in plugin.metadata(keep_mtp=True)}
    heads = 32 if family == "glm-dsa" else 64
    expect = {"block_count": n + 1, "nextn_predict_layers": 1, "attention.indexer.head_count": heads,
              "attention.indexer.key_length": 128, "attention.indexer.top_k": 2048, "attention.kv_lora_rank": 512,
              "rope.dimension_count": 64, "expert_gating_func": 2}
    for key, value in expect.items():
        assert kv[f"{family}.{key}"] == value, key
    shapes = {p.name: p.shape for p in plugin.tensor_plan()}
    assert shapes[f"blk.{n}.indexer.attn_q_b.weight"] == (heads * 128, cfg.q_lora_rank)
    assert shapes["blk.0.indexer.attn_k.weight"] == (128, cfg.hidden_size)
    assert shapes["blk.0.indexer.proj.weight"] == (heads, cfg.hidden_size)
    print(f"{family} release headers: {len(shapes)} tensors, {n} + 1 blocks, indexer {heads} x 128, top-k 2048")


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_mtp_draft_chain_equals_llamacpp_within_top_k(root, family, llama_peer):
    """llama.cpp's draft-mtp chain (teacher-forced catch-up rows, then each draft fed back) equals our
    MtpDrafter's while every MTP row sees ≤ index_topk keys (a 4-token prompt, 3 drafts: ≤ 7 keys),
    where llama.cpp's dense MTP block and our sparse one agree."""
    from tests.fixtures.mtp_checks import draft_chain_vs_llamacpp

    _, files = tiny.converted(family, root)
    ours, drafts = draft_chain_vs_llamacpp(llama_peer, files, IDS[:4], 3)
    print(f"{family} MTP draft chain: ours {ours}, llama.cpp {drafts}")
    assert ours == drafts


def test_inspect_names_arch_and_graphs(root):
    from click.testing import CliRunner

    from specconv import cli as cli_module

    for family in tiny.FAMILIES:
        _, files = tiny.converted(family, root)
        for name, serves in (("embed", ["main", "mtp"]), ("none", ["main"]), ("only", ["mtp"])):
            info = json.loads(CliRunner().invoke(cli_module.cli, ["inspect", str(files[name]), "--json"]).output)
            assert info["arch"] == family and sorted(info["serves"]) == serves, (family, name, info["serves"])


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_no_v2_lite_rule_for_dsa_arches(family):
    """llama.cpp reads deepseek2 files with 26/27 trunk layers as DeepSeek-V2-Lite (no q_lora), so the
    deepseek2 plugin refuses them; its glm-dsa and deepseek32 loaders have no such rule."""
    from specconv.archs.dsa import DeepseekV32, GlmMoeDsa
    from tests.fixtures.tiny_glm_deepseek import release_scale_plugin

    config_cls, model_cls = tiny._classes(family)
    cfg = config_cls(**tiny.config_kwargs(family, num_hidden_layers=26))
    tiny._mtp_fields(cfg)
    plugin_cls = GlmMoeDsa if family == "glm-dsa" else DeepseekV32
    plugin = release_scale_plugin(cfg, model_cls, plugin_cls, model_cls.__name__, 26)
    assert {m.key: m.value for m in plugin.metadata(keep_mtp=True)}[f"{family}.attention.q_lora_rank"] == 48


@pytest.mark.parametrize("fields", [{}, {"index_topk_pattern": "FSFF"}, {"index_topk_freq": 2},
                                    {"index_topk_freq": 3, "index_skip_topk_offset": 1}])
def test_glm_indexer_types_read_as_transformers(fields):
    """Without `indexer_types`, the per-layer list comes from `index_topk_pattern` or the
    `index_topk_freq` / `index_skip_topk_offset` schedule exactly as transformers' GlmMoeDsaConfig
    derives it; written whenever it is not llama.cpp's default (all full below a 1M context)."""
    from transformers import GlmMoeDsaConfig

    from specconv.archs.config_reader import ConfigReader
    from specconv.archs.dsa import glm_indexer_types

    expected = GlmMoeDsaConfig(num_hidden_layers=4, **fields).indexer_types
    assert glm_indexer_types(ConfigReader(fields), 4) == expected
    print(f"{fields}: {expected}")
