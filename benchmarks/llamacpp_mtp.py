"""llama.cpp's draft-mtp speculative loop, driven through llama-cpp-python's low-level API (docs/reference/peers.md §1.5).

The computing is llama.cpp's: the target context (strict settings, n_rs_seq = draft_max so a partial
acceptance is a `seq_rm`), and an MTP context on the same model (or on the sidecar) with
`ctx_other` = the target. The Python loop only sequences the calls the way llama.cpp's
examples/speculative-simple drives `common_speculative_impl_draft_mtp` (common/speculative.cpp):

* prompt: the target decodes prompt[:-1]; `process()` writes the MTP catch-up rows (x_p, h_{p-1}),
  row 0 with h = 0, and keeps `pending_h` = h of the last row; the last prompt token is id_last;
* draft: rows (id_last, pos0, pending_h), then (d_i, pos0+i, the MTP row's own nextn output), top-1;
  the draft budget is min(n_max, n_predict - generated - 1, n_ctx - n_past - 2);
* the draft rows are removed from the MTP memory (`seq_rm(dft, pos0)`), the target decodes
  [id_last, d_1..d_n] once, and `process()` writes catch-up rows for the whole batch;
* greedy acceptance (`common_sampler_sample_and_accept_n` at T = 0): j drafts equal to the target's
  argmax, plus the target's token; `accept(j)` sets pending_h = h of batch row j;
* both memories are cut at n_past = pos0 + j + 1.
Counting uses the same SpecStats as the specconv runtime (docs/reference/speculative.md §6), so both sides are
reported with one definition. Every call here costs the same Python-side overhead in the plain loop.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from specconv.runtime.spec_stats import SpecStats  # noqa: E402
from tests.fixtures import peers  # noqa: E402  (the ctypes harness: models, strict contexts, batches)


@dataclass
class LlamaResult:
    tokens: list[int]
    seconds: float
    stats: SpecStats | None = None  # None for plain decoding
    target_forwards: int = 0


def available() -> str | None:
    """None when llama-cpp-python with the MTP entry points imports, else the reason."""
    try:
        import llama_cpp  # noqa: F401
        from llama_cpp import llama_cpp_ext  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a broken shared library
        return f"{type(exc).__name__}: {exc}"
    return None


def _models(target_path, mtp_path):
    target = peers.load_model(target_path, load_mtp=mtp_path is None)
    head = target if mtp_path is None else peers.load_model(mtp_path, load_mtp=True)
    return target, head


def _seq_rm(ctx, from_pos: int) -> bool:
    llama_cpp, _ = peers._lib()
    return bool(llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, from_pos, -1))


def greedy(target_path, prompt: list[int], n_predict: int, load_mtp: bool = False) -> LlamaResult:
    """Plain greedy decoding on llama.cpp: the prompt in one batch, then one token per decode
    (load_mtp=True reuses the model object that draft_mtp loads for an embedded file)."""
    model = peers.load_model(target_path, load_mtp=load_mtp)
    ctx = peers.new_context(model, n_ctx=len(prompt) + n_predict + 8)
    try:
        start = time.perf_counter()
        peers.decode_tokens(ctx, prompt, 0)
        out = [int(np.argmax(peers.row_logits(ctx, model, len(prompt))[-1]))]
        while len(out) < n_predict:
            peers.decode_tokens(ctx, [out[-1]], len(prompt) + len(out) - 1)
            out.append(int(np.argmax(peers.row_logits(ctx, model, 1)[0])))
        return LlamaResult(out, time.perf_counter() - start, target_forwards=len(out))
    finally:
        peers.free_context(ctx)


def draft_mtp(target_path, prompt: list[int], n_predict: int, draft_max: int, mtp_path=None) -> LlamaResult:
    """Greedy speculative decoding with llama.cpp's MTP head (embedded, or `mtp_path` sidecar)."""
    _, ext = peers._lib()
    target, head = _models(target_path, mtp_path)
    hidden_size = peers.n_embd_out(target)
    n_ctx = max(256, len(prompt) + n_predict + draft_max + 8)
    tgt = peers.new_context(target, n_ctx=n_ctx, n_rs_seq=draft_max)
    try:
        ext.llama_set_embeddings_nextn(tgt, True, False)  # every target row's h
        dft = peers.new_context(head, n_ctx=n_ctx, mtp_of=tgt)
        try:
            ext.llama_set_embeddings_nextn(dft, True, True)
            return _loop(tgt, dft, target, head, hidden_size, n_ctx, prompt, n_predict, draft_max)
        finally:
            peers.free_context(dft)
    finally:
        peers.free_context(tgt)


def _process(dft, batch: list[int], pos0: int, pending_h: np.ndarray, h: np.ndarray) -> np.ndarray:
    """common_speculative_impl_draft_mtp::process: catch-up rows (batch[k], pos0+k, h_{k-1}); returns the
    new pending_h (h of the batch's last row)."""
    rows = np.concatenate([pending_h[None], h[:-1]], axis=0)
    peers.decode_rows(dft, batch, rows, range(pos0, pos0 + len(batch)))
    return h[-1].copy()


def _loop(tgt, dft, target, head, hidden_size, n_ctx, prompt, n_predict, draft_max) -> LlamaResult:
    stats = SpecStats(draft_max)
    start = time.perf_counter()
    pending_h = np.zeros(hidden_size, np.float32)
    prefix, id_last = [int(t) for t in prompt[:-1]], int(prompt[-1])
    if prefix:
        peers.decode_tokens(tgt, prefix, 0)
        pending_h = _process(dft, prefix, 0, pending_h, peers.row_hidden_nextn(tgt, target, len(prefix)))
    n_past, out = len(prefix), []
    while len(out) < n_predict:
        budget = max(0, min(draft_max, n_predict - len(out) - 1, n_ctx - n_past - 2))
        drafts, token, h = [], id_last, pending_h
        for i in range(budget):
            peers.decode_rows(dft, [token], h[None], [n_past + i])
            token = int(np.argmax(peers.row_logits(dft, head, 1)[0]))
            h = peers.row_hidden_nextn(dft, head, 1)[0]
            drafts.append(token)
        _seq_rm(dft, n_past)  # the draft rows go before verification
        batch = [id_last] + drafts
        peers.decode_tokens(tgt, batch, n_past)
        logits = peers.row_logits(tgt, target, len(batch))
        hidden = peers.row_hidden_nextn(tgt, target, len(batch))
        _process(dft, batch, n_past, pending_h, hidden)
        j = 0
        while j < len(drafts) and int(np.argmax(logits[j])) == drafts[j]:
            j += 1
        t = int(np.argmax(logits[j]))
        pending_h = hidden[j].copy()  # accept(j)
        stats.record_round(len(drafts), j)
        n_past += j + 1
        if not _seq_rm(tgt, n_past):
            raise RuntimeError(f"llama.cpp refused seq_rm at {n_past} (n_rs_seq = {draft_max})")
        _seq_rm(dft, n_past)
        out.extend(drafts[:j] + [t])
        id_last = t
    stats.generated = len(out)
    return LlamaResult(out, time.perf_counter() - start, stats, stats.target_forwards)
