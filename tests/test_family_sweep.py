"""Family sweep: every family in the layout its real releases use and with the shape parameters that
switch behaviour (tests/fixtures/family_sweep.py), each through the whole path — `specconv convert`
(f32) → llama.cpp loads the file and agrees with transformers → our runtime agrees with transformers
over a prompt longer than any window (batched, and prefill then one token at a time) → `specconv
verify --hf` passes (parity, round trips for the family's drafter and the n-gram one) → greedy
speculative decoding equals plain decoding. The list with the measured figures is in docs/archs.md,
"Family sweep". Every figure is printed.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.generate import generate
from specconv.runtime.drafters import Draft, Drafter
from specconv.runtime.spec_link import drafter_rows, hidden_request
from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate
from tests.fixtures import mtp_checks
from tests.fixtures.family_sweep import CASES, DRAFT_MAX, Built, Case, gguf_kv

CASE_PARAMS = [pytest.param(c, id=c.name) for c in CASES]
GDN_FLOAT32 = 2e-3  # verify's float32 criterion (docs/verify.md)
_built: dict[str, Built] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sweep")


def built(case: Case, root) -> Built:
    if case.name not in _built:
        folder = root / case.name
        folder.mkdir()
        _built[case.name] = case.build(folder)
    return _built[case.name]


def max_abs(a, b) -> float:
    a = a.numpy() if torch.is_tensor(a) else np.asarray(a)
    b = b.numpy() if torch.is_tensor(b) else np.asarray(b)
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def reference(case: Case, b: Built) -> tuple[np.ndarray, float, str]:
    """(transformers' logits, tolerance for a float32 implementation, what they are).

    Gated DeltaNet families: tiny random layers amplify float32 rounding (the gated norm rescales
    core outputs of rms ~1e-4, docs/testing.md), differently in every implementation and in every
    form of one (our recurrent and chunked forms alike): transformers' own float32 forward is up to
    1.1e-3 from its float64 one here. So the reference is transformers computed in float64
    throughout (family_sweep.float64_throughout), our float64 runtime must match it within the
    tolerance, and float32 implementations within verify's float32 criterion (docs/verify.md)."""
    if not case.gdn:
        return b.ref.trunk(b.prompt)[0], case.tol, "transformers float32"
    ref64 = b.ref.trunk(b.prompt, float64=True)[0]
    own = max_abs(b.ref.trunk(b.prompt)[0], ref64)
    return ref64, GDN_FLOAT32, f"transformers float64; its float32 is {own:.1e} off it"


def fp16_gelu_logits(model, ids) -> torch.Tensor:
    """Our Gemma 4 logits with llama.cpp's GELU: a table over fp16 inputs (docs/gemma4.md)."""
    import specconv.runtime.graphs.gemma4 as graph

    saved = graph.gelu_tanh
    graph.gelu_tanh = lambda x: F.gelu(x.half().float(), approximate="tanh").half().to(x.dtype)
    try:
        return Context(model, GraphType.MAIN, n_ctx=len(ids) + 8).decode(ids).logits
    finally:
        graph.gelu_tanh = saved


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_fixture_has_its_properties(case, root):
    """The release layout or the shapes the case is named for are really in the checkpoint / file."""
    b = built(case, root)
    claims = case.claims(b)
    print(f"\n[{case.name}] " + "; ".join(f"{text}: {ok}" for text, ok in claims))
    assert claims and all(ok for _, ok in claims), claims


def batched_and_steps(model, ids, prefill: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits for `ids` in one batch, and for `prefill` tokens then one token per step."""
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids) + 8)
    batch = ctx.decode(ids).logits
    ctx.clear()
    return batch, torch.cat([ctx.decode(ids[:prefill]).logits] + [ctx.decode([t]).logits for t in ids[prefill:]])


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_runtime_matches_transformers(case, root):
    b = built(case, root)
    model = load_model(b.target, device="cpu")
    batch, steps = batched_and_steps(model, b.prompt)
    ref, tol, what = reference(case, b)
    d_batch, d_steps = max_abs(batch, ref), max_abs(steps, ref)
    print(f"\n[{case.name}] runtime vs {what}, {len(b.prompt)} tokens: max |Δlogit| batched {d_batch:.2e}, "
          f"prefill then one by one {d_steps:.2e} (tolerance {tol:g})")
    assert d_batch <= tol and d_steps <= tol
    if case.gdn:  # in float64 the arithmetic itself is compared, and the two paths are one function
        batch64, steps64 = batched_and_steps(load_model(b.target, device="cpu", dtype="f64"), b.prompt)
        stored = b.ref.trunk(b.prompt, float64=True, as_stored=True)[0]
        d64, d_stored, paths = max_abs(batch64, ref), max_abs(batch64, stored), max_abs(batch64, steps64)
        print(f"[{case.name}] float64 runtime vs transformers float64: {d64:.2e}, {d_stored:.2e} with 1 + w and "
              f"ssm_a rounded as the file stores them; batched vs one by one {paths:.1e}")
        assert d64 <= case.tol and d_stored <= 1e-6 and paths <= 1e-9
    if b.drafter == "draft":
        d = assistant_step_diff(b, model)
        print(f"[{case.name}] assistant step at P = {len(b.prompt)} vs Gemma4AssistantForCausalLM: {d:.2e}")
        assert d <= 1e-4


def assistant_step_diff(b: Built, target) -> float:
    """One Gemma 4 assistant step after the whole prompt (beyond the window) against transformers'."""
    from tests.fixtures import tiny_gemma4 as g

    assistant = load_model(b.draft, device="cpu", share_from=target)
    tctx = Context(target, GraphType.MAIN, n_ctx=64)
    out = tctx.decode(b.prompt)
    token, h = int(out.logits[-1].argmax()), out.hidden["post_norm"][-1]
    ours = Context(assistant, GraphType.MTP, kv_from=tctx).decode([token], positions=[len(b.prompt)],
                                                                 hidden_in=h.reshape(1, -1))
    window = int(gguf_kv(b.target)["gemma4.attention.sliding_window"])
    theirs, _ = g.hf_assistant_step(b.src, b.draft_src, b.prompt, token, h, window=window)
    return max_abs(ours.logits[0], theirs[:g.VOCAB_REAL])


@pytest.mark.peer
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_llama_cpp_matches_transformers(case, root, llama_peer):
    b = built(case, root)
    theirs = llama_peer.llama_logits(b.target, b.prompt)
    ref, tol, what = reference(case, b)
    d = max_abs(theirs, ref)
    if case.gelu16:
        model = load_model(b.target, device="cpu")
        emulated = max_abs(theirs, fp16_gelu_logits(model, b.prompt))
        print(f"\n[{case.name}] llama.cpp vs transformers {d:.2e}; vs our runtime with llama.cpp's fp16 GELU table "
              f"{emulated:.2e}")
        assert emulated <= 5e-3
    else:
        print(f"\n[{case.name}] llama.cpp trunk vs {what}: max |Δlogit| {d:.2e} (tolerance {tol:g})")
        assert d <= tol
    drafter_vs_llama_cpp(case, b, llama_peer)


def drafter_vs_llama_cpp(case: Case, b: Built, peers) -> None:
    """The drafter as llama.cpp runs it: the MTP head against transformers' MtpModel (llama.cpp's rows,
    transformers' hidden states); EAGLE-3 and DFlash against our runtime fed the same inputs."""
    if b.drafter == "mtp":
        _, hidden = b.ref.trunk(b.prompt)
        d = max_abs(peers.llama_mtp_logits(b.target, b.prompt, hidden=hidden), b.ref.mtp_rows(b.prompt, hidden))
        print(f"[{case.name}] llama.cpp MTP head vs transformers MtpModel: {d:.2e}")
        assert d <= 1e-4
    elif b.drafter == "eagle3":
        from tests.fixtures.eagle3_peer import eagle3_rows

        target = load_model(b.target, device="cpu")
        head = load_model(b.draft, device="cpu", share_from=target)
        layers, features, g, logits, _ = eagle3_rows(b.target, b.draft, b.prompt)
        ours_g = Context(head, GraphType.ENCODER).encode(torch.from_numpy(features)).hidden["g"]
        ours = Context(head, GraphType.MTP, n_ctx=64).decode(
            b.prompt[1:], positions=list(range(len(b.prompt) - 1)), hidden_in=torch.from_numpy(g[:-1])).logits.numpy()
        finite = np.isfinite(ours)
        np.testing.assert_array_equal(np.isfinite(logits), finite)  # the same tokens outside d2t
        d = {"g": max_abs(ours_g, g), "logits": float(np.abs(logits[finite] - ours[finite]).max())}
        print(f"[{case.name}] llama.cpp EAGLE-3 head (layers {layers}) vs ours on its features: {d}")
        assert max(d.values()) <= 1e-4
    elif b.drafter == "dflash":
        from specconv.runtime.drafters.dflash import DFlashDrafter

        target = load_model(b.target, device="cpu")
        drafter = DFlashDrafter(load_model(b.draft, device="cpu", share_from=target), target, 64, DRAFT_MAX)
        prefix = b.prompt[:-1]
        out = Context(target, GraphType.MAIN, n_ctx=64).decode(prefix, hidden=drafter.target_hidden)
        features = torch.cat([out.hidden[n] for n in drafter.target_hidden], -1)
        drafter.start(prefix, features)
        ours = drafter.block_logits(b.prompt[-1])
        block = [b.prompt[-1]] + [drafter.hp.mask_token_id] * (ours.shape[0] - 1)
        d = max_abs(peers.llama_dflash_block(b.target, b.draft, features.numpy(), block, len(prefix)), ours)
        print(f"[{case.name}] llama.cpp DFlash block of {len(block)} vs ours on the same features: {d:.2e}")
        assert d <= 1e-4


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_verify_passes(case, root, tmp_path):
    """`specconv verify --hf` (with the drafter's file, and --draft-hf for EAGLE-3 / DFlash v1) on a
    prompt longer than every window: every check passes, the drafter's round trips included."""
    b = built(case, root)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def fibonacci(n):\\n    if n < 2:\\n        return n\\n    return fibonacci(n - 1) + "
                      "fibonacci(n - 2)\\n\\nfor i in range(10):\\n    print(i, fibonacci(i))\n")
    args = [b.target, "--hf", b.src, "--prompts", prompt]
    if b.draft is not None:
        args += ["--draft", b.draft]
        if b.draft_hf:
            args += ["--draft-hf", b.draft_src]
    code, report, output = mtp_checks.run_verify(args, tmp_path)
    assert report is not None, output
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}
    parity = {k: v for k, v in report["parity"].items() if k in ("trunk", "mtp", "eagle3", "dflash")}
    spec = report["speculative"]
    print(f"\n[{case.name}] verify: exit {code}; parity " + ", ".join(f"{k} {v:.2e}" for k, v in parity.items())
          + f"; {spec['drafter']} accepted {spec['accepted']}/{spec['drafted']}")
    assert code == 0 and report["passed"] and not failed, failed
    name = {"draft": "gemma4-assistant"}.get(b.drafter, b.drafter)
    assert spec["drafter"] == name and f"greedy exact: {name}" in {c["name"] for c in report["checks"]}
    n_prompt = len(load_model(b.target, device="cpu").tokenizer.encode(prompt.read_text()))
    for path in filter(None, (b.target, b.draft)):  # the verified prompt reaches past every window
        kv = gguf_kv(path)
        assert n_prompt > int(kv.get(f"{kv['general.architecture']}.attention.sliding_window", 0))


