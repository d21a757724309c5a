"""Gemma 4 assistant (`gemma4-assistant`): conversion, draft logits vs transformers'
Gemma4AssistantForCausalLM, the drafter in the speculative loop and in `specconv verify`, and the
llama.cpp peer (the assistant context is created with ctx_other = the target's context)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from specconv.archs.errors import SpecconvError
from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import Gemma4AssistantDrafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate
from tests.fixtures import tiny_gemma4 as g
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.gguf_files import field_value

IDS = [2, 5, 100, 7, 33, 250, 9, 11, 12, 13, 14, 15, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("g4a")
    target_src, asst_src = g.tiny_gemma4("hub"), g.tiny_assistant("hub")
    return (target_src, asst_src, convert_gguf(target_src, d / "target.gguf"),
            convert_gguf(asst_src, d / "assistant.gguf"))


@pytest.fixture(scope="module")
def models(files):
    target = load_model(files[2], device="cpu")
    return target, load_model(files[3], device="cpu", share_from=target)


def test_assistant_file(files):
    r = GGUFReader(files[3])
    kv = {k: field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    names = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    a = "gemma4-assistant"
    assert kv["general.architecture"] == a
    assert kv[f"{a}.nextn_predict_layers"] == kv[f"{a}.block_count"] == 2
    assert kv[f"{a}.embedding_length_out"] == g.HIDDEN and kv[f"{a}.embedding_length"] == g.ASSIST_HIDDEN
    assert kv[f"{a}.attention.shared_kv_layers"] == 2 and kv[f"{a}.embedding_length_per_layer_input"] == 0
    assert kv["tokenizer.ggml.model"] == "gemma4"
    assert names["nextn.pre_projection.weight"] == (2 * g.HIDDEN, g.ASSIST_HIDDEN)
    assert names["nextn.post_projection.weight"] == (g.ASSIST_HIDDEN, g.HIDDEN)
    assert names["token_embd.weight"] == (g.ASSIST_HIDDEN, g.VOCAB_REAL)  # the tied head, trimmed
    assert not any("attn_k" in n or "attn_v" in n or "masked_embd" in n for n in names)
    assert "output.weight" not in names and "rope_freqs.weight" in names


@pytest.mark.parametrize("P", [6, len(IDS)])  # inside and beyond the sliding window
def test_draft_logits_match_transformers(files, models, P):
    """One draft step at P, then a second one fed with the first's projected hidden state (same P)."""
    target_src, asst_src = files[:2]
    target, assistant = models
    tctx = Context(target, GraphType.MAIN, n_ctx=64)
    out = tctx.decode(IDS[:P])
    actx = Context(assistant, GraphType.MTP, kv_from=tctx)
    token, h = int(out.logits[-1].argmax()), out.hidden["post_norm"][-1]
    for step in range(2):
        ours = actx.decode([token], positions=[P], hidden_in=h.reshape(1, -1))
        ref_logits, ref_h = g.hf_assistant_step(target_src, asst_src, IDS[:P], token, h)
        d = (ours.logits[0] - ref_logits[:g.VOCAB_REAL]).abs().max().item()
        dh = (ours.hidden["nextn"][0] - ref_h).abs().max().item()
        print(f"assistant P={P} step {step}: max |Δlogit| {d:.2e}, |Δ h_next| {dh:.2e}")
        assert d < 1e-4 and dh < 1e-4
        token, h = int(ours.logits[0].argmax()), ours.hidden["nextn"][0]
    assert actx.memory.n_past(0) == 0 and tctx.n_past() == P  # nothing written anywhere


