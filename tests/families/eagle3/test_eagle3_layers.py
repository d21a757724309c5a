"""EAGLE-3 target layers in their two conventions, end to end (docs/eagle3.md, "Two conventions").

A tiny 8-layer Llama target and two random heads whose ids avoid every default (llama.cpp / vLLM /
SGLang [2, 4, 5] as inputs; SpecForge [1, 3, 4] and AngelSlim [1, 3, 5] as outputs):
* "eagle_config": speculators layout, ids [1, 4, 6] in `eagle_config` (SpecForge's key: layer OUTPUTS),
  so the head reads transformers' `hidden_states[2, 5, 7]`;
* "top_level": EAGLE layout, ids [1, 3, 6] at the top level (vLLM's key: layer INPUTS), so it reads
  `hidden_states[1, 3, 6]`.
The expected layers are written here from the convention, never taken from the converter. The
independent reference is tests/fixtures/tiny_eagle3.py (float64, from the HF tensors); llama.cpp
(llama-cpp-python) runs our files; "moved" is the eagle_config head converted with its ids unshifted
(--target-layers 1,4,6), what the converter wrote before.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGUFReader

from specconv import cli
from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import Eagle3Drafter
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures.tiny_eagle3 import (
    build_eagle3_head, build_llama_target, reference_d2t, reference_decoder, reference_encoder, target_features,
)
from tests.fixtures.gguf_files import convert_gguf

PROMPT = [5, 17, 200, 33, 4, 99, 7, 8, 120, 64]
N_DRAFT = 3
TOL = 1e-4
# head -> (layout, ids in its config, transformers hidden_states it must read)
HEADS = {
    "eagle_config": ("speculators", [1, 4, 6], [i + 1 for i in [1, 4, 6]]),  # layer outputs: hidden_states[i + 1]
    "top_level": ("eagle", [1, 3, 6], [1, 3, 6]),  # layer inputs: hidden_states[i]
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("e3layers")
    target = build_llama_target(root / "llama8", n_layers=8)
    files = {"target": convert_gguf(target, root / "target.gguf")}
    dirs = {"target": target}
    for seed, (name, (layout, ids, _)) in enumerate(HEADS.items()):
        dirs[name] = build_eagle3_head(root / name, target, layout=layout, layer_ids=ids, seed=20 + seed)
        files[name] = convert_gguf(dirs[name], root / f"{name}.gguf", extra_args=["--target", str(target)])
    files["moved"] = convert_gguf(dirs["eagle_config"], root / "moved.gguf",
                                  extra_args=["--target", str(target), "--target-layers", "1,4,6"])
    return root, dirs, files


def _layers(path) -> list[int]:
    return [int(v) for v in GGUFReader(path).fields["eagle3.target_layers"].contents()]


def _hf(dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()


def _reference_rows(dirs, name, hf_target):
    """Reference decoder rows over the prompt (row t = (PROMPT[t+1], g_t)): features, logits over target ids, out."""
    feats = target_features(hf_target, PROMPT, HEADS[name][2])
    g = reference_encoder(dirs[name], feats)
    emb, head = hf_target.get_input_embeddings().weight.detach(), hf_target.get_output_embeddings().weight.detach()
    logits, out = reference_decoder(dirs[name], emb, PROMPT[1:], g[:-1], list(range(len(PROMPT) - 1)), head)
    return feats, g, logits, out


def _reference_drafts(dirs, name, hf_target, k):
    """The reference's first round after PROMPT, as the speculative loop runs it: rows of PROMPT[:-1] are
    committed, the seed row (PROMPT[-1], g of the row before) gives d_1, each draft and the previous pre-norm
    out give the next. Greedy over the draft vocabulary, mapped to target ids."""
    feats = target_features(hf_target, PROMPT, HEADS[name][2])
    g = reference_encoder(dirs[name], feats)
    emb, head = hf_target.get_input_embeddings().weight.detach(), hf_target.get_output_embeddings().weight.detach()
    d2t = reference_d2t(dirs[name])
    tokens, rows, pos, drafts = list(PROMPT[1:]), g[:-1], list(range(len(PROMPT) - 1)), []
    for _ in range(k):
        logits, out = reference_decoder(dirs[name], emb, tokens, rows, pos, head)
        d = int(d2t[int(logits[-1].argmax())])
        drafts.append(d)
        tokens, rows, pos = tokens + [d], torch.cat([rows, out[-1:]]), pos + [pos[-1] + 1]
    return drafts


def test_converted_target_layers(built):
    _, _, files = built
    assert _layers(files["eagle_config"]) == [2, 5, 7]  # the goal: eagle_config [1, 4, 6] -> [2, 5, 7]
    assert _layers(files["top_level"]) == [1, 3, 6]
    assert _layers(files["moved"]) == [1, 4, 6]  # --target-layers is taken as layer inputs, as given


def _convert_json(head, target, out, *extra):
    res = CliRunner().invoke(cli.cli, ["convert", str(head), "-o", str(out), "--outtype", "f32", "--target", str(target),
                                       "--json", *extra])
    return res


def test_other_keys_and_refusals(built, tmp_path):
    import shutil

    _, dirs, files = built
    # AngelSlim's key names layer outputs; a SpecForge id list lifted unchanged next to eagle_config is
    # reported and eagle_config wins
    cases = {"angelslim": ({"aux_hidden_states_layer_ids": [0, 2, 5]}, [1, 3, 6]),
             "lifted": ({"eagle_aux_hidden_state_layer_ids": [1, 4, 6],
                         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}}, [2, 5, 7])}
    for name, (keys, want) in cases.items():
        head = shutil.copytree(dirs["top_level"], tmp_path / name)
        cfg = json.loads((head / "config.json").read_text())
        cfg.pop("eagle_aux_hidden_state_layer_ids")
        (head / "config.json").write_text(json.dumps({**cfg, **keys}))
        res = _convert_json(head, dirs["target"], tmp_path / f"{name}.gguf")
        assert res.exit_code == 0, res.output
        assert _layers(tmp_path / f"{name}.gguf") == want
        notices = json.loads(res.output)["notices"]
        print(f"\n{name}: {notices}")
        assert any(f"eagle3.target_layers {want}" in n for n in notices)
        if name == "lifted":
            assert any("disagrees" in n for n in notices)
    for extra, needle in ((["--target-layers", "1,4,9"], "target layer 9 (from --target-layers (layer inputs)) is "
                                                          "outside 0..8"),
                          (["--target-layers", "1,4"], "expected three non-negative layer ids"),
                          (["--target-layers", "a,b,c"], "expected three comma-separated layer ids")):
        res = _convert_json(dirs["eagle_config"], dirs["target"], tmp_path / "refused.gguf", *extra)
        assert res.exit_code != 0 and needle in str(res.exception) and "\n" not in str(res.exception).strip()
    res = CliRunner().invoke(cli.cli, ["convert", str(dirs["target"]), "-o", str(tmp_path / "t.gguf"),
                                       "--target-layers", "1,2,3"])
    assert res.exit_code != 0 and "--target-layers is only for draft heads" in str(res.exception)
    assert not list(tmp_path.glob("refused*")) and not (tmp_path / "t.gguf").exists()


def test_inspect_shows_layers_and_convention(built):
    _, _, files = built
    res = CliRunner().invoke(cli.cli, ["inspect", str(files["eagle_config"]), "--json"])
    e3 = json.loads(res.output)["eagle3"]
    assert e3["target_layers"] == [2, 5, 7] and e3["convention"].startswith("layer inputs")
    text = " ".join(CliRunner().invoke(cli.cli, ["inspect", str(files["eagle_config"])]).output.split())  # unwrapped
    assert "reads target layers [2, 5, 7]" in text and "layer inputs" in text


@pytest.mark.parametrize("name", list(HEADS))
def test_runtime_drafts_equal_the_reference(built, name):
    """Our runtime reads exactly the GGUF's layers (= transformers' hidden_states the convention names), and
    the first round of the speculative loop drafts the reference's tokens; `rounds` in the stats shows them."""
    _, dirs, files = built
    hf_target = _hf(dirs)
    target = load_model(files["target"], device="cpu")
    head = load_model(files[name], device="cpu", share_from=target)
    assert list(head.hparams.target_layers) == HEADS[name][2]
    layers = tuple(f"layer:{j}" for j in head.hparams.target_layers)
    ref_f, ref_g, ref_logits, _ = _reference_rows(dirs, name, hf_target)
    ours_f = torch.cat([Context(target).decode(PROMPT, hidden=layers).hidden[x] for x in layers], -1)
    d_feat = (ours_f.double() - ref_f).abs().max().item()
    g = Context(head, GraphType.ENCODER).encode(ours_f).hidden["g"]
    dec = Context(head, GraphType.MTP, n_ctx=64).decode(PROMPT[1:], positions=list(range(len(PROMPT) - 1)),
                                                       hidden_in=g[:-1])
    d_logits = (dec.logits[:, reference_d2t(dirs[name])].double() - ref_logits).abs().max().item()
    ref_drafts = _reference_drafts(dirs, name, hf_target, N_DRAFT)
    res = speculative_generate(target, Eagle3Drafter(head, target, n_ctx=64), PROMPT, 6, SpecConfig(draft_max=N_DRAFT))
    rounds = res.stats["rounds"]
    print(f"\n{name}: layers {list(head.hparams.target_layers)}, max |Δ| vs the reference: features {d_feat:.2e}, "
          f"draft logits {d_logits:.2e}; first drafts ours {rounds[0]['drafted']} reference {ref_drafts}")
    assert d_feat < TOL and d_logits < TOL
    assert rounds[0]["drafted"] == ref_drafts
    s = res.stats["speculative"]
    assert len(rounds) == s["rounds"] and sum(r["accepted"] for r in rounds) == s["accepted"]
    assert sum(len(r["drafted"]) for r in rounds) == s["drafted"]


