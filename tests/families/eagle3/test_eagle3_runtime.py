"""EAGLE-3 in the runtime: parity with an independent torch forward, llama.cpp as peer, speculative decoding.

Targets: a tiny Qwen3.5 (hybrid: Gated DeltaNet + attention), its MoE variant, and a tiny LLaMA. Heads are random
(tests/fixtures/tiny_eagle3.py), so they accept almost nothing; the acceptance paths are driven by
a test drafter that runs the real EAGLE-3 machinery and then overrides some draft tokens with the
target's own continuation, so rounds accept 0..k drafts and the head's cache is checked against a
fresh recomputation after every round.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.drafters import Eagle3Drafter
from specconv.runtime.generate import generate
from specconv.runtime.speculative import SpecConfig, speculative_generate
from tests.fixtures.tiny_eagle3 import (
    SteeredEagle3, build_eagle3_head, build_llama_target, reference_d2t, reference_decoder, reference_encoder,
    target_features,
)
from tests.fixtures.gguf_files import convert_gguf
from tests.fixtures.tiny_qwen35 import build_qwen35

PROMPT = [5, 17, 200, 33, 4, 99, 7, 8, 120, 64]
TOL = 1e-4
# (target, layout, layer ids in the config, norm_before_fc): qwen35 reads its post-norm output (id L = 4) too.
# Ids at the top level (eagle layout) are layer inputs; in eagle_config (speculators layout) layer outputs,
# so [0, 2, 3] there reads layers [1, 3, 4] and [0, 2, 4] reads [1, 3, 5]
CASES = {
    "qwen35-eagle": ("qwen35", "eagle", [1, 2, 4], False),
    "qwen35-speculators": ("qwen35", "speculators", [0, 2, 3], True),
    "llama-speculators": ("llama", "speculators", [0, 2, 4], False),
    "llama-eagle": ("llama", "eagle", None, False),  # default layers [2, 3, 3]
    "qwen35moe-eagle": ("qwen35moe", "eagle", [0, 2, 3], False),
    "qwen35-target-head": ("qwen35", "eagle", [1, 2, 3], False),  # no lm_head / d2t: the target's output
    "llama-rope-llama3": ("llama", "eagle", [1, 2, 4], False),  # llama3 rope scaling: rope_freqs.weight
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # short, so the tiny head's frequencies are scaled


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("e3rt")
    targets = {"qwen35": build_qwen35(root / "qwen35", mtp=False), "llama": build_llama_target(root / "llama"),
               "qwen35moe": build_qwen35(root / "qwen35moe", moe=True, mtp=False)}
    files = {name: convert_gguf(d, root / f"{name}.gguf") for name, d in targets.items()}
    heads = {}
    for case, (tname, layout, ids, nbf) in CASES.items():
        hdir = build_eagle3_head(root / case, targets[tname], layout=layout, layer_ids=ids, norm_before_fc=nbf,
                                 seed=len(heads), lm_head=not case.endswith("target-head"),
                                 rope_scaling=LLAMA3_ROPE if case.endswith("llama3") else None)
        heads[case] = (hdir, convert_gguf(hdir, root / f"{case}.gguf", extra_args=["--target", str(targets[tname])]))
    return targets, files, heads


def _models(built, case):
    targets, files, heads = built
    tname = CASES[case][0]
    target = load_model(files[tname], device="cpu")
    head = load_model(heads[case][1], device="cpu", share_from=target)
    return target, head


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_independent_forward(built, case):
    from transformers import AutoModelForCausalLM

    targets, files, heads = built
    target, head = _models(built, case)
    layers = list(head.hparams.target_layers)
    hf_target = AutoModelForCausalLM.from_pretrained(targets[CASES[case][0]]).eval()
    ref_f = target_features(hf_target, PROMPT, layers)
    out = Context(target).decode(PROMPT, hidden=tuple(f"layer:{j}" for j in layers))
    ours_f = torch.cat([out.hidden[f"layer:{j}"] for j in layers], -1)
    g = Context(head, GraphType.ENCODER).encode(ours_f).hidden["g"]
    ref_g = reference_encoder(heads[case][0], ref_f)
    toks, pos = PROMPT[1:], list(range(len(PROMPT) - 1))
    dec = Context(head, GraphType.MTP, n_ctx=64).decode(toks, positions=pos, hidden_in=g[:-1])
    ref_logits, ref_out = reference_decoder(heads[case][0], hf_target.get_input_embeddings().weight.detach(), toks,
                                            ref_g[:-1], pos, hf_target.get_output_embeddings().weight.detach())
    d2t = reference_d2t(heads[case][0])
    if d2t is None:  # full vocabulary, no mapping
        d2t = torch.arange(target.vocab_size)
    diffs = {"features": (ours_f.double() - ref_f).abs().max().item(), "g": (g.double() - ref_g).abs().max().item(),
             "logits": (dec.logits[:, d2t].double() - ref_logits).abs().max().item(),
             "out": (dec.hidden["nextn"].double() - ref_out).abs().max().item()}
    print(f"\n{case}: max |Δ| vs independent torch forward (float64): " +
          ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert all(v < TOL for v in diffs.values()), diffs
    outside = torch.ones(dec.logits.shape[1], dtype=torch.bool)
    outside[d2t] = False
    assert torch.isneginf(dec.logits[:, outside]).all()  # a draft can only be a d2t id
    assert set(dec.logits.argmax(-1).tolist()) <= set(d2t.tolist())


@pytest.mark.parametrize("case", ["qwen35-eagle", "llama-speculators", "qwen35-target-head", "llama-rope-llama3"])
def test_llama_cpp_runs_the_head(built, case, llama_peer):
    from tests.fixtures.eagle3_peer import eagle3_rows

    _, files, heads = built
    target, head = _models(built, case)
    layers, f, g, logits, out = eagle3_rows(files[CASES[case][0]], heads[case][1], PROMPT)
    assert layers == list(head.hparams.target_layers)
    ours = Context(target).decode(PROMPT, hidden=tuple(f"layer:{j}" for j in layers))
    ours_f = torch.cat([ours.hidden[f"layer:{j}"] for j in layers], -1).numpy()
    ours_g = Context(head, GraphType.ENCODER).encode(torch.from_numpy(f)).hidden["g"].numpy()
    dec = Context(head, GraphType.MTP, n_ctx=64).decode(PROMPT[1:], positions=list(range(len(PROMPT) - 1)),
                                                       hidden_in=torch.from_numpy(g[:-1]))
    ours_l = dec.logits.numpy()
    finite = np.isfinite(ours_l)
    diffs = {"features": np.abs(f - ours_f).max(), "g": np.abs(g - ours_g).max(),
             "logits": np.abs(logits[finite] - ours_l[finite]).max(),
             "out": np.abs(out - dec.hidden["nextn"].numpy()).max()}
    print(f"\n{case}: max |Δ| vs llama.cpp (draft-eagle3 steps): " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    np.testing.assert_array_equal(np.isfinite(logits), finite)  # same -inf outside d2t
    assert all(v < TOL for v in diffs.values()), diffs


@pytest.mark.parametrize("case", ["qwen35-eagle", "llama-eagle", "qwen35moe-eagle"])
def test_greedy_speculative_equals_plain(built, case):
    target, head = _models(built, case)
    plain = generate(target, PROMPT, 16).tokens
    for k in (1, 3, 4):
        for rollback in ("snapshot", "checkpoint"):
            drafter = Eagle3Drafter(head, target, n_ctx=64)
            res = speculative_generate(target, drafter, PROMPT, 16, SpecConfig(draft_max=k, rollback=rollback))
            s = res.stats["speculative"]
            assert res.tokens == plain, (k, rollback)
            assert s["drafter"] == "eagle3" and len(s["per_position"]) == k and s["drafted"] > 0
            assert drafter.committed_rows() == len(PROMPT) + len(res.tokens) - 2  # rows 0..n_past-2


@pytest.mark.parametrize("case", ["qwen35-speculators", "llama-speculators"])
def test_accepting_rounds_keep_the_head_cache_exact(built, case):
    target, head = _models(built, case)
    n = 14
    truth = PROMPT + generate(target, PROMPT, n + 1).tokens
    layers = tuple(f"layer:{j}" for j in head.hparams.target_layers)
    worst = [0.0]

    def check(ctx, rnd):
        # the steered drafter's next seed row vs a fresh drafter started on the committed prefix
        committed = ctx.n_past()
        fresh = Eagle3Drafter(head, target, n_ctx=64)
        feats = Context(target).decode(truth[:committed], hidden=layers)
        fresh.start(truth[:committed], torch.cat([feats.hidden[x] for x in layers], -1))
        assert steered.committed_rows() == fresh.committed_rows() == committed - 1
        assert steered.n_committed == committed
        worst[0] = max(worst[0], (steered.pending_g - fresh.pending_g).abs().max().item())
        a = steered.ctx.decode([truth[committed]], positions=[committed - 1], hidden_in=steered.pending_g[None])
        b = fresh.ctx.decode([truth[committed]], positions=[committed - 1], hidden_in=fresh.pending_g[None])
        steered.ctx.seq_rm(0, committed - 1)
        worst[0] = max(worst[0], (a.logits[a.logits.isfinite()] - b.logits[b.logits.isfinite()]).abs().max().item())

    steered = SteeredEagle3(head, target, 64, truth)
    res = speculative_generate(target, steered, PROMPT, n, SpecConfig(draft_max=3), on_round=check)
    s = res.stats["speculative"]
    print(f"\n{case}: steered rounds accepted {s['accepted']}/{s['drafted']}, per position {s['per_position']}, "
          f"head cache and pending g vs fresh max |Δ| {worst[0]:.2e}")
    assert res.tokens == truth[len(PROMPT):len(PROMPT) + n]
    assert s["accepted"] > 0 and s["per_position"][2] > 0  # some rounds accepted all 3
    assert worst[0] < TOL


def test_sampled_drafts_stay_in_the_draft_vocabulary(built):
    target, head = _models(built, "qwen35-eagle")
    d2t = set(head.weights["d2t"].tolist())
    drafter = Eagle3Drafter(head, target, n_ctx=64)
    layers = tuple(f"layer:{j}" for j in head.hparams.target_layers)
    out = Context(target).decode(PROMPT[:-1], hidden=layers)
    drafter.start(PROMPT[:-1], torch.cat([out.hidden[x] for x in layers], -1))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        d = drafter.draft(PROMPT[-1], 4, 0.0, 1.5, gen)
        assert len(d) == 4 and set(d.tokens) <= d2t
        assert d.probs.shape == (4, target.vocab_size)
        outside = torch.ones(target.vocab_size, dtype=torch.bool)
        outside[sorted(d2t)] = False
        assert (d.probs[:, outside] == 0).all()
        torch.testing.assert_close(d.probs.sum(-1), torch.ones(4))
        drafter.ctx.seq_rm(0, drafter.n_committed - 1)  # back to the committed rows


def test_head_must_fit_its_target(built, tmp_path):
    from specconv.errors import SpecconvError

    targets, files, heads = built
    qwen = load_model(files["qwen35"], device="cpu")
    llama_head = load_model(heads["llama-speculators"][1], device="cpu", share_from=qwen)
    with pytest.raises(SpecconvError, match="target layer input 5"):
        Eagle3Drafter(llama_head, qwen, n_ctx=32)


@pytest.mark.parametrize("case", ["qwen35-eagle", "llama-speculators"])
def test_draft_chain_matches_llama_cpp(built, case, llama_peer):
    """Four chained drafts (each step fed the previous pre-norm output) equal llama.cpp's."""
    from tests.fixtures.eagle3_peer import eagle3_draft_chain

    _, files, heads = built
    target, head = _models(built, case)
    id_last, theirs, their_logits = eagle3_draft_chain(files[CASES[case][0]], heads[case][1], PROMPT, 4)
    layers = tuple(f"layer:{j}" for j in head.hparams.target_layers)
    out = Context(target).decode(PROMPT, hidden=layers)
    assert int(out.logits[-1].argmax()) == id_last
    drafter = Eagle3Drafter(head, target, n_ctx=64)
    drafter.start(PROMPT, torch.cat([out.hidden[x] for x in layers], -1))
    seen = []
    decode = drafter.ctx.decode

    def recording(*args, **kwargs):
        res = decode(*args, **kwargs)
        seen.append(res.logits[-1].numpy().copy())
        return res

    drafter.ctx.decode = recording
    ours = drafter.draft(id_last, 4).tokens
    finite = np.isfinite(their_logits)
    diff = np.abs(np.stack(seen)[finite] - their_logits[finite]).max()
    print(f"\n{case}: drafts ours {ours} llama.cpp {theirs}, max |Δlogit| over the chain {diff:.2e}")
    assert ours == theirs
    np.testing.assert_array_equal(np.isfinite(np.stack(seen)), finite)
    assert diff < TOL