class Steered(Drafter):
    """The family's drafter, steered to partial acceptance: its first m drafted tokens are replaced by
    the target's greedy continuation, m cycling 0..draft_max, so rounds accept every count. Before
    steering, each real draft is compared with the draft of the same drafter started afresh on the
    committed tokens: after any acceptance the drafter's own memory (MTP head's cache, EAGLE-3 rows,
    DFlash features) must be what a fresh start builds."""

    name = "steered"  # each instance takes the wrapped drafter's name

    def __init__(self, make, target, truth: list[int]):
        self.make, self.target, self.truth = make, target, truth
        self.inner = make()
        self.name, self.needs_hidden = self.inner.name, self.inner.needs_hidden
        self.target_hidden, self.reads_target_kv = self.inner.target_hidden, self.inner.reads_target_kv
        self.steer = itertools.cycle(range(DRAFT_MAX + 1))
        self.committed: list[int] = []
        self.differing: list[tuple[int, list[int], list[int]]] = []
        self.rounds = 0

    def attach(self, target_ctx) -> None:
        self.inner.attach(target_ctx)

    def start(self, prefix, hidden) -> None:
        self.inner.start(prefix, hidden)
        self.committed = list(prefix)

    def fresh_draft(self, id_last: int, n: int) -> list[int]:
        fresh = self.make()
        want = hidden_request(fresh)
        ctx = Context(self.target, GraphType.MAIN, n_ctx=len(self.committed) + n + 8)
        out = ctx.decode(self.committed, hidden=want, logits=None)
        fresh.attach(ctx)
        fresh.start(self.committed, drafter_rows(out.hidden, want))
        return fresh.draft(id_last, n).tokens

    def draft(self, id_last, n_max, p_min=0.0, temperature=0.0, generator=None) -> Draft:
        real = self.inner.draft(id_last, n_max, p_min, temperature, generator).tokens
        fresh = self.fresh_draft(id_last, n_max)
        self.rounds += 1
        if real != fresh:
            self.differing.append((len(self.committed), real, fresh))
        m, at = next(self.steer), len(self.committed) + 1
        return Draft((self.truth[at:at + m] + real[m:])[:n_max])

    def accept(self, n_accepted, batch, hidden) -> None:
        self.inner.accept(n_accepted, batch, hidden)
        self.committed += [int(t) for t in batch[:n_accepted + 1]]


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_speculative_equals_plain(case, root):
    """Greedy speculative decoding with the family's drafter (n-gram where it has none), draft_max 3,
    snapshot and checkpoint rollback, after a prompt longer than every window: plain greedy output,
    as it comes and steered to accept 0..3 tokens a round; the drafter's drafts equal a fresh start's."""
    b = built(case, root)
    target = load_model(b.target, device="cpu")
    prompt, n = b.prompt[:24], 16
    plain = generate(target, prompt, n).tokens

    def make():
        return build_drafter(b.drafter, target, 64, DRAFT_MAX, draft_path=b.draft)

    for rollback in ("snapshot", "checkpoint"):
        cfg = SpecConfig(draft_max=DRAFT_MAX, rollback=rollback)
        own = speculative_generate(target, make(), prompt, n, cfg)
        steered = Steered(make, target, list(prompt) + plain)
        res = speculative_generate(target, steered, prompt, n, cfg)
        s, t = own.stats["speculative"], res.stats["speculative"]
        print(f"\n[{case.name}] {b.drafter}, {rollback}: accepted {s['accepted']}/{s['drafted']}, equal to plain: "
              f"{own.tokens == plain}; steered: accepted {t['accepted']}/{t['drafted']}, equal to plain: "
              f"{res.tokens == plain}, drafts unlike a fresh start's in {len(steered.differing)} of {steered.rounds} "
              f"rounds")
        assert own.tokens == plain and s["drafted"] > 0
        assert res.tokens == plain and 0 < t["accepted"] < t["drafted"]
        assert not steered.differing, steered.differing