def test_generate_json_lists_rounds(built):
    """`generate --json --spec eagle3`: each round's drafted ids and accepted count, the first round being the
    reference's drafts; accepted drafts are the tokens that follow in the output."""
    _, dirs, files = built
    ref_drafts = _reference_drafts(dirs, "eagle_config", _hf(dirs), N_DRAFT)
    res = CliRunner().invoke(cli.cli, ["generate", str(files["target"]), "--spec", "eagle3", "--draft",
                                       str(files["eagle_config"]), "--tokens", ",".join(map(str, PROMPT)), "-n", "8",
                                       "--draft-max", str(N_DRAFT), "--no-baseline", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.output.strip().splitlines()[-1])
    rounds, s = payload["rounds"], payload["speculative"]
    print(f"\ngenerate --json rounds: {rounds}")
    assert rounds[0]["drafted"] == ref_drafts
    assert len(rounds) == s["rounds"] and sum(r["accepted"] for r in rounds) == s["accepted"]
    _check_rounds(rounds, payload["tokens"])
    # the target as its own draft model accepts every draft: the rounds show them as the output
    res = CliRunner().invoke(cli.cli, ["generate", str(files["target"]), "--spec", "draft", "--draft", str(files["target"]),
                                       "--tokens", ",".join(map(str, PROMPT)), "-n", "8", "--draft-max", str(N_DRAFT),
                                       "--no-baseline", "--device", "cpu", "--json"])
    payload = json.loads(res.output.strip().splitlines()[-1])
    print(f"the target as its own draft: rounds {payload['rounds']}")
    assert all(r["accepted"] == len(r["drafted"]) for r in payload["rounds"]) and payload["rounds"][0]["accepted"] == N_DRAFT
    _check_rounds(payload["rounds"], payload["tokens"])


def _check_rounds(rounds, out):
    """Each round emits its accepted drafts, then one target token: together they are the output."""
    emitted = 0
    for r in rounds:
        assert 0 <= r["accepted"] <= len(r["drafted"]) <= N_DRAFT
        assert r["drafted"][:r["accepted"]] == out[emitted:emitted + r["accepted"]]
        emitted += r["accepted"] + 1
    assert emitted == len(out)


@pytest.mark.parametrize("name", list(HEADS))
def test_llama_cpp_draft_logits_agree_with_the_reference(built, name, llama_peer):
    """llama.cpp builds the draft context from our target + head files; its draft logits (its own target-layer
    extraction, encoder and decoder) equal the reference's within 1e-4. The head with its layers moved by one
    is off by far more, so the comparison sees the layers."""
    from tests.fixtures.eagle3_peer import eagle3_rows

    _, dirs, files = built
    hf_target = _hf(dirs)
    _, _, ref_logits, _ = _reference_rows(dirs, name, hf_target)
    d2t = reference_d2t(dirs[name]).numpy()
    layers, _, _, logits, _ = eagle3_rows(files["target"], files[name], PROMPT)
    assert layers == HEADS[name][2]
    diff = float(np.abs(logits[:, d2t] - ref_logits.numpy()).max())
    outside = np.ones(logits.shape[1], dtype=bool)
    outside[d2t] = False
    print(f"\n{name}: llama.cpp draft logits vs the reference: max |Δ| {diff:.2e} over {logits.shape[0]} rows")
    assert diff < TOL and np.isneginf(logits[:, outside]).all()
    if name == "eagle_config":
        _, _, _, moved, _ = eagle3_rows(files["target"], files["moved"], PROMPT)
        off = float(np.abs(moved[:, d2t] - ref_logits.numpy()).max())
        print(f"moved by one (layers {_layers(files['moved'])}): llama.cpp vs the reference max |Δ| {off:.2e}")
        assert off > 100 * TOL
