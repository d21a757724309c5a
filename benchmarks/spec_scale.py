"""Speculative decoding at size: verification cost by batch size and the synthetic drafter against the bound.

    python3 benchmarks/spec_scale.py --workdir /big/disk/bench-spec          # q8_0 and Q4_K_M, docs + plot
    python3 benchmarks/spec_scale.py --model FILE.gguf --quick --no-docs      # one file, a short run

1. the ~1 B-param Qwen3.5-shaped checkpoint (tools/synth_qwen35.py, 2.3 GB of bf16) converted to q8_0
   by `specconv convert` and to Q4_K_M by llama.cpp's quantize (benchmarks/runtime.py's files);
2. per file: the target's decode cost by batch size n = 1..8 for specconv's runtime (a scratch
   context, snapshot ring and rollback as in a verification round; median over passes) and for
   llama.cpp on the same file with the same threads (llama-cpp-python, specconv/verify/costs.py);
3. the synthetic drafter (runtime/drafters/synthetic.py) at A x k, plus `--draft-max auto` at each A
   and at A = 0, each timed in this process against plain decoding of the same prompt (interleaved
   over the repeats, medians): tokens identical to plain, acceptance, tokens per target forward,
   the realised decode speed-up and the bound at the measured costs,
   E(A, k) / (t(k+1)/t(1) + k·c + c_round), c and c_round being the synthetic drafter's measured cost;
4. prints the table, writes the JSON, the docs/benchmarks.md section and docs/spec_scale.png.

Decode speed-up = decode tokens per second, speculative / plain (each repeat's ratio, then the median):
plain decoding's prompt forward gives its first token, so its decode phase makes n - 1 tokens; the
speculative run evaluates the prompt but its last token first and makes all n in its decode phase
(round 1 verifies the prompt's last token). Tokens per second compares the two phases for what
they produce. Each acceptance's runs sit between two plain runs (the mean of their rates).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import threading
from pathlib import Path

# OpenMP threads that spin at barriers collapse on a shared machine (measured with 2 threads at load
# average 7 on 2 cores: t(1) 2.2-2.5 s spinning, 0.49 s sleeping); set before torch loads OpenMP
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BEGIN = "<!-- BEGIN spec_scale: written by benchmarks/spec_scale.py; edits inside are overwritten -->"
END = "<!-- END spec_scale -->"
PROMPT = [3 + (i * 7919) % 2000 for i in range(64)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("bench-spec"), help="checkpoint and GGUF files (≈ 5 GB)")
    p.add_argument("--model", type=Path, action="append", default=None,
                   help="benchmark this GGUF instead of building the 1 B files (repeatable)")
    p.add_argument("--types", default="q8_0,Q4_K_M")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch and llama.cpp threads")
    p.add_argument("--repeats", type=int, default=1, help="interleaved timed repeats (median)")
    p.add_argument("-n", "--n-predict", type=int, default=40)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--acceptances", default="0.5,0.7,0.8,0.9")
    p.add_argument("--ks", default="1,2,3,4")
    p.add_argument("--batch-max", type=int, default=8, help="decode cost measured for n = 1..this")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--quick", action="store_true", help="A in {0.8}, k in {1, 3}, 12 tokens, batch sizes 1..4")
    p.add_argument("--note", default="", help="a sentence on the machine's state, printed in the section")
    p.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "spec_scale.png")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.acceptances, args.ks, args.n_predict, args.batch_max = "0.8", "1,3", 12, 4
    return args


def build(args) -> dict[str, Path]:
    if args.model:
        return {m.stem: m for m in args.model}
    from benchmarks.runtime import build_files

    types = args.types.split(",")
    return build_files(args.workdir, "dense1b", types)


def run_file(path: Path, args, progress=print) -> dict:
    import torch

    from specconv.runtime import load_model
    from specconv.runtime.drafters.synthetic import greedy_reference
    from specconv.runtime.generate import generate
    from specconv.runtime.spec_auto import AUTO_K_MAX, cached_target_costs, measure_target_costs
    from specconv.runtime.spec_stats import expected_tokens
    from specconv.verify.costs import llamacpp_costs_isolated

    torch.set_num_threads(args.threads)
    model = load_model(path, device="cpu")
    params = sum(w.numel() for w in model.weights.values()) if hasattr(model.weights, "values") else None
    prompt, n = [t % model.vocab_size for t in PROMPT[:args.prompt_tokens]], args.n_predict
    progress(f"{path.name}: decode cost by batch size (specconv)")
    ours = measure_target_costs(model, args.batch_max, repeats=3, stat="median", budget_s=3.0)
    llama = None
    if not args.no_llamacpp:
        progress(f"{path.name}: decode cost by batch size (llama.cpp)")
        llama = llamacpp_costs_isolated(path, args.batch_max - 1, threads=args.threads)
    ratios = ours.ratios()
    ref = greedy_reference(model, prompt, n)
    generate(model, prompt[:1], 2)  # one-time costs out of the timings
    progress(f"{path.name}: --draft-max auto's calibration (before the timed runs, as `generate` does)")
    cached_target_costs(model, AUTO_K_MAX + 1)
    accs, ks = [float(a) for a in args.acceptances.split(",")], [int(k) for k in args.ks.split(",")]
    groups = [(a, ks + ["auto"]) for a in accs] + [(0.0, ["auto"])]
    runs = {(a, k): [] for a, group in groups for k in group}
    for rep in range(args.repeats):
        for a, group in groups:
            # interleaved: each acceptance's runs between two plain runs of their own (their mean rate)
            before = generate(model, prompt, n)
            done = [_one(model, ref, prompt, n, a, k, rep, ours.seconds[0]) for k in group]
            after = generate(model, prompt, n)
            plain_rate = statistics.mean(_decode_rate(p) for p in (before, after))
            for k, one in zip(group, done):
                one.update(plain_decode_s=(n - 1) / plain_rate, speedup=one["decode_rate"] / plain_rate,
                           exact=one["exact"] and before.tokens == one.pop("tokens"))
                runs[(a, k)].append(one)
                last = runs[(a, k)][-1]
                progress(f"[{rep + 1}/{args.repeats}] {path.name} A={a} k={k}: decode {last['decode_s']:.2f} s vs "
                         f"plain {last['plain_decode_s']:.2f} s, tokens/forward {last['tokens_per_forward']:.2f}, "
                         f"exact {last['exact']}")
    rows = []
    for (a, k), rr in runs.items():
        med = statistics.median
        c, c_round = med(r["c"] for r in rr), med(r["c_round"] for r in rr)
        row = {"acceptance": a, "k": k, "exact": all(r["exact"] for r in rr),
               "decode_s": med(r["decode_s"] for r in rr), "plain_decode_s": med(r["plain_decode_s"] for r in rr),
               "acceptance_rate": med(r["acceptance_rate"] or 0.0 for r in rr),
               "tokens_per_forward": med(r["tokens_per_forward"] for r in rr), "c": c, "c_round": c_round}
        row["speedup"] = med(r["speedup"] for r in rr)  # median over repeats of each repeat's own ratio
        if k == "auto":
            ks_all = [x for r in rr for x in r["ks"]]
            modes = [x for r in rr for x in r["modes"]]
            row.update(mean_k=sum(ks_all) / len(ks_all), plain_share=modes.count("plain") / len(modes))
        else:
            row["bound"] = expected_tokens(a, k) / (ratios[min(k, len(ratios) - 1)] + k * c + c_round)
            row["bound_llamacpp"] = (expected_tokens(a, k) / llama["target_ratios"][k]
                                     if llama and "error" not in llama and k < len(llama["target_ratios"]) else None)
        rows.append(row)
    hp = model.hparams
    shape = {"arch": getattr(hp, "arch", "?"), "blocks": getattr(hp, "num_hidden_layers", None),
             "recurrent": sum(getattr(hp, "recurrent", []) or []), "hidden": model.hidden_size, "vocab": model.vocab_size}
    return {"file": path.name, "file_gb": path.stat().st_size / 1e9, "params": params, "threads": args.threads,
            "shape": shape,
            "specconv_seconds": ours.seconds, "specconv_ratios": ratios, "llamacpp": llama, "rows": rows,
            "n_predict": n, "prompt_tokens": len(prompt), "repeats": args.repeats}


def _decode_rate(plain) -> float:
    """Plain decoding's tokens per second after its prompt: the prompt's forward gives the first token,
    so the decode phase makes n - 1."""
    return (len(plain.tokens) - 1) / (plain.seconds - plain.prompt_seconds)


def _one(model, ref, prompt, n, a, k, seed, t1) -> dict:
    """One speculative run with the synthetic drafter at acceptance a and draft length k (or "auto")."""
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.spec_auto import AUTO_K_MAX
    from specconv.runtime.speculative import SpecConfig, speculative_generate
    from specconv.verify.costs import TimedDrafter

    drafter = TimedDrafter(SyntheticDrafter(ref, model.vocab_size, a, seed=seed))
    auto = k == "auto"
    res = speculative_generate(model, drafter, prompt, n, SpecConfig(draft_max=AUTO_K_MAX if auto else k, auto=auto))
    s = res.stats["speculative"]
    decode_s = res.seconds - s["prompt_seconds"]  # every token: the prompt's last one is round 1's first row
    return {"decode_s": decode_s, "decode_rate": len(res.tokens) / decode_s, "tokens": res.tokens,
            "exact": res.tokens == ref[len(prompt):],
            "acceptance_rate": s["acceptance_rate"], "tokens_per_forward": s["tokens_per_target_forward"],
            "per_position": s["per_position"], "c": drafter.draft_seconds / max(1, s["drafted"]) / t1,
            "c_round": drafter.accept_seconds / max(1, drafter.accept_calls) / t1,
            "ks": [r.get("k", 0) for r in res.stats["rounds"]], "modes": [r.get("mode") for r in res.stats["rounds"]]}


# ---- report -----------------------------------------------------------------------------------------

def _f(x, digits=2):
    return "n/a" if x is None else f"{x:.{digits}f}"


def goals(res: dict) -> list[str]:
    """The issue's goals, judged on one file's rows."""
    rows = {(r["acceptance"], r["k"]): r for r in res["rows"]}
    out = []
    if len(res["specconv_ratios"]) >= 4:
        out.append(f"target decode of 4 tokens = {res['specconv_ratios'][3]:.2f}× one token (goal ≤ 1.25×)")
    if (0.8, 3) in rows:
        r = rows[(0.8, 3)]
        out.append(f"synthetic A = 0.8, k = 3: decode speed-up {r['speedup']:.2f}× (goal ≥ 2.0×), greedy tokens "
                   f"identical: {'yes' if r['exact'] else 'NO'}")
    if (0.0, "auto") in rows:
        out.append(f"auto at A = 0: {rows[(0.0, 'auto')]['speedup']:.2f}× plain (goal ≥ 0.95×), "
                   f"{rows[(0.0, 'auto')]['plain_share']:.0%} of rounds plain")
    fixed = [r for r in res["rows"] if r["acceptance"] == 0.8 and r["k"] != "auto"]
    if fixed and (0.8, "auto") in rows:
        best = max(fixed, key=lambda r: r["speedup"])
        out.append(f"auto at A = 0.8: {rows[(0.8, 'auto')]['speedup']:.2f}× plain = "
                   f"{rows[(0.8, 'auto')]['speedup'] / best['speedup']:.2f} of the best fixed k "
                   f"(k = {best['k']}, {best['speedup']:.2f}×; goal ≥ 0.9)")
    return out


def _describe(res: dict) -> str:
    sh = res["shape"]
    params = f", {res['params'] / 1e9:.2f} B params" if res.get("params") else ""
    return (f"{res['file']} ({res['file_gb']:.2f} GB: {sh['arch']}, {sh['blocks']} blocks of which {sh['recurrent']} "
            f"Gated DeltaNet, hidden {sh['hidden']}, vocabulary {sh['vocab']}{params})")


def markdown(results: list[dict], meta: dict, png_name: str) -> str:
    lines = ["## Speculative decoding at size: verification cost and the synthetic drafter", "",
             f"`python3 benchmarks/spec_scale.py {meta['argv']}` ({meta['date']}, {meta['machine']}; "
             f"{meta['threads']} threads for both runtimes; {meta['minutes']:.1f} min in all; load average "
             f"{meta['load'][0]:.1f} at the start, {meta['load'][1]:.1f} at the end, median "
             f"{meta.get('load_median', meta['load'][0]):.1f} over the run; OMP_WAIT_POLICY="
             f"{meta.get('omp_wait_policy') or 'unset'}). {meta['note']}".rstrip(),
             "",
             "Model" + ("s" if len(results) > 1 else "") + ": " + "; ".join(_describe(r) for r in results) + ". "
             + ("The ~1 B-param Qwen3.5-shaped checkpoint of tools/synth_qwen35.py (random weights), q8_0 by "
                "`specconv convert` and Q4_K_M by llama.cpp's quantize. " if meta.get("built") else "")
             + "The synthetic drafter (runtime/drafters/synthetic.py) proposes "
             "the target's own greedy continuation with each token kept with probability A, at no drafting cost: "
             "its runs measure the runtime's verification and rollback, not a draft head.", "",
             "Decode cost t(n)/t(1) of one target forward of n tokens (logits for every row, as a verification needs):", "",
             "| file | runner | t(1) ms | " + " | ".join(f"n={n}" for n in range(2, len(results[0]["specconv_ratios"]) + 1))
             + " |", "|---|---|---|" + "---|" * (len(results[0]["specconv_ratios"]) - 1)]
    for res in results:
        lines.append(f"| {res['file']} | specconv | {res['specconv_seconds'][0] * 1e3:.1f} | "
                     + " | ".join(_f(r) for r in res["specconv_ratios"][1:]) + " |")
        ll = res.get("llamacpp")
        if ll and "error" not in ll:
            lines.append(f"| {res['file']} | llama.cpp | {ll['target_seconds'][0] * 1e3:.1f} | "
                         + " | ".join(_f(r) for r in ll["target_ratios"][1:]) + " |")
        elif ll:
            lines.append(f"| {res['file']} | llama.cpp | not measured: {ll['error']} |")
    lines += ["", "Synthetic drafter: decode speed-up over plain decoding in the same process (decode tokens per "
              "second, speculative / plain: plain decoding's first token comes with its prompt forward, so its "
              "decode phase makes n − 1 tokens and the speculative one n; each acceptance's runs between two "
              "plain runs; median of the repeats' ratios) against the bound E(A, k) / (t(k+1)/t(1) + k·c + c_round) at the measured "
              "costs (c, c_round: the synthetic drafter's own, ≈ 0); *llama.cpp bound*: the same at llama.cpp's "
              "measured t(k+1)/t(1) with a free drafter.", "",
              "| file | A | k | = plain | acceptance | tokens / forward | speed-up | bound | llama.cpp bound |",
              "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            k = r["k"] if r["k"] != "auto" else f"auto (mean {r['mean_k']:.1f}, {r['plain_share']:.0%} plain)"
            lines.append(f"| {res['file']} | {r['acceptance']:.1f} | {k} | {'yes' if r['exact'] else 'NO'} | "
                         f"{_f(r['acceptance_rate'])} | {_f(r['tokens_per_forward'])} | {_f(r['speedup'])}× | "
                         f"{_f(r.get('bound'))} | {_f(r.get('bound_llamacpp'))} |")
    lines += ["", f"![decode cost by batch size and speed-up against the bound]({png_name})", "", "Goals:"]
    for res in results:
        lines += [f"* {res['file']}: {g}" for g in goals(res)]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the block between `begin` and `end` in path (appended when absent)."""
    old = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n"
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.write_text(new, encoding="utf-8")


