"""The test fixtures are what they claim to be.

Expected names and shapes come from the release layout in docs/reference/peers.md §2.3 / docs/reference/gguf-layout.md §7.1,
written out here by hand, not from the fixture code.
"""

import json
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.fixtures import hf_reference as ref
from tests.fixtures.tiny_qwen35 import build_qwen35
from tests.fixtures.tokenizer import SPECIAL_TOKENS, train_tokenizer


E, I_MOE, H, V = 4, 32, 64, 512
# The 15 dense MTP tensors of a Qwen3.5 release (docs/reference/peers.md §2.3).
MTP_DENSE = {
    "mtp.fc.weight": (H, 2 * H),
    "mtp.pre_fc_norm_embedding.weight": (H,),
    "mtp.pre_fc_norm_hidden.weight": (H,),
    "mtp.norm.weight": (H,),
    "mtp.layers.0.input_layernorm.weight": (H,),
    "mtp.layers.0.post_attention_layernorm.weight": (H,),
    "mtp.layers.0.self_attn.q_proj.weight": (2 * 4 * 16, H),
    "mtp.layers.0.self_attn.k_proj.weight": (2 * 16, H),
    "mtp.layers.0.self_attn.v_proj.weight": (2 * 16, H),
    "mtp.layers.0.self_attn.o_proj.weight": (H, 4 * 16),
    "mtp.layers.0.self_attn.q_norm.weight": (16,),
    "mtp.layers.0.self_attn.k_norm.weight": (16,),
    "mtp.layers.0.mlp.gate_proj.weight": (128, H),
    "mtp.layers.0.mlp.up_proj.weight": (128, H),
    "mtp.layers.0.mlp.down_proj.weight": (H, 128),
}
IDS = np.array([5, 77, 300, 12, 499, 3, 250, 100, 44, 9, 131, 402])


def read_all(folder):
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            for k in sf.keys():
                tensors[k] = sf.get_tensor(k)
    return tensors


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("fixtures")


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_round_trip_and_gguf_vocab(tmp):
    from pathlib import Path

    import gguf
    from transformers import AutoTokenizer

    path = train_tokenizer(tmp / "tok")
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == V
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [509, 510, 511]
    assert tok.eos_token == "<|im_end|>"
    for text in ["def f(x):\n    return x + 1\n", "Héllo wörld — ✓ 数字 123", "  spaces\t\ttabs\r\n"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert max(ids) < 509
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[0] == 510 and ids.count(511) == 1  # specials are single tokens

    bpe = gguf.vocab.BpeVocab(Path(path))
    assert bpe.vocab_size == V
    special = gguf.SpecialVocab(Path(path), load_merges=True)
    assert special.special_token_ids["eos"] == 511
    assert special.chat_template and len(special.merges) > 200


# ------------------------------------------------------------------ layouts


@pytest.mark.parametrize("moe", [False, True])
def test_save_pretrained_layout(tmp, moe):
    d = build_qwen35(tmp / f"sp{moe}", moe=moe)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["mtp_use_dedicated_embeddings"] is False
    assert cfg["layer_types"][-1] == "full_attention"
    t = read_all(d)
    assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in t)
    assert "lm_head.weight" in t and "model.embed_tokens.weight" in t
    if moe:
        # save_pretrained writes experts one by one, for the trunk and (as injected) for the MTP layer
        for prefix in ("model.layers.3.", "mtp.layers.0."):
            for e in range(E):
                assert t[f"{prefix}mlp.experts.{e}.gate_proj.weight"].shape == (I_MOE, H)
                assert t[f"{prefix}mlp.experts.{e}.down_proj.weight"].shape == (H, I_MOE)
        assert not any("gate_up_proj" in k for k in t)
    else:
        assert {k: tuple(v.shape) for k, v in t.items() if k.startswith("mtp.")} == MTP_DENSE