def test_restricted_head_is_a_different_mode(files):
    """transformers' ordered-embedding head scores only the top centroid clusters (docs/reference/model-math.md §8);
    our head is the full vocabulary, as llama.cpp's. Inside the selected clusters both agree."""
    target_src, asst_src = files[:2]
    _, h, _ = g.hf_target(target_src, IDS)
    full, _ = g.hf_assistant_step(target_src, asst_src, IDS, 7, h[-1], ordered=False)
    restricted, _ = g.hf_assistant_step(target_src, asst_src, IDS, 7, h[-1], ordered=True)
    kept = restricted > restricted.min()
    assert 0 < int(kept.sum()) < g.VOCAB_ROWS
    assert (restricted[kept] - full[kept]).abs().max().item() < 1e-5


def test_context_needs_the_target(models):
    _, assistant = models
    with pytest.raises(SpecconvError, match="kv_from"):
        Context(assistant, GraphType.MTP)
    with pytest.raises(SpecconvError, match="no main graph|cannot run"):
        Context(assistant, GraphType.MAIN)


def test_greedy_speculative_equals_plain(files, models):
    target, _ = models
    drafter = build_drafter("draft", target, 64, 3, draft_path=files[3])
    assert isinstance(drafter, Gemma4AssistantDrafter)
    plain = generate(target, IDS, 24)
    for k, rollback in ((1, "snapshot"), (3, "snapshot"), (3, "checkpoint")):
        res = speculative_generate(target, drafter, IDS, 24, SpecConfig(draft_max=k, rollback=rollback))
        s = res.stats["speculative"]
        print(f"assistant draft_max {k} {rollback}: accepted {s['accepted']}/{s['drafted']}")
        assert res.tokens == plain.tokens
        assert s["drafted"] > 0


def test_drafts_equal_a_step_by_step_reference(files, models):
    """The drafter's tokens after a prompt = argmax chain of transformers' assistant at a fixed P."""
    target_src, asst_src = files[:2]
    target, assistant = models
    drafter = Gemma4AssistantDrafter(assistant, target)
    ctx = Context(target, GraphType.MAIN, n_ctx=64)
    drafter.attach(ctx)
    prefix = IDS[:-1]
    drafter.start(prefix, ctx.decode(prefix).hidden["post_norm"])
    drafts = drafter.draft(IDS[-1], 3).tokens
    _, h, _ = g.hf_target(target_src, prefix)
    token, hh, ref = IDS[-1], h[-1], []
    for _ in range(3):
        logits, hh = g.hf_assistant_step(target_src, asst_src, prefix, token, hh)
        token = int(logits[:g.VOCAB_REAL].argmax())
        ref.append(token)
    assert drafts == ref


def test_refuses_an_assistant_for_another_target(tmp_path, models):
    target, _ = models
    other_src = g.tiny_assistant("v5")  # full layers with 2 KV heads: the hub target's full store has 1
    path = convert_gguf(other_src, tmp_path / "other.gguf")
    other = load_model(path, device="cpu", share_from=target)
    with pytest.raises(SpecconvError, match="KV heads"):
        Gemma4AssistantDrafter(other, target)


def test_verify_passes_and_catches_a_planted_defect(files, tmp_path):
    from click.testing import CliRunner

    from specconv import cli as cli_module

    report = tmp_path / "r.json"
    args = ["verify", str(files[2]), "--draft", str(files[3]), "-n", "8", "--draft-max", "2", "--report", str(report)]
    res = CliRunner().invoke(cli_module.cli, args)
    data = json.loads(report.read_text())
    assert res.exit_code == 0, res.output
    assert data["passed"] and any(c["name"] == "draft: Gemma 4 assistant fits the model" and c["passed"]
                                  for c in data["checks"])
    assert data["speculative"]["drafter"] == "gemma4-assistant" and data["speculative"]["exact"]
    layers = next(c for c in data["checks"] if c["name"] == "draft: MTP layers vs nextn_predict_layers")
    assert layers["passed"] and "every layer drafts" in layers["detail"]
    # planted defect: the assistant converted for a target whose full layers have another KV-head count
    bad = convert_gguf(g.tiny_assistant("v5"), tmp_path / "bad.gguf")
    res = CliRunner().invoke(cli_module.cli, ["verify", str(files[2]), "--draft", str(bad), "-n", "4",
                                              "--report", str(tmp_path / "bad.json")])
    assert res.exit_code != 0
    bad_report = json.loads((tmp_path / "bad.json").read_text())
    failed = [c for c in bad_report["checks"] if not c["passed"]]
    assert any("assistant fits" in c["name"] for c in failed)


