"""Speculative decoding with the bundled MTP head on held-out text, against plain decoding and llama.cpp.

    python3 benchmarks/spec_decode.py                 # writes docs/benchmarks.md (its section) and docs/spec_decode.png
    python3 benchmarks/spec_decode.py --quick --no-docs

1. converts the bundled checkpoint (MTP embedded; and trunk + mtp- sidecar for a llama.cpp check);
2. takes prompts from the stdlib files listed in the checkpoint's heldout.json (never trained on);
3. specconv runtime, greedy: for draft_max 1..K, snapshot and checkpoint rollback, per-position
   acceptance, acceptance length, tokens per target forward, the bound and the wall-clock speed-up
   against plain decoding, all measured in this process, interleaved and repeated (median);
4. llama.cpp's draft-mtp loop (benchmarks/llamacpp_mtp.py) on the same GGUF and prompts: acceptance,
   tokens per target forward, and whether its greedy output equals ours;
5. prints the ratios, writes the JSON result, the markdown section and the plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import spec_report  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("-n", "--n-predict", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--draft-max", type=int, default=4, help="draft_max 1..K")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    p.add_argument("--outtype", choices=("f32", "f16"), default="f32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint-rollback runs")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp comparison")
    p.add_argument("--quick", action="store_true", help="2 prompts x 16 tokens, draft_max 2, 1 repeat")
    p.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "spec_decode.png")
    p.add_argument("--no-docs", action="store_true", help="write neither the markdown nor the plot")
    p.add_argument("--json", type=Path, default=None, help="also write the full result here")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.prompt_tokens, args.n_predict, args.draft_max, args.repeats = 2, 24, 16, 2, 1
    return args


def load_setup(outtype: str, workdir: Path, device: str, n_prompts: int, prompt_tokens: int):
    """(converted files, bundled checkpoint dir, target model, held-out prompts)."""
    from specconv.demo.bundled import bundled_model_dir, heldout_prompts
    from specconv.demo.pipeline import convert_bundled
    from specconv.runtime import load_model

    src = bundled_model_dir()
    files = convert_bundled(src, workdir, outtype)
    target = load_model(files["embedded"], device=device)
    prompts = heldout_prompts(target.tokenizer, src, n_prompts, prompt_tokens)
    return files, src, target, prompts


def run_ours(target, prompts, n_predict: int, draft_max: int, repeats: int, checkpoint: bool, progress=print) -> dict:
    from specconv.demo.measure import measure
    from specconv.runtime.drafters import MtpDrafter

    configs = [(k, "snapshot") for k in range(1, draft_max + 1)]
    if checkpoint:
        configs += [(k, "checkpoint") for k in range(1, draft_max + 1)]
    m = measure(target, lambda n_ctx: MtpDrafter(target, n_ctx, target), [list(p.ids) for p in prompts], n_predict,
                configs, repeats=repeats, labels=[p.source for p in prompts], progress=progress)
    out = m.to_json()
    out["plain_tokens"] = m.plain.tokens
    out["all_exact"] = all(r["exact"] for r in out["rows"])
    return out


def forward_costs(target, prompt: list[int], draft_max: int, reps: int = 21) -> dict:
    """Median milliseconds of one target decode of 1..K+1 tokens after the prompt (rolled back each time),
    and of one MTP-head decode of one row: the costs a speculative round pays (docs/reference/speculative.md §7's c)."""
    import torch

    from specconv.runtime import Context, GraphType

    def median_ms(fn) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    ctx = Context(target, GraphType.MAIN, n_ctx=len(prompt) + draft_max + 8, n_rs_seq=draft_max + 1)
    ctx.decode(prompt, hidden=(), logits=None)
    p = ctx.n_past()

    def verify(n):
        ctx.decode(prompt[:n], hidden=("post_norm",), logits="all")
        ctx.seq_rm(0, p)

    target_ms = {n: median_ms(lambda n=n: verify(n)) for n in range(1, draft_max + 2)}
    mtp = Context(target, GraphType.MTP, n_ctx=len(prompt) + 8)
    rows = torch.zeros(len(prompt), target.hidden_size, dtype=target.dtype, device=target.device)
    mtp.decode(prompt, positions=list(range(len(prompt))), hidden_in=rows, logits=None)
    q = mtp.n_past()

    def draft_step():
        mtp.decode(prompt[:1], positions=[q], hidden_in=rows[:1])
        mtp.seq_rm(0, q)

    mtp_ms = median_ms(draft_step)
    return {"target_ms": target_ms, "mtp_ms": mtp_ms, "c": mtp_ms / target_ms[1]}


def run_llamacpp(files: dict, prompts, n_predict: int, draft_max: int, repeats: int, plain_tokens, ours_rows,
                 progress=print) -> dict:
    """llama.cpp's draft-mtp for draft_max 1..K (embedded file), plain greedy, and the sidecar at K."""
    from benchmarks import llamacpp_mtp as lm
    from specconv.runtime.spec_stats import SpecStats

    reason = lm.available()
    if reason:
        return {"skipped": reason}
    import llama_cpp

    emb = files["embedded"]
    ids = [list(p.ids) for p in prompts]
    greedy = [lm.greedy(emb, p, n_predict, load_mtp=True) for p in ids]
    same_plain = [g.tokens == t for g, t in zip(greedy, plain_tokens)]
    plain_times, spec_times = [], {k: [] for k in range(1, draft_max + 1)}
    results = {}
    for rep in range(repeats):  # interleaved like ours: plain, then every draft_max, order rotated
        order = [0] + list(range(1, draft_max + 1))
        order = order[rep % len(order):] + order[:rep % len(order)]
        for k in order:
            progress(f"llama.cpp repeat {rep + 1}/{repeats}: " + (f"draft_max {k}" if k else "plain"))
            if k == 0:
                plain_times.append(sum(lm.greedy(emb, p, n_predict, load_mtp=True).seconds for p in ids))
                continue
            runs = [lm.draft_mtp(emb, p, n_predict, k) for p in ids]
            spec_times[k].append(sum(r.seconds for r in runs))
            results.setdefault(k, runs)
    ours = {r["draft_max"]: r for r in ours_rows if r["rollback"] == "snapshot"}
    rows = []
    for k, runs in results.items():
        s = SpecStats.merge([r.stats for r in runs]).to_json()
        mine = ours[k]
        s.update(draft_max=k, exact=all(r.tokens == g.tokens for r, g in zip(runs, greedy)),
                 same_tokens_as_ours=all(r.tokens == t for r, t in zip(runs, plain_tokens)),
                 same_counts_as_ours=(s["accepted"], s["drafted"], s["per_position"]) ==
                                     (mine["accepted"], mine["drafted"], mine["per_position"]),
                 seconds=statistics.median(spec_times[k]), plain_seconds=statistics.median(plain_times),
                 speedup=statistics.median(plain_times) / statistics.median(spec_times[k]))
        rows.append(s)
    side = [lm.draft_mtp(files["trunk"], p, n_predict, draft_max, mtp_path=files["sidecar"]) for p in ids]
    sidecar_same = all(a.tokens == b.tokens for a, b in zip(side, results[draft_max]))
    sidecar_counts = SpecStats.merge([r.stats for r in side]).accepted
    return {"version": llama_cpp.__version__, "rows": rows, "plain_equals_ours": same_plain,
            "sidecar_equals_embedded": sidecar_same, "sidecar_accepted": sidecar_counts,
            "note": "greedy, p_min 0, n_rs_seq = draft_max, timings through Python ctypes calls"}


def summarize(res: dict) -> None:
    """Console ratios, and the one-line llama.cpp summary used by the docs."""
    ours = [r for r in res["ours"]["rows"] if r["rollback"] == "snapshot"]
    ckpt = {r["draft_max"]: r for r in res["ours"]["rows"] if r["rollback"] == "checkpoint"}
    llama = {r["draft_max"]: r for r in res.get("llamacpp", {}).get("rows", [])}
    if res.get("costs"):
        c = res["costs"]
        print("target decode ms by batch size:", {n: round(v, 2) for n, v in c["target_ms"].items()},
              f"MTP step {c['mtp_ms']:.2f} ms (c = {c['c']:.2f})")
    print(f"\nplain: {res['ours']['plain_seconds']:.2f} s for {res['ours']['plain_target_forwards']} target forwards")
    for r in ours:
        k = r["draft_max"]
        line = (f"draft_max {k}: per-position {[round(x, 3) for x in r['per_position']]}  rate "
                f"{r['acceptance_rate']:.3f}  AL {r['acceptance_length']:.3f}  tokens/forward "
                f"{r['tokens_per_target_forward']:.3f}  bound {r['bound']:.3f}  forwards {r['target_forwards']}/"
                f"{r['plain_target_forwards']}  speed-up {r['speedup']:.2f}x  exact {r['exact']}")
        if k in ckpt:
            line += f"  | checkpoint {ckpt[k]['speedup']:.2f}x (+{ckpt[k]['redecode_forwards']} forwards)"
        if k in llama:
            l = llama[k]
            line += (f"  | llama.cpp rate {l['acceptance_rate']:.3f} tokens/forward {l['tokens_per_target_forward']:.3f}"
                     f" (ratio ours/llama.cpp {r['tokens_per_target_forward'] / l['tokens_per_target_forward']:.3f})"
                     f" same tokens {l['same_tokens_as_ours']}")
        print(line)
    lc = res.get("llamacpp", {})
    if llama:
        same = all(l["same_tokens_as_ours"] for l in llama.values())
        counts = all(l["same_counts_as_ours"] for l in llama.values())
        lc["summary"] = (f"greedy output {'identical to ours' if same else 'NOT identical to ours'} on every prompt "
                         f"and draft_max, acceptance counts {'identical' if counts else 'different'}; llama.cpp's "
                         f"plain greedy equals ours on {sum(lc['plain_equals_ours'])}/{len(lc['plain_equals_ours'])} "
                         f"prompts; the sidecar pair gives the embedded file's tokens: {lc['sidecar_equals_embedded']}; "
                         "its wall-clock speed-up through Python ctypes calls is "
                         + ", ".join(f"{l['speedup']:.2f}× (k={k})" for k, l in sorted(llama.items()))
                         + " (per-call Python overhead dominates at this model size, so it says little about "
                           "llama.cpp's native speed)")
        print("llama.cpp:", lc["summary"])


def main(argv=None) -> dict:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from tests.fixtures import peers  # the llama.cpp harness reads its thread count from here

    peers.N_THREADS = args.threads
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specconv-bench-") as tmp:
        files, src, target, prompts = load_setup(args.outtype, Path(tmp), args.device, args.prompts, args.prompt_tokens)
        print(f"{len(prompts)} held-out prompts: {', '.join(p.source for p in prompts)}")
        costs = forward_costs(target, list(prompts[0].ids), args.draft_max)
        ours = run_ours(target, prompts, args.n_predict, args.draft_max, args.repeats, not args.no_checkpoint)
        llama = {"skipped": "--no-llamacpp"} if args.no_llamacpp else run_llamacpp(
            files, prompts, args.n_predict, args.draft_max, args.repeats, ours["plain_tokens"], ours["rows"])
    training = {}
    tj = src / "training.json"
    if tj.is_file():
        training = json.loads(tj.read_text()).get("heldout", {}).get("llamacpp_rows", {})
    res = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "date": datetime.date.today().isoformat(),
           "machine": f"{platform.machine()}, {platform.system()}, torch {torch.__version__}",
           "device": str(target.device), "costs": costs, "ours": ours, "llamacpp": llama, "training": training,
           "seconds": time.perf_counter() - t0}
    summarize(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if not args.no_docs:
        spec_report.write_section(args.docs, spec_report.markdown(res, args.plot.name))
        spec_report.plot(res, args.plot)
        print(f"wrote {args.docs} and {args.plot}")
    print(f"total {res['seconds']:.0f} s")
    return res


if __name__ == "__main__":
    main()
