"""MTP acceptance in `specconv compare` (docs/compare.md §5) on the bundled tiny Qwen3.5, whose head is
trained, converted to F32 and Q4_K_M (embedded head) and Q4_K_M with the head in an mtp- sidecar.

The teacher-forced acceptance by draft position is recomputed here without the runtime's drafter: for
every start position a fresh MTP context gets llama.cpp's rows (x_q, h_{q−1}), q ≤ p, then the chain of
drafts fed by the head's own normed output (docs/reference/model-math.md §7.2-§7.4), each judged against
the target's argmax along the text; the same again with llama.cpp's own MTP context (llama-cpp-python)
on the F32 file. The source's head on the quant's trunk is the same whether the quant's hidden states
went through the disk (one model resident) or not (both resident); a sidecar gives the embedded head's
figures; the speed-up is verify's cost model applied to the measured acceptance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specconv.compare import CompareOptions, run_compare
from specconv.demo.bundled import bundled_model_dir, heldout_files
from specconv.runtime import Context, GraphType, load_model
from specconv.runtime.spec_stats import expected_tokens
from tests.fixtures.gguf_files import convert_gguf

CTX = 64
N_CHUNKS = 2
K = 3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare-mtp")
    src = bundled_model_dir()
    out = {"f32": convert_gguf(src, root / "tiny-f32.gguf", outtype="f32"),
           "q4_k_m": convert_gguf(src, root / "tiny-q4_k_m.gguf", outtype="q4_k_m")}
    sep = root / "separate"
    sep.mkdir()
    out["q4_k_m_trunk"] = convert_gguf(src, sep / "tiny-q4_k_m.gguf", outtype="q4_k_m", mtp="separate")
    out["q4_k_m_sidecar"] = sep / "mtp-tiny-q4_k_m.gguf"
    assert out["q4_k_m_sidecar"].is_file()
    text = heldout_files(src)
    if not text:
        pytest.skip("the held-out stdlib files of the bundled model are not on this interpreter")
    tok = load_model(out["f32"], device="cpu").tokenizer
    stream = tok.encode(text[0].read_text(encoding="utf-8"))
    out["stream"] = stream[:CTX * N_CHUNKS]
    out["tokens"] = root / "tokens.txt"
    out["tokens"].write_text(" ".join(map(str, out["stream"])))
    return out


def compare(files, source, quants, **kw) -> dict:
    opts = CompareOptions(source=files[source], quants=[files[q] for q in quants], tokens=files["tokens"], ctx=CTX,
                          draft_max=K, device="cpu", **{"costs": False, **kw})
    return run_compare(opts)


def reference_counts(path, stream, dtype=None, sidecar=None, stride=1) -> tuple[list[int], int]:
    """(rounds whose i-th draft was accepted, for i = 1..K; rounds) with the MTP graph driven directly."""
    target = load_model(path, device="cpu", dtype=dtype)
    head = load_model(sidecar, device="cpu", dtype=dtype, share_from=target) if sidecar else target
    first = CTX // 2
    counts, rounds = [0] * K, 0
    for c in range(N_CHUNKS):
        ids = stream[c * CTX:(c + 1) * CTX]
        out = Context(target, GraphType.MAIN, n_ctx=CTX).decode(ids, logits="all")
        h, greedy = out.hidden["post_norm"], out.logits.argmax(-1)
        for p in range(first, CTX - K + 1, stride):
            mtp = Context(head, GraphType.MTP, n_ctx=CTX + K)
            rows = torch.cat([torch.zeros_like(h[:1]), h[:p]])  # (x_q, h_{q−1}), h_{−1} = 0
            o = mtp.decode(ids[:p + 1], positions=list(range(p + 1)), hidden_in=rows)
            drafts, z = [int(o.logits[-1].argmax())], o.hidden["nextn"][-1:]
            for i in range(1, K):
                o = mtp.decode([drafts[-1]], positions=[p + i], hidden_in=z)
                drafts.append(int(o.logits[-1].argmax()))
                z = o.hidden["nextn"][-1:]
            rounds += 1
            for i in range(K):
                if drafts[i] != int(greedy[p + i]):
                    break
                counts[i] += 1
    return counts, rounds


def _counts(summary) -> list[int]:
    return [round(a * summary["rounds"]) for a in summary["per_position"]]


def test_acceptance_equals_direct_drafting(files):
    """float64 on both sides, so the two-batch chunks and the one-batch reference agree to the last token."""
    rep = compare(files, "f32", ["q4_k_m"], dtype="f64")
    src, q = rep["source"]["mtp"], rep["quants"][0]["mtp"]
    want_src = reference_counts(files["f32"], files["stream"], "f64")
    want_q = reference_counts(files["q4_k_m"], files["stream"], "f64")
    print(f"source head on source: {src['per_position']} ({src['rounds']} rounds); Q4_K_M head on Q4_K_M: "
          f"{q['own_head']['per_position']}; {q['summary']}")
    assert (_counts(src), src["rounds"]) == want_src
    assert (_counts(q["own_head"]), q["own_head"]["rounds"]) == want_q
    assert src["rounds"] == N_CHUNKS * (CTX - K + 1 - CTX // 2)
    # the trained head predicts held-out text far above chance (vocabulary of 2048)
    assert src["per_position"][0] > 0.3
    assert src["per_position"] == sorted(src["per_position"], reverse=True)  # cumulative
    assert src["expected_tokens"] == pytest.approx(1 + sum(src["per_position"]))  # full-length drafts every round
    assert src["expected_tokens"] == pytest.approx(expected_tokens(src["alpha"], K), rel=1e-6)
    assert q["summary"] == (f"Q4_K_M: acceptance at position 1 {src['per_position'][0]:.2f} → "
                            f"{q['own_head']['per_position'][0]:.2f}")


def test_stride_drafts_at_every_nth_position(files):
    """--mtp-stride 3: rounds at positions first, first + 3, ..., the text between them committed at once."""
    rep = compare(files, "f32", ["f32"], dtype="f64", mtp_stride=3)
    got = rep["source"]["mtp"]
    assert (_counts(got), got["rounds"]) == reference_counts(files["f32"], files["stream"], "f64", stride=3)


def test_acceptance_against_llama_cpp(files, llama_peer):
    """llama.cpp's MTP context on the F32 file, drafting as draft-mtp drafts, rows as in the runtime."""
    from llama_cpp import llama_cpp_ext as ext

    p = llama_peer
    target = p.load_model(files["f32"], load_mtp=True)
    first, stream = CTX // 2, files["stream"]
    counts, rounds = [0] * K, 0
    for c in range(N_CHUNKS):
        ids = stream[c * CTX:(c + 1) * CTX]
        tgt = p.new_context(target, n_ctx=CTX + 8)
        try:
            ext.llama_set_embeddings_nextn(tgt, True, False)
            p.decode_tokens(tgt, ids)
            h, greedy = p.row_hidden_nextn(tgt, target, CTX), p.row_logits(tgt, target, CTX).argmax(-1)
            for pos in range(first, CTX - K + 1):
                dft = p.new_context(target, n_ctx=CTX + 8, mtp_of=tgt)
                try:
                    ext.llama_set_embeddings_nextn(dft, True, True)
                    rows = np.concatenate([np.zeros((1, h.shape[1]), np.float32), h[:pos]])
                    p.decode_rows(dft, ids[:pos + 1], rows, range(pos + 1))
                    drafts = [int(p.row_logits(dft, target, pos + 1)[-1].argmax())]
                    z = p.row_hidden_nextn(dft, target, pos + 1)[-1]
                    for i in range(1, K):
                        p.decode_rows(dft, [drafts[-1]], z[None], [pos + i])
                        drafts.append(int(p.row_logits(dft, target, 1)[0].argmax()))
                        z = p.row_hidden_nextn(dft, target, 1)[0]
                finally:
                    p.free_context(dft)
                rounds += 1
                for i in range(K):
                    if drafts[i] != int(greedy[pos + i]):
                        break
                    counts[i] += 1
        finally:
            p.free_context(tgt)
    ours = compare(files, "f32", ["f32"])["source"]["mtp"]
    print(f"acceptance counts by position: ours {_counts(ours)}, llama.cpp {counts} of {rounds} rounds")
    assert ours["rounds"] == rounds
    # float32 on both sides: an argmax between two near-equal logits may fall either way
    assert all(abs(a - b) <= 1 for a, b in zip(_counts(ours), counts))