def test_llama_cpp_loads_the_assistant_with_ctx_other(files):
    """llama.cpp loads the assistant (nextn layers = block_count, embd_out = target width) and creates
    its context with ctx_other = the target's context, which builds its graph."""
    from tests.fixtures import peers

    llama_cpp = peers.require_llama_cpp()
    target = peers.load_model(files[2])
    assistant = peers.load_model(files[3], load_mtp=True)
    assert int(llama_cpp.llama_model_n_layer_nextn(assistant)) == 2
    assert int(llama_cpp.llama_model_n_embd_out(assistant)) == g.HIDDEN
    tgt = peers.new_context(target, n_ctx=64)
    try:
        peers.free_context(peers.new_context(assistant, n_ctx=64, mtp_of=tgt))
    finally:
        peers.free_context(tgt)


def test_llama_cpp_draft_chain_matches(files, models):
    """llama.cpp's assistant steps (rows (token, h) at the fixed position P, h_next fed back) against
    ours and transformers', inside (P=6) and beyond (P=16) the sliding window. The assistant context
    is created before the target decodes, as llama.cpp's speculative driver does: created after, its
    attention saw no cells here (NaN logits with flash attention off)."""
    from tests.fixtures import peers

    peers.require_llama_cpp()
    _, ext = peers._lib()
    target_src, asst_src = files[:2]
    t_model, a_model = peers.load_model(files[2]), peers.load_model(files[3], load_mtp=True)
    target, assistant = models
    tgt = peers.new_context(t_model, n_ctx=64)
    dft = peers.new_context(a_model, n_ctx=64, mtp_of=tgt)
    try:
        ext.llama_set_embeddings_nextn(tgt, True, False)
        ext.llama_set_embeddings_nextn(dft, True, True)
        ours_ctx = Context(target, GraphType.MAIN, n_ctx=64)
        ours_asst = Context(assistant, GraphType.MTP, kv_from=ours_ctx)
        done = 0
        for P in (6, len(IDS)):
            peers.decode_tokens(tgt, IDS[done:P], done)
            ours_ctx.decode(IDS[done:P])
            h = peers.row_hidden_nextn(tgt, t_model, P - done)[-1]
            token = int(peers.row_logits(tgt, t_model, P - done)[-1].argmax())
            done = P
            for step in range(2):
                peers.decode_rows(dft, [token], h[None], [P])
                theirs = peers.row_logits(dft, a_model, 1)[0]
                h_next = peers.row_hidden_nextn(dft, a_model, 1)[0]
                ours = ours_asst.decode([token], positions=[P], hidden_in=torch.tensor(h)[None]).logits[0].numpy()
                ref = g.hf_assistant_step(target_src, asst_src, IDS[:P], token, torch.tensor(h))[0][:g.VOCAB_REAL]
                d_ref, d_ours = np.abs(theirs - ref.numpy()).max(), np.abs(theirs - ours).max()
                print(f"llama.cpp assistant P={P} step {step}: vs transformers {d_ref:.2e}, vs ours {d_ours:.2e}")
                assert not np.isnan(theirs).any() and d_ref < 5e-3 and d_ours < 5e-3
                assert int(theirs.argmax()) == int(ours.argmax())
                token, h = int(theirs.argmax()), h_next
    finally:
        peers.free_context(dft)
        peers.free_context(tgt)


