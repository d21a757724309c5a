"""`specconv compare` against llama.cpp (llama-cpp-python 0.3.36) on the bundled tiny Qwen3.5 converted to
F32, Q8_0 and Q4_K_M, over the same chunks of a held-out text (docs/compare.md §7).

* Our PPL of each file against llama-perplexity's, computed here from llama.cpp's own logits of each chunk
  (fresh context per chunk, rows ctx/2 .. ctx − 2 scored, exp of the mean negative log-likelihood). The
  F32 file agrees to float32 rounding; on quantized files llama.cpp rounds the activations to 8 bits in
  its quantized products (the runtime does not), which the measured gaps show.
* llama.cpp's logits fed to our scoring give the figures of llama.cpp's definitions recomputed here,
  including the KL divergence of llama.cpp's own uint16 store (16-nat range, tokens below e^-16 left
  out), which agrees with the exact sum to well under 1 %.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specconv.compare import CompareOptions, run_compare, stats
from specconv.compare.scoring import ExactRows, score_rows
from specconv.demo.bundled import bundled_model_dir, heldout_files
from specconv.runtime import load_model
from tests.fixtures.gguf_files import convert_gguf

pytestmark = pytest.mark.peer
CTX = 128
N_CHUNKS = 2
TYPES = ("f32", "q8_0", "q4_k_m")


@pytest.fixture(scope="module")
def files(tmp_path_factory, llama_peer):
    root = tmp_path_factory.mktemp("compare-peer")
    src = bundled_model_dir()
    out = {t: convert_gguf(src, root / f"tiny-{t}.gguf", outtype=t) for t in TYPES}
    text = heldout_files(src)
    if not text:
        pytest.skip("the held-out stdlib files of the bundled model are not on this interpreter")
    out["text"] = text[-1]
    stream = load_model(out["f32"], device="cpu").tokenizer.encode(text[-1].read_text(encoding="utf-8"))
    out["chunks"] = [stream[i * CTX:(i + 1) * CTX] for i in range(N_CHUNKS)]
    out["llama"] = {t: [torch.from_numpy(llama_peer.llama_logits(out[t], c)).double() for c in out["chunks"]]
                    for t in TYPES}
    return out


def _scored(logits, chunk):
    first = CTX // 2
    return logits[first:CTX - 1], torch.tensor(chunk[first + 1:])


def llama_ppl(logits_by_chunk, chunks) -> float:
    """llama-perplexity: exp of the mean of −log softmax(row j)[token j + 1] over rows ctx/2 .. ctx − 2."""
    nll = []
    for lg, c in zip(logits_by_chunk, chunks):
        rows, t = _scored(lg, c)
        nll.append(-torch.log_softmax(rows, -1).gather(-1, t[:, None])[:, 0])
    return math.exp(float(torch.cat(nll).mean()))


def llama_store_kld(base: torch.Tensor, quant: torch.Tensor) -> np.ndarray:
    """The KL divergence as llama-perplexity --kl-divergence computes it from its uint16 base file: codes
    over max − 16 .. max, step (max − min)/65535, and only tokens whose stored log-probability is above −16."""
    top = base.max(-1, keepdim=True).values
    low = torch.maximum(base.min(-1, keepdim=True).values, top - 16)
    lse = torch.logsumexp(base - top, -1, keepdim=True)
    step = (top - low) / 65535
    codes = torch.where(base > low, torch.round((base - low) / step), torch.zeros_like(base))
    a = step * codes + (low - top - lse)
    b = torch.log_softmax(quant, -1)
    keep = a > -16
    return torch.where(keep, a.exp() * (a - b), torch.zeros_like(a)).sum(-1).numpy()


def test_ppl_against_llama_cpp(files):
    rep = run_compare(CompareOptions(source=files["f32"], quants=[files[t] for t in TYPES], text=files["text"],
                                     ctx=CTX, chunks=N_CHUNKS, heads=False, costs=False, device="cpu"))
    assert rep["text"]["chunks"] == N_CHUNKS
    gaps = {}
    for t, entry in zip(TYPES, rep["quants"]):
        theirs = llama_ppl(files["llama"][t], files["chunks"])
        gaps[t] = entry["ppl"]["value"] / theirs - 1
        b, q = files["llama"]["f32"], files["llama"][t]
        kld = np.concatenate([llama_store_kld(*[_scored(x, c)[0] for x in (lb, lq)])
                              for lb, lq, c in zip(b, q, files["chunks"])])
        print(f"{t}: PPL ours {entry['ppl']['value']:.6f}, llama.cpp {theirs:.6f} (rel {gaps[t]:+.2e}); mean KLD "
              f"ours {entry['kld']['mean']:.3e}, llama.cpp's logits {kld.mean():.3e}")
    assert abs(gaps["f32"]) < 1e-5  # the same arithmetic up to float32 rounding
    assert abs(gaps["q8_0"]) < 5e-3 and abs(gaps["q4_k_m"]) < 5e-3  # llama.cpp's 8-bit activations


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_llama_logits_through_our_scoring(files, quant):
    """llama.cpp's own logits scored by specconv/compare: the figures of llama.cpp's definitions."""
    parts = []
    exact, store = [], []
    for lb, lq, c in zip(files["llama"]["f32"], files["llama"][quant], files["chunks"]):
        (rb, t), (rq, _) = _scored(lb, c), _scored(lq, c)
        parts.append(score_rows(ExactRows(rb, t), rq, t))
        a, b = torch.log_softmax(rb, -1), torch.log_softmax(rq, -1)
        exact.append((a.exp() * (a - b)).sum(-1).numpy())
        store.append(llama_store_kld(rb, rq))
    nll = np.concatenate([p.nll for p in parts])
    kld = np.concatenate([p.kld for p in parts])
    exact, store = np.concatenate(exact), np.concatenate(store)
    s = stats.summarize(nll, np.concatenate([p.nll_base for p in parts]), kld,
                        np.concatenate([p.p_diff for p in parts]), np.concatenate([p.same_top for p in parts]))
    assert s["ppl"]["value"] == pytest.approx(llama_ppl(files["llama"][quant], files["chunks"]), rel=1e-12)
    assert s["ppl_base"]["value"] == pytest.approx(llama_ppl(files["llama"]["f32"], files["chunks"]), rel=1e-12)
    assert np.allclose(kld, exact, rtol=1e-10, atol=1e-15)
    rel = abs(store.mean() / exact.mean() - 1)
    print(f"{quant} on llama.cpp's logits: mean KLD exact {exact.mean():.4e}, llama.cpp's uint16 store "
          f"{store.mean():.4e} (rel {rel:.1e}); same top p {100 * s['same_top_p']['value']:.2f} %")
    assert rel < 0.01
