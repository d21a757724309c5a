"""DSA with `index_topk` below the context (runtime/graphs/dsa.py `select`, docs/dsa.md "Ties"):
top-k 6 against a 16-token prompt and 24 generated tokens, on two tiny files per family: 8 indexer
heads, and 2 heads, where the ReLU often zeroes every head's term so that several keys score exactly
0 at the top-k boundary (the fixtures count such rows and require some).

* a verification batch of n rows gives, row for row, the logits of decoding those rows one at a
  time (float64: within rounding; float32 too), batches straddling the prompt's end and each other,
  for the trunk and for the MTP head (its own indexer);
* our greedy decoding (cached, one token per step) equals transformers' greedy computed with a full
  forward over the whole sequence at every step, for 24 tokens, in float32 and float64, and the
  prompt's logits equal transformers' forward; transformers' indexers break exact ties as our rule
  does (specconv/verify/dsa_ties.py `EarliestOnTies`), other rows keep transformers' own choice;
* `specconv verify --hf` passes its round trips (MTP and n-gram drafters, draft_max 1..4, snapshot
  and checkpoint rollback) and its parity checks (trunk, MTP head) on the embedded file in float32
  and on trunk + sidecar in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.graphs import dsa
from specconv.verify.dsa_ties import EarliestOnTies
from specconv.verify.parity import reference_precision
from tests.fixtures import mtp_checks
from tests.fixtures import tiny_dsa as tiny
from tests.fixtures.tiny_tools import float64_copy

torch.set_num_threads(1)
TOPK = 6
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, tiny.VOCAB - 6, 16)]
GENERATED = 24
BATCHES = (1, 2, 3, 4, 3, 2, 4, 1, 4)  # rows per verification batch after the prompt: 24 rows in all
SHAPES = {"8 indexer heads": {}, "2 indexer heads": {"index_n_heads": 2}}
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dsa_topk")


def _files(root, family, shape):
    return tiny.converted(family, root, index_topk=TOPK, **SHAPES[shape])


class BoundaryTies:
    """Counts the query rows whose index scores tie exactly at the top-k boundary (visible keys only)."""

    def __init__(self, monkeypatch):
        self.rows = 0
        original = dsa.select

        def counting(hp, scores, visible):
            k = hp.index_topk
            ranked = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values
            if ranked.shape[1] > k:
                edge, after = ranked[:, k - 1], ranked[:, k]
                self.rows += int(((edge == after) & torch.isfinite(after)).sum())
            return original(hp, scores, visible)

        monkeypatch.setattr(dsa, "select", counting)


def _one_by_one(ctx, tokens, hidden_in=None):
    rows = []
    for j, t in enumerate(tokens):
        kw = {} if hidden_in is None else {"hidden_in": hidden_in[j:j + 1]}
        rows.append(ctx.decode([t], **kw).logits)
    return torch.cat(rows)


def _in_batches(ctx, tokens, hidden_in=None):
    rows, j = [], 0
    for n in BATCHES:
        kw = {} if hidden_in is None else {"hidden_in": hidden_in[j:j + n]}
        rows.append(ctx.decode(tokens[j:j + n], **kw).logits)
        j += n
    assert j == len(tokens)
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_verification_batches_equal_one_by_one(root, family, shape, dtype, monkeypatch):
    _, files = _files(root, family, shape)
    model = load_model(files["embed"], device="cpu", dtype=dtype)
    ties = BoundaryTies(monkeypatch)
    seq = PROMPT + [int(x) for x in np.random.default_rng(6).integers(0, tiny.VOCAB - 6, GENERATED)]
    later = seq[len(PROMPT):]

    ctx = Context(model, GraphType.MAIN, n_ctx=64)
    ctx.decode(PROMPT)
    alone = _one_by_one(ctx, later)
    ctx = Context(model, GraphType.MAIN, n_ctx=64)
    ctx.decode(PROMPT)
    batched = _in_batches(ctx, later)
    whole = Context(model, GraphType.MAIN, n_ctx=64).decode(seq)
    trunk = mtp_checks.max_diff(batched, alone)
    prefill = mtp_checks.max_diff(whole.logits[len(PROMPT):], alone)

    # the MTP head (its own indexer) on transformers' rows: token t+1 with the target's hidden state of t
    hidden = whole.hidden["post_norm"]
    ctx = Context(model, GraphType.MTP, n_ctx=64)
    ctx.decode(seq[1:len(PROMPT)], hidden_in=hidden[:len(PROMPT) - 1])
    head_alone = _one_by_one(ctx, seq[len(PROMPT):], hidden[len(PROMPT) - 1:-1])
    ctx = Context(model, GraphType.MTP, n_ctx=64)
    ctx.decode(seq[1:len(PROMPT)], hidden_in=hidden[:len(PROMPT) - 1])
    head_batched = _in_batches(ctx, seq[len(PROMPT):], hidden[len(PROMPT) - 1:-1])
    head = mtp_checks.max_diff(head_batched, head_alone)
    print(f"{family}, {shape}, {dtype}: top-{TOPK} rows with an exact tie at the boundary {ties.rows}; "
          f"batches {BATCHES} vs one by one: max |Δlogit| trunk {trunk:.3g}, whole sequence in one batch "
          f"{prefill:.3g}, MTP head {head:.3g}")
    assert max(trunk, prefill, head) < TOL[dtype]
    if shape == "2 indexer heads":
        assert ties.rows > 0  # the fixture exercises ties


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_greedy_equals_transformers_full_forwards(root, family, shape):
    """Float64 on both sides: transformers' float32 upcasts made float64 too (verify's reference_precision)."""
    src, files = _files(root, family, shape)
    main, _ = tiny.load_hf(src)
    tokens = {}
    for dtype, ref_model in ((torch.float32, main), (torch.float64, float64_copy(main))):
        model = load_model(files["none"], device="cpu", dtype=dtype)
        ctx = Context(model, GraphType.MAIN, n_ctx=64)
        rows = [ctx.decode(PROMPT).logits]
        ours = []
        for _ in range(GENERATED):
            ours.append(int(rows[-1][-1].argmax()))
            rows.append(ctx.decode([ours[-1]]).logits)
        with reference_precision(ref_model), EarliestOnTies(ref_model) as ties:
            ref_tokens, ref_rows = tiny.hf_full_forward_greedy(ref_model, PROMPT, GENERATED)
            with torch.no_grad():
                ref_prompt = ref_model(torch.as_tensor([PROMPT]), use_cache=False).logits[0]
        tokens[dtype] = ref_tokens
        steps = mtp_checks.max_diff(torch.stack([r[-1] for r in rows[:-1]]).double(), ref_rows.double())
        prompt = mtp_checks.max_diff(rows[0].double(), ref_prompt.double())
        print(f"{family}, {shape}, {dtype}: greedy {GENERATED} tokens equal transformers' full forwards: "
              f"{ours == ref_tokens}; max |Δlogit| per step {steps:.3g}, prompt {prompt:.3g}; transformers' "
              f"rows re-picked on exact ties {ties.rows}")
        assert ours == ref_tokens
        assert max(steps, prompt) < TOL[dtype]
    plain, _ = tiny.hf_full_forward_greedy(main, PROMPT, GENERATED)
    departs = next((i for i, (a, b) in enumerate(zip(plain, tokens[torch.float32])) if a != b), None)
    print(f"{family}, {shape}: transformers' float32 greedy with ties left to torch.topk departs from the rule's "
          f"at generated token {departs}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_verify_round_trips_and_parity(root, family, shape, tmp_path):
    """The embedded file in float32, trunk + sidecar in float64 (parity judged at 1e-9); the reference's
    indexers take the runtime's tie rule (specconv/verify/parity.py)."""
    src, files = _files(root, family, shape)
    runs = (("embedded, f32", [files["embed"], "--hf", src]),
            ("sidecar, f64", [files["none"], "--mtp", files["only"], "--hf", src, "--dtype", "f64"]))
    for label, args in runs:
        code, report, out = mtp_checks.run_verify(args, tmp_path, n_predict=32, draft_max=4)
        checks = {c["name"]: c for c in report["checks"]}
        print(f"{family}, {shape}, {label}: verify exit {code}; " + "; ".join(
            f"{n}: {c['detail']}" for n, c in checks.items() if n.startswith(("greedy exact", "parity: trunk",
                                                                               "parity: MTP"))))
        for name in ("greedy exact: mtp", "greedy exact: ngram", "parity: trunk logits vs transformers",
                     "parity: MTP head vs transformers MtpModel"):
            assert checks[name]["passed"], (name, out)
        assert code == 0 and report["passed"], out
