"""The CPU goals of speculation at size over model shapes: one table of t(1) and t(4)/t(1) (ours and
llama.cpp's on the same q8_0 file, same threads) and the synthetic drafter's A = 0.8, k = 3 speed-up.

    python3 benchmarks/spec_shapes.py --workdir /big/disk/bench-shapes            # every shape, docs section
    python3 benchmarks/spec_shapes.py --shapes h2048-v65k --no-docs               # one shape

Each shape is a Qwen3.5-shaped checkpoint of tools/synth_qwen35.py (random bf16 weights, ~1.1 B
params unless the shape says otherwise: its block count follows from --size-gb), converted to q8_0
by `specconv convert` (no MTP block), then measured as benchmarks/spec_scale.py measures a file
(its `run_file`: decode cost by batch size for both runtimes, the synthetic drafter between two
plain runs, medians of --repeats). Goals (docs/benchmarks.md): t(4)/t(1) ≤ 1.25, A = 0.8 k = 3
≥ 2.0× with tokens identical to plain, t(1) level with llama.cpp's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as spec_scale: robust on a shared machine

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BEGIN = "<!-- BEGIN spec_shapes: written by benchmarks/spec_shapes.py; edits inside are overwritten -->"
END = "<!-- END spec_shapes -->"

# name -> tools/synth_qwen35.py shape: hidden 1024-5120, vocabularies 32 k-250 k, dense and MoE
SHAPES = {
    "h1024-v248k": {"hidden_size": 1024, "intermediate_size": 3584, "vocab_size": 248320},
    "h2048-v65k": {"hidden_size": 2048, "intermediate_size": 6144, "vocab_size": 65536},
    "h4096-v32k": {"hidden_size": 4096, "intermediate_size": 12288, "vocab_size": 32000},
    "h5120-v152k": {"hidden_size": 5120, "intermediate_size": 17408, "vocab_size": 152064},
    "moe-h2048-v152k": {"hidden_size": 2048, "intermediate_size": 6144, "vocab_size": 152064, "experts": 32,
                        "experts_used": 4},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("bench-shapes"), help="checkpoints and GGUF files")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--size-gb", type=float, default=2.3, help="bf16 checkpoint size per shape (sets the blocks)")
    p.add_argument("--layers", type=int, default=None, help="blocks per shape (overrides --size-gb)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("-n", "--n-predict", type=int, default=40)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--note", default="", help="a sentence on the machine's state, printed in the section")
    args = p.parse_args(argv)
    # spec_scale.run_file's settings: A = 0.8 with k = 3 (and auto), batch sizes 1..4
    args.acceptances, args.ks, args.batch_max, args.prompt_tokens = "0.8", "3", 4, 32
    return args


def build(name: str, args) -> Path:
    sys.path.insert(0, str(REPO / "tools"))
    from synth_qwen35 import write_checkpoint

    src = write_checkpoint(args.workdir / f"{name}-hf", int(args.size_gb * 1e9), n_layers=args.layers, **SHAPES[name])
    out = args.workdir / f"{name}-q8_0.gguf"
    stamp = out.with_suffix(".src.json")
    made_from = (src / "synth.json").read_text()
    if not out.is_file() or not stamp.is_file() or stamp.read_text() != made_from:
        subprocess.run([sys.executable, "-m", "specconv", "convert", str(src), "-o", str(out), "--outtype", "q8_0",
                        "--mtp", "none"], check=True, stdout=subprocess.DEVNULL)
        stamp.write_text(made_from)
    return out


def summarize(name: str, res: dict) -> dict:
    """One table row from spec_scale.run_file's result."""
    row = next(r for r in res["rows"] if r["acceptance"] == 0.8 and r["k"] == 3)
    ll = res.get("llamacpp") or {}
    ok = "error" not in ll and ll.get("target_seconds")
    return {"shape": name, "params": res["params"], "hidden": res["shape"]["hidden"], "vocab": res["shape"]["vocab"],
            "blocks": res["shape"]["blocks"], "file_gb": res["file_gb"],
            "t1_ms": res["specconv_seconds"][0] * 1e3, "t4_t1": res["specconv_ratios"][3],
            "llama_t1_ms": ll["target_seconds"][0] * 1e3 if ok else None,
            "llama_t4_t1": ll["target_ratios"][3] if ok else None,
            "speedup": row["speedup"], "bound": row["bound"], "exact": row["exact"]}


def _f(x, fmt):
    return "n/a" if x is None else format(x, fmt)


def table(rows: list[dict]) -> list[str]:
    lines = ["| shape | params | t(1) ms ours / llama.cpp | t(4)/t(1) ours / llama.cpp | A=0.8 k=3 | = plain |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        params = f"{r['params'] / 1e9:.2f} B" if r["params"] else "n/a"
        lines.append(f"| {r['shape']} ({r['blocks']} blocks) | {params} | {r['t1_ms']:.0f} / "
                     f"{_f(r['llama_t1_ms'], '.0f')} | {r['t4_t1']:.2f} / {_f(r['llama_t4_t1'], '.2f')} | "
                     f"{r['speedup']:.2f}× (bound {r['bound']:.2f}) | {'yes' if r['exact'] else 'NO'} |")
    return lines


def markdown(rows: list[dict], meta: dict) -> str:
    return "\n".join([
        "## Speculation at size across shapes (CPU)", "",
        f"`python3 benchmarks/spec_shapes.py {meta['argv']}` ({meta['date']}, {meta['machine']}; {meta['threads']} "
        f"threads for both runtimes; load average {meta['load'][0]:.1f} at the start, {meta['load'][1]:.1f} at the "
        f"end). {meta['note']}".rstrip(), "",
        "q8_0 files of tools/synth_qwen35.py's Qwen3.5 shape at each hidden size and vocabulary (3 of 4 blocks "
        "Gated DeltaNet). Goals: t(4)/t(1) ≤ 1.25, A = 0.8 k = 3 ≥ 2.0× with tokens identical to plain, t(1) "
        "level with llama.cpp's.", "", *table(rows)]) + "\n"


def main(argv=None) -> list[dict]:
    from benchmarks.spec_scale import run_file, write_section

    args = parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
        path = build(name, args)
        rows.append(summarize(name, run_file(path, args, progress=lambda m: print(m, flush=True))))
        print("\n".join(table(rows[-1:])[2:]), flush=True)
    meta = {"argv": " ".join(sys.argv[1:] if argv is None else argv), "threads": args.threads,
            "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {platform.system()}",
            "load": [load0, os.getloadavg()[0]], "note": args.note}
    print("\n".join(table(rows)))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if not args.no_docs:
        write_section(args.docs, markdown(rows, meta), BEGIN, END)
    return rows


if __name__ == "__main__":
    main()
