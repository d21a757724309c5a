"""EAGLE-3 heads for Qwen3 and Qwen3-MoE targets, in the layouts SpecForge and AngelSlim publish.

Targets: a tiny 8-layer `Qwen3ForCausalLM` (tied embeddings, head_dim 32 != 64/4) and an 8-layer
`Qwen3MoeForCausalLM` (tests/fixtures/tiny_qwen3.py). Heads (tests/fixtures/tiny_eagle3_qwen3.py):
* "specforge": `LlamaForCausalLMEagle3`, ids [0, 2, 6] in `eagle_config` (layer OUTPUTS: transformers'
  `hidden_states[1, 3, 7]`), no embedding of its own;
* "angelslim": `Eagle3LlamaForCausalLM`, ids [0, 4, 6] in `aux_hidden_states_layer_ids` (layer OUTPUTS:
  `hidden_states[1, 5, 7]`), its own embedding.
Both have head_dim 24 != 64/4 and a 160-token draft vocabulary (`d2t`). The ids are off every default
for L = 8 (as layer inputs: llama.cpp / vLLM / SGLang / SpecForge [2, 4, 5], AngelSlim [2, 4, 6]); the
expected layers are written here from the convention, never taken from the converter. The reference is
the fixture's float64 forward from the HF tensors fed transformers' hidden states; llama.cpp
(llama-cpp-python) runs our target + head files with its own layer extraction, encoder and decoder.
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
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_eagle3 import SteeredEagle3
from tests.fixtures.tiny_eagle3_qwen3 import HEAD_DIM, Reference, build_head
from tests.fixtures.tiny_qwen3 import build_qwen3, load_hf

torch.set_num_threads(1)
PROMPT = [5, 17, 200, 33, 4, 99, 7, 8, 120, 64, 300, 41]
N_DRAFT = 3
TOL = 1e-4
TARGETS = {"qwen3": {"tie": True}, "qwen3moe": {"moe": True}}
SHAPE = {"n_layers": 8, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 32}
# head -> (layout, ids in its config, transformers hidden_states = GGUF eagle3.target_layers)
HEADS = {"specforge": ("specforge", [0, 2, 6], [1, 3, 7]), "angelslim": ("angelslim", [0, 4, 6], [1, 5, 7])}
CASES = [f"{t}-{h}" for t in TARGETS for h in HEADS]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("e3q3")
    dirs, files = {}, {}
    for seed, (tname, kw) in enumerate(TARGETS.items()):
        dirs[tname] = build_qwen3(root / tname, seed=seed, **SHAPE, **kw)
        files[tname] = convert_gguf(dirs[tname], root / f"{tname}.gguf")
        for k, (hname, (layout, ids, _)) in enumerate(HEADS.items()):
            case = f"{tname}-{hname}"
            dirs[case] = build_head(root / case, dirs[tname], layout=layout, ids=ids, seed=10 * seed + k)
            files[case] = convert_gguf(dirs[case], root / f"{case}.gguf", extra_args=["--target", str(dirs[tname])])
    return root, dirs, files


def _split(case):
    tname, hname = case.split("-")
    return tname, hname


def _models(built, case):
    _, _, files = built
    target = load_model(files[_split(case)[0]], device="cpu")
    return target, load_model(files[case], device="cpu", share_from=target)


def _reference(built, case):
    _, dirs, _ = built
    tname, _ = _split(case)
    return Reference(dirs[case], load_hf(dirs[tname]))


@pytest.mark.parametrize("case", CASES)
def test_conversion_reads_each_layout(built, case):
    _, _, files = built
    r = GGUFReader(files[case])
    kv = {k: f.contents() for k, f in r.fields.items()}
    assert kv["general.architecture"] == "eagle3"
    assert list(kv["eagle3.target_layers"]) == HEADS[_split(case)[1]][2]
    assert kv["eagle3.attention.key_length"] == kv["eagle3.attention.value_length"] == HEAD_DIM
    assert kv["eagle3.target_hidden_size"] == SHAPE["hidden"] and kv["tokenizer.ggml.pre"] == "qwen2"
    names = {t.name for t in r.tensors}
    assert ("token_embd.weight" in names) == case.endswith("angelslim") and "d2t" in names


@pytest.mark.parametrize("case", CASES)
def test_runtime_equals_the_reference(built, case):
    """Our target's features at the GGUF's layers, g, the draft logits and the first round's drafts (through the
    speculative loop) against the independent float64 reference fed transformers' hidden states."""
    target, head = _models(built, case)
    ref = _reference(built, case)
    hs = HEADS[_split(case)[1]][2]
    assert list(head.hparams.target_layers) == hs
    ref_f, ref_g, ref_logits = ref.rows(PROMPT, hs)
    layers = tuple(f"layer:{j}" for j in hs)
    ours_f = torch.cat([Context(target).decode(PROMPT, hidden=layers).hidden[x] for x in layers], -1)
    g = Context(head, GraphType.ENCODER).encode(ours_f).hidden["g"]
    dec = Context(head, GraphType.MTP, n_ctx=64).decode(PROMPT[1:], positions=list(range(len(PROMPT) - 1)),
                                                       hidden_in=g[:-1])
    d = {"features": (ours_f.double() - ref_f).abs().max().item(), "g": (g.double() - ref_g).abs().max().item(),
         "logits": (dec.logits[:, ref.d2t].double() - ref_logits).abs().max().item()}
    ref_drafts = ref.drafts(PROMPT, hs, N_DRAFT)
    res = speculative_generate(target, Eagle3Drafter(head, target, n_ctx=64), PROMPT, 6, SpecConfig(draft_max=N_DRAFT))
    ours = res.stats["rounds"][0]["drafted"]
    print(f"\n{case}: runtime vs reference max |Δ| " + ", ".join(f"{k} {v:.2e}" for k, v in d.items())
          + f"; first drafts ours {ours} reference {ref_drafts}")
    assert all(v < TOL for v in d.values()), d
    assert ours == ref_drafts
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[ref.d2t] = False
    assert torch.isneginf(dec.logits[:, outside]).all()


