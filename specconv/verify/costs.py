"""Cost ratios of speculative decoding and the speed-up they predict, for specconv's runtime and llama.cpp.

A round that drafts k tokens costs the target's forward of k+1 tokens, k drafter steps and the
drafter's per-round catch-up; plain decoding costs t(1) per token. With the measured acceptance α
(docs/reference/speculative.md §7) a round yields E(α, k) = (1 - α^(k+1)) / (1 - α) tokens, so

    predicted speed-up(k) = E(α, k) / (t(k+1)/t(1) + k·c + c_round)

with c = one drafter step / t(1) and c_round = the drafter's per-round work / t(1). The figures
are measured, never assumed: the target's forward by batch size on a scratch context
(runtime/spec_auto.py, median of 3 passes), the drafter's steps in a timed speculative run, and
for llama.cpp (llama-cpp-python 0.3.36) its decode of 1..k+1 tokens on the same file with the
same thread count and, for an MTP head, one step of its MTP context. llama.cpp runs the file with
plain CPU buffers (`use_extra_bufts = False`): its AMX / repack buffers crash llama.cpp 0c1e570 on
CPUs with AMX (tests/fixtures/peers.py).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path

import torch

from specconv.runtime.spec_auto import measure_target_costs
from specconv.runtime.spec_stats import expected_tokens
from specconv.runtime.speculative import SpecConfig, speculative_generate

REPEATS = 3
PREFIX = 16


class TimedDrafter:
    """A drafter whose `draft` and `accept` calls are timed; everything else is the wrapped drafter's."""

    def __init__(self, inner):
        self.inner = inner
        self.draft_seconds = self.accept_seconds = 0.0
        self.accept_calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, prefix, hidden):
        self.inner.start(prefix, hidden)

    def draft(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner.draft(*args, **kwargs)
        finally:
            self.draft_seconds += time.perf_counter() - t0

    def accept(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner.accept(*args, **kwargs)
        finally:
            self.accept_seconds += time.perf_counter() - t0
            self.accept_calls += 1


def predicted(alpha: float | None, ratios: list[float], c: float | None, c_round: float | None, k_max: int) -> dict:
    """{k: predicted speed-up} for k = 1..k_max (None where a figure is missing), and the best k."""
    if alpha is None or c is None or c_round is None:
        return {"by_k": None, "best_k": None, "best": None}
    by_k = {}
    for k in range(1, min(k_max, len(ratios) - 1) + 1):
        by_k[str(k)] = expected_tokens(alpha, k) / (ratios[k] + k * c + c_round)
    best_k = max(by_k, key=by_k.get) if by_k else None
    return {"by_k": by_k, "best_k": int(best_k) if best_k else None, "best": by_k[best_k] if best_k else None}


def runtime_costs(target, drafter, prompt: list[int], k: int, n: int) -> dict:
    """The runtime's target ratios t(n)/t(1), n = 1..k+1, and the drafter's c and c_round (one timed
    speculative run of `prompt` at draft_max k)."""
    costs = measure_target_costs(target, k + 1, repeats=REPEATS, prefix=PREFIX, stat="median")
    t1 = costs.seconds[0]
    timed = TimedDrafter(drafter)
    speculative_generate(target, timed, prompt[:1], 2, SpecConfig(draft_max=k))  # one-time costs
    timed.draft_seconds = timed.accept_seconds = 0.0
    timed.accept_calls = 0
    res = speculative_generate(target, timed, prompt, n, SpecConfig(draft_max=k))
    s = res.stats["speculative"]
    steps = max(1, s["drafted"])
    return {"runner": "specconv", "threads": torch.get_num_threads(), "target_seconds": costs.seconds,
            "target_ratios": costs.ratios(),
            "c": timed.draft_seconds / steps / t1 if s["drafted"] else None,
            "c_round": timed.accept_seconds / max(1, timed.accept_calls) / t1}


def llamacpp_costs(path, k: int, mtp_path=None, threads: int | None = None) -> dict:
    """llama.cpp's decode of n = 1..k+1 tokens on the same file (median of REPEATS), as ratios to one
    token; with an MTP head (embedded, or `mtp_path`), c = one MTP step / t(1). A dict with an
    `error` when llama-cpp-python is missing or cannot run the file."""
    threads = threads or torch.get_num_threads()
    try:
        import llama_cpp
        from llama_cpp._logger import set_verbose
    except Exception as exc:  # ImportError, or OSError from a broken shared library
        return {"runner": "llama.cpp", "error": f"llama-cpp-python unavailable: {exc}"}
    set_verbose(False)
    llama_cpp.llama_backend_init()
    models, contexts = [], []
    try:
        target = _load(llama_cpp, path, load_mtp=False, models=models)
        vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(target))
        ctx = _context(llama_cpp, target, threads, n_rs_seq=k + 1, contexts=contexts)
        ids = [(3 + 7919 * i) % vocab_size for i in range(PREFIX + k + 1)]
        _decode(llama_cpp, ctx, ids[:PREFIX], 0)
        _decode(llama_cpp, ctx, ids[PREFIX:PREFIX + 1], PREFIX)  # first-call costs out of the timings
        _seq_rm(llama_cpp, ctx, PREFIX)
        runs = [[] for _ in range(k + 1)]
        for _ in range(REPEATS):
            for n in range(1, k + 2):
                t0 = time.perf_counter()
                _decode(llama_cpp, ctx, ids[PREFIX:PREFIX + n], PREFIX)
                runs[n - 1].append(time.perf_counter() - t0)
                if not _seq_rm(llama_cpp, ctx, PREFIX):
                    return {"runner": "llama.cpp", "error": "llama.cpp refused to roll back the measurement"}
        seconds = [statistics.median(r) for r in runs]
        out = {"runner": "llama.cpp", "threads": threads, "target_seconds": seconds,
               "target_ratios": [s / seconds[0] for s in seconds], "c": None, "c_round": None}
        if mtp_path is not None or _has_mtp(path):
            mtp_step = _mtp_step_seconds(llama_cpp, path, mtp_path, threads, ctx, models, contexts)
            if mtp_step is not None:
                # llama.cpp's MTP loop: k steps of one row each, then one catch-up decode of the batch
                out["c"] = out["c_round"] = mtp_step / seconds[0]
        return out
    except Exception as exc:  # a file llama.cpp cannot load or run: reported, not fatal
        return {"runner": "llama.cpp", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        for c in contexts:
            llama_cpp.llama_free(c)
        for m in models:
            llama_cpp.llama_model_free(m)


def _has_mtp(path) -> bool:
    from specconv.runtime.gguf_file import GGUFModelFile

    try:
        f = GGUFModelFile([Path(path)])
        return int(f.kv.get(f"{f.arch}.nextn_predict_layers", 0) or 0) > 0
    except Exception:
        return False


def _load(llama_cpp, path, load_mtp: bool, models: list):
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False  # see the module docstring
    if load_mtp:
        mp.load_mtp = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {Path(path).name}")
    models.append(model)
    return model


def _context(llama_cpp, model, threads: int, n_rs_seq: int = 0, contexts: list | None = None, mtp_of=None):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = threads
    cp.n_rs_seq = n_rs_seq
    if mtp_of is not None:
        cp.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cp.ctx_other = mtp_of
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    contexts.append(ctx)
    return ctx


def _decode(llama_cpp, ctx, ids, pos0: int, embd=None) -> None:
    """One llama_decode, logits for every row (a verification needs them all); `embd`: MTP rows."""
    n = len(ids)
    width = 0 if embd is None else len(embd) // n
    b = llama_cpp.llama_batch_init(n, width, 1)
    tokens = None
    try:
        if embd is not None:
            tokens = (llama_cpp.llama_token * n)(*ids)
            b.token = ctypes.cast(tokens, ctypes.POINTER(llama_cpp.llama_token))
            for i, x in enumerate(embd):
                b.embd[i] = x
        for i, tok in enumerate(ids):
            if embd is None:
                b.token[i] = int(tok)
            b.pos[i], b.n_seq_id[i], b.logits[i] = pos0 + i, 1, 1
            b.seq_id[i][0] = 0
        b.n_tokens = n
        if llama_cpp.llama_decode(ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
    finally:
        if tokens is not None:
            b.token = ctypes.POINTER(llama_cpp.llama_token)()  # ours: llama_batch_free must not free it
        llama_cpp.llama_batch_free(b)


def _seq_rm(llama_cpp, ctx, from_pos: int) -> bool:
    mem = llama_cpp.llama_get_memory(ctx)
    return bool(llama_cpp.llama_memory_seq_rm(mem, 0, from_pos, -1))


def _mtp_step_seconds(llama_cpp, path, mtp_path, threads, target_ctx, models, contexts) -> float | None:
    """Median seconds of one MTP row (token + hidden row) decoded by llama.cpp's MTP context."""
    try:
        from llama_cpp import llama_cpp_ext
    except Exception:
        return None
    head = _load(llama_cpp, mtp_path or path, load_mtp=True, models=models)
    width = int(llama_cpp.llama_model_n_embd_out(head))
    dft = _context(llama_cpp, head, threads, contexts=contexts, mtp_of=target_ctx)
    llama_cpp_ext.llama_set_embeddings_nextn(dft, True, True)
    row = [0.01 * ((i * 37) % 11 - 5) for i in range(width)]
    times = []
    for step in range(REPEATS + 1):
        t0 = time.perf_counter()
        _decode(llama_cpp, dft, [3 + step], step, embd=row)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def llamacpp_costs_isolated(path, k: int, mtp_path=None, threads: int | None = None, timeout: float = 600) -> dict:
    """`llamacpp_costs` in a child process: a crash inside llama.cpp costs a report line, not the run."""
    import json
    import subprocess
    import sys

    threads = threads or torch.get_num_threads()
    cmd = [sys.executable, "-m", "specconv.verify.costs", str(path), str(k), str(threads)]
    if mtp_path is not None:
        cmd.append(str(mtp_path))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"runner": "llama.cpp", "error": f"no result within {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"runner": "llama.cpp", "error": f"llama.cpp exited with {proc.returncode}"}
    return json.loads(lines[-1])


if __name__ == "__main__":  # the child of llamacpp_costs_isolated: FILE K THREADS [MTP]
    import json
    import sys

    args = sys.argv[1:]
    print(json.dumps(llamacpp_costs(args[0], int(args[1]), args[3] if len(args) > 3 else None, int(args[2]))))