def test_generate_cli_with_the_assistant(files):
    """`specconv generate TARGET --spec draft --draft ASSISTANT` drafts with the assistant and equals
    plain greedy decoding of the same prompt."""
    from click.testing import CliRunner

    from specconv import cli as cli_module

    common = ["generate", str(files[2]), "--tokens", ",".join(map(str, IDS)), "-n", "12", "--json", "--device", "cpu"]
    spec = CliRunner().invoke(cli_module.cli, common + ["--spec", "draft", "--draft", str(files[3]), "--no-baseline"])
    plain = CliRunner().invoke(cli_module.cli, common)
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.output + plain.output
    spec_json, plain_json = json.loads(spec.output), json.loads(plain.output)
    assert spec_json["tokens"] == plain_json["tokens"]
    assert spec_json["speculative"]["drafter"] == "gemma4-assistant" and spec_json["speculative"]["drafted"] > 0


def test_convert_output_for_the_assistant(files, tmp_path):
    """The assistant converts without the trunk-only notice (its layers are all draft layers) and
    names the dropped ordered-embedding tensors."""
    from click.testing import CliRunner

    from specconv import cli as cli_module

    res = CliRunner().invoke(cli_module.cli, ["convert", str(files[1]), "-o", str(tmp_path / "a.gguf"),
                                              "--outtype", "f32"])
    assert res.exit_code == 0, res.output
    assert "no MTP tensors" not in res.output
    assert "ordered-embedding" in res.output


def test_same_keys_and_tensors_as_llama_cpp_converter(files, tmp_path):
    """llama.cpp's own converter (docs/reference/gguf-layout.md §10, open point 1) writes the same KV pairs (values
    included) and tensor names for the target and the assistant. The only difference: it trims the
    embedding to len(vocab) + len(added_tokens), counting added tokens that are already in the vocab
    twice (404 rows for 400 tokens here, a file llama.cpp then refuses), and leaves the PLE table
    untrimmed; ours trims both to the real 400."""
    from gguf import GGUFReader

    from tests.fixtures.gguf_files import convert_gguf_upstream

    for src, ours in ((files[0], files[2]), (files[1], files[3])):
        theirs = convert_gguf_upstream(src, tmp_path / (ours.stem + "-upstream.gguf"), outtype="f32", pre="default")
        a, b = GGUFReader(theirs), GGUFReader(ours)
        ka = {k: field_value(f) for k, f in a.fields.items() if not k.startswith(("GGUF.", "general."))}
        kb = {k: field_value(f) for k, f in b.fields.items() if not k.startswith(("GGUF.", "general."))}
        assert ka == kb
        ta = {t.name: tuple(int(x) for x in t.shape) for t in a.tensors}
        tb = {t.name: tuple(int(x) for x in t.shape) for t in b.tensors}
        assert set(ta) == set(tb)
        differ = {n for n in ta if ta[n] != tb[n]}
        assert differ <= {"token_embd.weight", "per_layer_token_embd.weight"}
        assert all(tb[n][1] == g.VOCAB_REAL for n in differ)


def test_verify_sampling_distribution_with_the_assistant(files, tmp_path):
    """At T > 0 the assistant samples its drafts and hands q to the loop (Leviathan rule); verify's
    distribution check on real rows passes."""
    from click.testing import CliRunner

    from specconv import cli as cli_module

    report = tmp_path / "t.json"
    res = CliRunner().invoke(cli_module.cli, ["verify", str(files[2]), "--draft", str(files[3]), "-n", "6",
                                              "--temperature", "0.8", "--report", str(report)])
    data = json.loads(report.read_text())
    assert res.exit_code == 0, res.output
    dist = [c for c in data["checks"] if c["name"].startswith("distribution at T=0.8")]
    print(dist[0]["detail"])
    assert dist and dist[0]["passed"] and "leviathan" in dist[0]["name"]


def test_inspect_names_the_assistant(files):
    from specconv.convert.gguf_summary import summarize

    info = summarize(files[3])
    assert info["serves"] == ["mtp"] and info["problems"] == []
    assert "assistant" in info["kind"]