@pytest.mark.parametrize("case", CASES)
def test_llama_cpp_runs_our_files(built, case, llama_peer):
    """llama.cpp loads our target + head and builds the draft context (ctx_other = target); its draft logits
    (its own qwen3 / qwen3moe layer extraction, encoder, decoder) equal the reference's within 1e-4, and its
    chained drafts equal the reference's and ours."""
    from tests.fixtures.eagle3_peer import eagle3_draft_chain, eagle3_rows

    _, _, files = built
    ref = _reference(built, case)
    hs = HEADS[_split(case)[1]][2]
    _, _, ref_logits = ref.rows(PROMPT, hs)
    layers, _, _, logits, _ = eagle3_rows(files[_split(case)[0]], files[case], PROMPT)
    assert layers == hs
    d2t = ref.d2t.numpy()
    diff = float(np.abs(logits[:, d2t] - ref_logits.numpy()).max())
    outside = np.ones(logits.shape[1], dtype=bool)
    outside[d2t] = False
    id_last, theirs, _ = eagle3_draft_chain(files[_split(case)[0]], files[case], PROMPT, N_DRAFT)
    ref_drafts = ref.drafts(PROMPT + [id_last], hs, N_DRAFT)
    target, head = _models(built, case)
    lay = tuple(f"layer:{j}" for j in hs)
    out = Context(target).decode(PROMPT, hidden=lay)
    drafter = Eagle3Drafter(head, target, n_ctx=64)
    drafter.start(PROMPT, torch.cat([out.hidden[x] for x in lay], -1))
    ours = drafter.draft(id_last, N_DRAFT).tokens
    print(f"\n{case}: llama.cpp draft logits vs the reference max |Δ| {diff:.2e} over {logits.shape[0]} rows; "
          f"drafts llama.cpp {theirs} reference {ref_drafts} ours {ours}")
    assert diff < TOL and np.isneginf(logits[:, outside]).all()
    assert theirs == ref_drafts == ours


@pytest.mark.parametrize("case", ["qwen3-specforge", "qwen3moe-angelslim"])
def test_speculative_greedy_equals_plain(built, case):
    target, head = _models(built, case)
    n = 14
    plain = generate(target, PROMPT, n).tokens
    for k in (1, 3):
        for rollback in ("snapshot", "checkpoint"):
            res = speculative_generate(target, Eagle3Drafter(head, target, n_ctx=64), PROMPT, n,
                                       SpecConfig(draft_max=k, rollback=rollback))
            assert res.tokens == plain, (k, rollback)
    truth = PROMPT + generate(target, PROMPT, n + 1).tokens
    res = speculative_generate(target, SteeredEagle3(head, target, 64, truth), PROMPT, n, SpecConfig(draft_max=3))
    s = res.stats["speculative"]
    print(f"\n{case}: steered rounds accepted {s['accepted']}/{s['drafted']}, per position {s['per_position']}")
    assert res.tokens == plain and s["accepted"] > 0 and s["per_position"][2] > 0


def _generate_json(*args):
    res = CliRunner().invoke(cli.cli, ["generate", *map(str, args), "--tokens", ",".join(map(str, PROMPT)), "-n", "10",
                                       "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def test_generate_spec_eagle3(built):
    """`generate --spec eagle3 --draft HEAD` on a Qwen3-MoE target: plain greedy's tokens; the first round drafts
    the reference's tokens."""
    _, _, files = built
    case = "qwen3moe-specforge"
    plain = _generate_json(files["qwen3moe"])
    spec = _generate_json(files["qwen3moe"], "--spec", "eagle3", "--draft", files[case], "--draft-max", N_DRAFT,
                          "--no-baseline")
    ref_drafts = _reference(built, case).drafts(PROMPT, HEADS["specforge"][2], N_DRAFT)
    print(f"\ngenerate --spec eagle3: {spec['tokens']} (plain {plain['tokens']}); first round {spec['rounds'][0]}")
    assert spec["tokens"] == plain["tokens"] and spec["speculative"]["drafter"] == "eagle3"
    assert spec["rounds"][0]["drafted"] == ref_drafts