def test_llama_target_graph(built, llama_peer):
    """The plain LLaMA graph (our conversion, NORM rope on pair-permuted q/k) vs transformers and llama.cpp."""
    from transformers import AutoModelForCausalLM

    targets, files, _ = built
    target = load_model(files["llama"], device="cpu")
    ours = Context(target).decode(PROMPT).logits.double()
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(targets["llama"]).eval()(torch.tensor([PROMPT])).logits[0].double()
    theirs = torch.from_numpy(llama_peer.llama_logits(files["llama"], PROMPT)).double()
    d_hf, d_cpp = (ours - hf).abs().max().item(), (ours - theirs).abs().max().item()
    print(f"\nllama target: max |Δlogit| vs transformers {d_hf:.2e}, vs llama.cpp {d_cpp:.2e}")
    assert d_hf < TOL and d_cpp < TOL


@pytest.mark.parametrize("case", ["qwen35-eagle", "llama-speculators"])
def test_rejection_sampling_with_reduced_vocabulary(built, case):
    """T > 0: the first emitted token, drawn through Leviathan's rule with the head's q (zero outside
    d2t), follows the target's p (chi-square), and the acceptance rate is Σ min(p, q) over the target vocabulary."""
    from specconv.verify.roundtrip import DIST_TRIALS, acceptance_close, distribution_check

    target, head = _models(built, case)
    drafter = Eagle3Drafter(head, target, n_ctx=64)
    results = distribution_check(target, drafter, [PROMPT, PROMPT[3:]], 1.0, seed=1)
    for p_value, measured, exact, rule in results:
        print(f"\n{case}: T=1 {rule}: chi-square p {p_value:.3f}, acceptance {measured:.3f} vs Σmin(p,q) {exact:.3f} "
              f"({DIST_TRIALS} draws)")
        assert rule == "leviathan" and p_value > 1e-3 and acceptance_close(measured, exact)