@pytest.mark.parametrize("moe", [False, True])
def test_release_layout(tmp, moe):
    d = build_qwen35(tmp / f"rel{moe}", moe=moe, layout="release")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["mtp_num_hidden_layers"] == 1 and text["num_hidden_layers"] == 4
    assert text["rope_parameters"]["mrope_section"] == [1, 1, 0]
    t = read_all(d)
    trunk = [k for k in t if not k.startswith(("mtp.", "model.visual.")) and k != "lm_head.weight"]
    assert trunk and all(k.startswith("model.language_model.") for k in trunk)
    assert t["lm_head.weight"].shape == (V, H)
    assert any(k.startswith("model.visual.") for k in t)
    if moe:
        for prefix in ("model.language_model.layers.3.", "mtp.layers.0."):
            assert t[prefix + "mlp.experts.gate_up_proj"].shape == (E, 2 * I_MOE, H)
            assert t[prefix + "mlp.experts.down_proj"].shape == (E, H, I_MOE)
        assert not any(".experts.0." in k for k in t)
    else:
        assert {k: tuple(v.shape) for k, v in t.items() if k.startswith("mtp.")} == MTP_DENSE

    top = build_qwen35(tmp / f"reltop{moe}", moe=moe, layout="release", rope_style="top_level")
    text = json.loads((top / "config.json").read_text())["text_config"]
    assert "rope_parameters" not in text and text["rope_theta"] == 1000.0 and text["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("moe", [False, True])
def test_layouts_hold_the_same_model(tmp, moe):
    """Same seed: transformers loads both layouts (release via the VL prefix mapping) to the same model."""
    a = build_qwen35(tmp / f"sa{moe}", moe=moe)
    b = build_qwen35(tmp / f"sb{moe}", moe=moe, layout="release", sharded=True)
    c = build_qwen35(tmp / f"sc{moe}", moe=moe, layout="release", rope_style="top_level")
    la, lb, lc = (ref.hf_logits(x, IDS) for x in (a, b, c))
    ma, mb = (ref.hf_mtp_logits_transformers_rows(x, IDS) for x in (a, b))
    print(f"moe={moe}: logit std {la.std():.3f}, |Δ| layouts trunk {np.abs(la - lb).max():.2e} "
          f"rope-top-level {np.abs(la - lc).max():.2e} mtp {np.abs(ma - mb).max():.2e}")
    assert la.std() > 0.5  # re-randomised (default init gives ~0.16)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(la, lc)
    np.testing.assert_array_equal(ma, mb)


def test_sharded_index(tmp):
    d = build_qwen35(tmp / "sh", layout="release", sharded=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and not (d / "model.safetensors").exists()
    t = read_all(d)
    assert set(index["weight_map"]) == set(t)
    assert index["metadata"]["total_size"] == sum(x.numel() * x.element_size() for x in t.values())


def test_tied_and_no_mtp_variants(tmp):
    d = build_qwen35(tmp / "tie", tie=True, mtp=False)
    t = read_all(d)
    assert "lm_head.weight" not in t and not any(k.startswith("mtp.") for k in t)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and "mtp_num_hidden_layers" not in cfg
    main, _ = ref.load_hf(d)
    assert torch.equal(main.lm_head.weight, t["model.embed_tokens.weight"])

    d = build_qwen35(tmp / "nocfg", mtp_in_config=False)
    assert "mtp_num_hidden_layers" not in json.loads((d / "config.json").read_text())
    assert set(MTP_DENSE) <= set(read_all(d))


@pytest.mark.parametrize("n_layers,nk,nv", [(2, 4, 4), (6, 2, 4)])
def test_shape_variants_load(tmp, n_layers, nk, nv):
    d = build_qwen35(tmp / f"shape{n_layers}{nk}{nv}", n_layers=n_layers, nk=nk, nv=nv, layout="release")
    text = json.loads((d / "config.json").read_text())["text_config"]
    assert text["layer_types"][-1] == "full_attention" and len(text["layer_types"]) == n_layers
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (nk, nv)
    main, mtp = ref.load_hf(d, with_mtp=True)
    assert len(main.model.layers) == n_layers and len(mtp.layers) == 1
    assert np.isfinite(ref.hf_mtp_logits_transformers_rows(d, IDS)).all()


# ------------------------------------------------------------------ weights


def test_weights_are_rerandomised(tmp):
    d = build_qwen35(tmp / "rnd", moe=True, layout="release")
    t = read_all(d)
    one_plus_w = [k for k in t if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))]
    one_plus_w += ["model.language_model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight"]
    for k in one_plus_w:  # (1+w) norms: default 0 would hide a missing +1
        assert 0.1 < t[k].std() < 0.3 and t[k].abs().mean() < 0.3, k
    gated = [k for k in t if k.endswith("linear_attn.norm.weight")]
    assert len(gated) == 3
    for k in gated:  # plain-weight gated norm: around 1, not 1
        assert 0.1 < t[k].std() < 0.3 and abs(t[k].mean() - 1) < 0.2, k
    for k in [k for k in t if k.endswith("A_log")]:
        a = torch.exp(t[k])
        assert a.min() >= 1 and a.max() <= 16 and a.std() > 0.5, k
    for k in [k for k in t if k.endswith("dt_bias")]:
        assert t[k].std() > 0.1, k
    w = t["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert abs(w.std().item() * H**0.5 - 1) < 0.1  # N(0, 1/fan_in)


@pytest.mark.parametrize("moe,layout", [(False, "save_pretrained"), (True, "save_pretrained"), (True, "release")])
def test_mtp_model_loads_written_weights_exactly(tmp, moe, layout):
    d = build_qwen35(tmp / f"mtp{moe}{layout}", moe=moe, layout=layout, mtp_in_config=False)
    t = read_all(d)
    _, mtp = ref.load_hf(d, with_mtp=True)
    layer = mtp.layers[0]
    assert torch.equal(layer.eh_proj.weight, t["mtp.fc.weight"])
    assert torch.equal(layer.enorm.weight, t["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(layer.hnorm.weight, t["mtp.pre_fc_norm_hidden.weight"])
    assert torch.equal(layer.post_norm.weight, t["mtp.norm.weight"])
    block = layer.mtp_block.state_dict()
    file_block = {k[len("mtp.layers.0."):]: v for k, v in t.items() if k.startswith("mtp.layers.0.")}
    if moe and layout == "save_pretrained":  # fuse the per-expert file tensors the way transformers holds them
        gu = torch.stack([torch.cat([file_block.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                     file_block.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in range(E)])
        dn = torch.stack([file_block.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
        file_block["mlp.experts.gate_up_proj"], file_block["mlp.experts.down_proj"] = gu, dn
    assert set(block) == set(file_block)
    for k in block:
        assert torch.equal(block[k], file_block[k]), k
    # The shared embedding and head are the trunk's, not copies.
    main, _ = ref.load_hf(d)
    assert mtp.embed_tokens is main.get_input_embeddings() and mtp.shared_head is main.lm_head


# ------------------------------------------------------------------ MTP row conventions


@pytest.mark.parametrize("moe", [False, True])
def test_mtp_row_conventions(tmp, moe):
    """transformers rows t=(x_{t+1}, h_t)@t+1 vs llama.cpp rows p=(x_p, h_{p-1})@p with row 0 = (x_0, 0).

    Without llama.cpp's row 0 the two conventions are the same rows (rows p=1..T-1 equal transformers
    rows 0..T-2 exactly). With it, the extra row in the MTP attention context changes every row.
    """
    d = build_qwen35(tmp / f"conv{moe}", moe=moe)
    h = ref.hf_hidden_post_norm(d, IDS)
    tr = ref.hf_mtp_logits_transformers_rows(d, IDS)
    ll = ref.hf_mtp_logits_llamacpp_rows(d, IDS)
    np.testing.assert_array_equal(ll, ref.hf_mtp_logits_llamacpp_rows(d, IDS, hidden=h))
    tokens, rows, positions = ref.llamacpp_mtp_rows(IDS, h)
    assert np.all(rows[0] == 0) and np.array_equal(rows[1:], h[:-1]) and np.array_equal(positions, np.arange(len(IDS)))
    without_row0 = ref.hf_mtp_forward(d, tokens[1:], rows[1:], positions[1:])[0]
    same = np.abs(without_row0 - tr[:-1]).max()
    diff = np.abs(ll[1:] - tr[:-1]).max()
    print(f"moe={moe}: llama.cpp rows w/o row 0 vs transformers rows |Δ| {same:.2e}; with row 0 {diff:.3f}")
    assert same < 1e-5
    assert diff > 1e-2


def test_builds_are_fast(tmp):
    build_qwen35(tmp / "warm", moe=True)  # imports + tokenizer training happen once
    t0 = time.perf_counter()
    build_qwen35(tmp / "fresh", moe=True, seed=123)
    fresh = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_qwen35(tmp / "cached", moe=True, seed=123)
    cached = time.perf_counter() - t0
    print(f"fresh MoE build {fresh:.3f} s, cached copy {cached:.3f} s")
    assert fresh < 3 and cached < 1


# ------------------------------------------------------------------ llama.cpp harness

CONVERTERS = ["specconv", "upstream"]


def _gguf(tmp, converter, moe, mtp="embed"):
    """(HF dir, GGUF) with the MTP head embedded, left out ("none") or alone ("only")."""
    from tests.fixtures.gguf_files import convert_gguf, convert_gguf_upstream

    d = build_qwen35(tmp / f"{converter}-{moe}-src", moe=moe, layout="release")
    out = tmp / f"{converter}-{moe}-{mtp}.gguf"
    if not out.exists():
        if converter == "specconv":
            convert_gguf(d, out, mtp=mtp)
        else:
            convert_gguf_upstream(d, out, extra_args={"embed": [], "none": ["--no-mtp"], "only": ["--mtp"]}[mtp])
    return d, out


@pytest.fixture(scope="module")
def peers():
    from tests.fixtures import peers as p

    p.require_llama_cpp()
    return p


@pytest.mark.parametrize("converter", CONVERTERS)
@pytest.mark.parametrize("moe", [False, True])
def test_llama_harness_self_consistent(tmp, peers, converter, moe):
    """One batch == one decode per token; greedy == argmax of batch logits; logits == h · W_outᵀ."""
    d, g = _gguf(tmp, converter, moe)
    batch = peers.llama_logits(g, IDS)
    steps = peers.llama_logits(g, IDS, one_by_one=True)
    assert batch.shape == (len(IDS), V) and np.isfinite(batch).all()
    d_steps = np.abs(batch - steps).max()

    greedy = peers.llama_greedy(g, IDS, 6)
    full = peers.llama_logits(g, np.concatenate([IDS, greedy[:-1]]))
    assert greedy == [int(x) for x in full[len(IDS) - 1:].argmax(-1)]

    # llama-cpp-python's high-level class is a second, independent path to the same numbers.
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(g), n_ctx=256, n_batch=256, n_threads=1, logits_all=True,
                          type_k=0, type_v=0, flash_attn=False, verbose=False)
    llm.reset()
    llm.eval([int(x) for x in IDS])
    d_high = np.abs(np.array(llm.scores[: llm.n_tokens]) - batch).max()
    llm.close()

    h = peers.llama_hidden(g, IDS)  # post-norm: the LM head applied to it gives the logits
    w_out = read_all(d)["lm_head.weight"].double().numpy()
    d_head = np.abs(h.astype(np.float64) @ w_out.T - batch).max()
    print(f"[{converter} moe={moe}] llama.cpp batch vs token-by-token |Δ| {d_steps:.2e}; "
          f"vs high-level Llama.eval {d_high:.2e}; h·W_outᵀ vs logits {d_head:.2e}")
    assert d_high < 1e-6
    # Gated DeltaNet's chunked (batch) and recurrent (1 token) paths round differently (~1e-5).
    assert d_steps < 1e-3
    assert d_head < 1e-4


@pytest.mark.parametrize("converter", CONVERTERS)
@pytest.mark.parametrize("moe", [False, True])
def test_llama_harness_against_transformers(tmp, peers, converter, moe):
    """Trunk, post-norm hidden and MTP logits of llama.cpp vs transformers, with float64 noise floor."""
    d, g = _gguf(tmp, converter, moe)
    assert peers.llama_mtp_context_ok(g)
    ll = peers.llama_logits(g, IDS)
    hf32 = ref.hf_logits(d, IDS)
    hf64 = ref.hf_logits(d, IDS, float64=True)
    e_ll, e_hf = np.abs(ll - hf64).max(), np.abs(hf32 - hf64).max()
    e_h = np.abs(peers.llama_hidden(g, IDS) - ref.hf_hidden_post_norm(d, IDS)).max()

    mtp, h, nextn = peers.llama_mtp_logits(g, IDS, return_hidden=True)
    want, want_nextn = ref.hf_mtp_forward(d, *ref.llamacpp_mtp_rows(IDS, h))
    e_mtp, e_nextn = np.abs(mtp - want).max(), np.abs(nextn - want_nextn).max()
    e_conv = np.abs(mtp[1:] - ref.hf_mtp_logits_transformers_rows(d, IDS)[:-1]).max()
    print(f"[{converter} moe={moe}] trunk |Δ| vs float64: llama.cpp {e_ll:.2e}, transformers f32 {e_hf:.2e}; "
          f"hidden {e_h:.2e}; MTP (llama.cpp rows, same h) {e_mtp:.2e}, nextn out {e_nextn:.2e}; "
          f"vs transformers rows {e_conv:.3f}")
    assert e_ll < 10 * max(e_hf, 1e-5)  # llama.cpp is as close to exact as transformers' own float32
    assert e_mtp < 1e-5 and e_nextn < 1e-5
    assert e_conv > 1e-2  # the row convention matters (docs/reference/model-math.md §7.2)


@pytest.mark.parametrize("converter", CONVERTERS)
@pytest.mark.parametrize("moe", [False, True])
def test_llama_mtp_draft_chain_matches_transformers(tmp, peers, converter, moe):
    """Multi-token MTP drafting (normed output fed back) agrees between llama.cpp and MtpModel."""
    d, g = _gguf(tmp, converter, moe)
    id_last, drafts, logits = peers.llama_mtp_draft(g, IDS, 4)
    ref_last, ref_drafts, ref_logits = ref.hf_mtp_draft(d, IDS, 4, hidden=peers.llama_hidden(g, IDS))
    err = np.abs(logits - ref_logits).max()
    print(f"[{converter} moe={moe}] 4 MTP drafts {drafts}, draft logits |Δ| {err:.2e}")
    assert id_last == ref_last and drafts == ref_drafts
    assert err < 1e-5


@pytest.mark.parametrize("converter", CONVERTERS)
def test_llama_harness_mtp_sidecar(tmp, peers, converter):
    """An MTP-only sidecar on a trunk-only target gives the embedded head's logits."""
    _, embedded = _gguf(tmp, converter, True)
    _, trunk = _gguf(tmp, converter, True, mtp="none")
    _, sidecar = _gguf(tmp, converter, True, mtp="only")
    assert peers.llama_mtp_context_ok(trunk, sidecar)
    with pytest.raises(RuntimeError, match="no MTP layer"):
        peers.llama_mtp_context_ok(trunk)
    a = peers.llama_mtp_logits(embedded, IDS)
    b = peers.llama_mtp_logits(trunk, IDS, sidecar)
    print(f"[{converter}] MTP sidecar vs embedded |Δ| {np.abs(a - b).max():.2e}")
    assert np.abs(a - b).max() < 1e-6


def test_require_llama_cpp_fails_under_ci_flag(monkeypatch):
    """SPECCONV_REQUIRE_PEERS=1 turns a missing llama_cpp into a failure, not a skip."""
    import builtins

    from tests.fixtures import peers as p

    real_import = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError("simulated: no llama_cpp")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    for mod in [m for m in list(__import__("sys").modules) if m == "llama_cpp" or m.startswith("llama_cpp.")]:
        monkeypatch.delitem(__import__("sys").modules, mod)
    monkeypatch.setenv("SPECCONV_REQUIRE_PEERS", "1")
    with pytest.raises(pytest.fail.Exception, match="SPECCONV_REQUIRE_PEERS=1"):
        p.require_llama_cpp()
    monkeypatch.setenv("SPECCONV_REQUIRE_PEERS", "0")
    with pytest.raises(pytest.skip.Exception):
        p.require_llama_cpp()


def test_pytest_plugin_fixtures(tmp_path_factory):
    """The plugin's factory builds into fresh folders (here called directly, not via registration)."""
    from tests.fixtures import pytest_plugin

    make = pytest_plugin.qwen35_dir.__wrapped__(tmp_path_factory)
    a, b = make(), make(moe=True, layout="release")
    assert a != b and (a / "config.json").is_file() and (b / "model.safetensors").is_file()