def test_source_head_on_quant_trunk_same_either_way(files):
    one = compare(files, "f32", ["q4_k_m"], resident="one")
    both = compare(files, "f32", ["q4_k_m"], resident="both")
    a, b = one["quants"][0]["mtp"], both["quants"][0]["mtp"]
    print(f"source head on Q4_K_M trunk: {a['source_head_on_this_trunk']['per_position']}; own head "
          f"{a['own_head']['per_position']}; source on source {one['source']['mtp']['per_position']}")
    assert a["source_head_on_this_trunk"] == b["source_head_on_this_trunk"]
    assert a["own_head"] == b["own_head"] and one["source"]["mtp"] == both["source"]["mtp"]
    # the source's head on its own trunk through the file itself (a quant identical to the source)
    same = compare(files, "f32", ["f32"])["quants"][0]["mtp"]
    assert same["own_head"] == same["source_head_on_this_trunk"] == one["source"]["mtp"]


def test_sidecar_head(files):
    """The trunk-only file with its mtp- sidecar (found next to it, or given) measures the embedded head."""
    embedded = compare(files, "f32", ["q4_k_m"])["quants"][0]["mtp"]
    found = compare(files, "f32", ["q4_k_m_trunk"])["quants"][0]
    given = run_compare(CompareOptions(source=files["f32"], quants=[files["q4_k_m_trunk"]], tokens=files["tokens"],
                                       ctx=CTX, draft_max=K, device="cpu", costs=False,
                                       mtp=[files["q4_k_m_sidecar"]]))["quants"][0]
    assert found["head"] == str(files["q4_k_m_sidecar"]) == given["head"]
    assert found["mtp"]["own_head"] == given["mtp"]["own_head"] == embedded["own_head"]
    none = compare(files, "f32", ["q4_k_m_trunk"], heads=False)
    assert none["quants"][0]["mtp"] is None and none["source"]["mtp"] is None


def test_predicted_speedup_follows_verify_cost_model(files):
    rep = compare(files, "f32", ["q4_k_m"], costs=True)
    for s in (rep["source"]["mtp"], rep["quants"][0]["mtp"]["own_head"]):
        sp = s["speedup"]
        want = expected_tokens(s["alpha"], K) / (sp["target_ratios"][K] + K * sp["c"] + sp["c_round"])
        print(f"alpha {s['alpha']:.3f}: E {s['expected_tokens']:.3f}, t(k+1)/t(1) {sp['target_ratios'][K]:.2f}, "
              f"c {sp['c']:.3f}, c_round {sp['c_round']:.3f} -> predicted {sp['at_draft_max']:.2f}x (best k "
              f"{sp['best_k']})")
        assert sp["at_draft_max"] == pytest.approx(want) and sp["best"] == max(sp["by_k"].values())
    # the source's head on the quant's trunk is not timed: no speed-up is claimed for that pairing
    assert rep["quants"][0]["mtp"]["source_head_on_this_trunk"]["speedup"] is None