def plot(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for res in results:
        n = range(1, len(res["specconv_ratios"]) + 1)
        left.plot(n, res["specconv_ratios"], marker="o", label=f"specconv {res['file']}")
        ll = res.get("llamacpp")
        if ll and "error" not in ll:
            left.plot(n, ll["target_ratios"], marker="s", linestyle="--", label=f"llama.cpp {res['file']}")
    left.set_xlabel("tokens in one forward (n)")
    left.set_ylabel("t(n) / t(1)")
    left.set_title("target decode cost by batch size")
    left.legend(fontsize=7)
    res = results[0]
    for a in sorted({r["acceptance"] for r in res["rows"] if r["k"] != "auto"}):
        rows = [r for r in res["rows"] if r["acceptance"] == a and r["k"] != "auto"]
        line, = right.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="o", label=f"A={a:g} measured")
        right.plot([r["k"] for r in rows], [r["bound"] for r in rows], linestyle=":", color=line.get_color(),
                   label=f"A={a:g} bound")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("draft length k")
    right.set_ylabel("decode speed-up over plain")
    right.set_title(f"synthetic drafter, {res['file']}")
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    loads, stop = [], threading.Event()

    def sample():  # the 1-minute load average every 30 s: other processes' share of the 2 cores
        while not stop.wait(30):
            loads.append(os.getloadavg()[0])

    threading.Thread(target=sample, daemon=True).start()
    files = build(args)
    results = [run_file(path, args) for path in files.values()]
    stop.set()
    for res in results:
        print(f"\n{res['file']}: specconv t(n)/t(1) {[round(r, 2) for r in res['specconv_ratios']]}, "
              f"t(1) {res['specconv_seconds'][0] * 1e3:.0f} ms")
        ll = res.get("llamacpp")
        if ll and "error" not in ll:
            print(f"{res['file']}: llama.cpp t(n)/t(1) {[round(r, 2) for r in ll['target_ratios']]}, "
                  f"t(1) {ll['target_seconds'][0] * 1e3:.0f} ms")
        for r in res["rows"]:
            print(f"  A={r['acceptance']:.1f} k={r['k']}: speed-up {r['speedup']:.2f}x bound {_f(r.get('bound'))} "
                  f"tokens/forward {r['tokens_per_forward']:.2f} exact {r['exact']}")
        for g in goals(res):
            print("  " + g)
    meta = {"argv": " ".join(sys.argv[1:] if argv is None else argv), "threads": args.threads,
            "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {platform.system()}",
            "minutes": (time.perf_counter() - started) / 60, "note": args.note, "load": [load_start, os.getloadavg()[0]],
            "load_median": statistics.median(loads) if loads else load_start,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "built": not args.model}
    out = {"meta": meta, "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if not args.no_docs:
        plot(results, args.plot)
        write_section(args.docs, markdown(results, meta, args.plot.name))
    return out


if __name__ == "__main__":
    main()
