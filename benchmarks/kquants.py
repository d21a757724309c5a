"""K-quants in one pass: `specconv convert --outtype q4_k_m` against llama.cpp's two steps.

    python3 benchmarks/kquants.py [--size-gb 2.2] [--repeats 2] [--type q4_k_m] [--core-size-gb 0.3]

On a generated Qwen3.5-shaped bf16 checkpoint (tools/synth_qwen35.py, ~1.1 B parameters at 2.2 GB):

* one pass: `python -m specconv convert CKPT -o OUT --outtype q4_k_m` (all cores);
* two steps: llama.cpp's `convert_hf_to_gguf.py --outtype bf16` (tools/llamacpp_convert.py, from the
  llama-cpp-python 0.3.36 sdist, as benchmarks/convert.py runs it), then llama.cpp's quantize
  (`llama_model_quantize` of llama-cpp-python, the C code of `llama-quantize`, one thread per core)
  of that bf16 file. Its wall time is the sum, its peak RSS the larger of the two, and it writes the
  bf16 intermediate file (2 bytes a parameter) that the one pass never writes.
The commands alternate over the repeats, each under tools/peak_rss.py after a `sync`, the
checkpoint in the page cache (medians, min/max). Outside the timed runs, our file is compared with
the tool's output byte for byte.

Per core, on a smaller checkpoint of the same shape (`--core-size-gb`): our one pass with
`--threads 1` against llama.cpp's quantize with one thread on the bf16 file, in weights per second.
And the encoders alone, in process, on one thread: our native K-quant encoder against llama.cpp's
`ggml_quantize_chunk` on the same float32 values (16 M elements of the checkpoint), per type.
`--ladder-only q8_0,q6_k,q4_k_m`: one run writing the three files against one run per type.

Results: a section of docs/benchmarks.md ("K-quants in one pass") and docs/kquants_benchmark.json.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.convert import llama_tree, machine, measured  # noqa: E402
from tools.synth_qwen35 import write_checkpoint  # noqa: E402

QUANTIZE = """
import ctypes, sys, llama_cpp
from llama_cpp._logger import set_verbose
set_verbose(False)
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3].upper())
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""
SECTION = "## K-quants in one pass"
TYPE_IDS = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def n_params(ckpt: Path) -> int:
    from specconv.convert.checkpoint import CheckpointReader

    reader = CheckpointReader(ckpt)
    try:
        total = 0
        for t in reader.tensors.values():
            n = 1
            for d in t.shape:
                n *= int(d)
            total += n
        return total
    finally:
        reader.close()


def cores() -> int:
    from specconv.convert.pipeline import available_cores

    return available_cores()


def ours_cmd(ckpt: Path, out: Path, ftype: str, threads: int) -> list[str]:
    return [sys.executable, "-m", "specconv", "convert", str(ckpt), "-o", str(out), "--outtype", ftype, "--force",
            "--json", "--threads", str(threads)]


def llama_cmds(tree: Path, ckpt: Path, out: Path, ftype: str, threads: int) -> tuple[list[str], list[str]]:
    bf16 = out.with_name("llama-bf16.gguf")
    convert = [sys.executable, str(ROOT / "tools" / "llamacpp_convert.py"), str(tree), "qwen35", str(ckpt),
               "--outtype", "bf16", "--outfile", str(bf16)]
    quantize = [sys.executable, "-c", QUANTIZE, str(bf16), str(out), ftype, str(threads)]
    return convert, quantize


def clear(folder: Path) -> None:
    for f in folder.iterdir():
        f.unlink()


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def one_pass_vs_two_steps(ckpt: Path, tree: Path, out: Path, ftype: str, repeats: int) -> dict:
    threads = cores()
    ours_runs, llama_runs = [], []
    for r in range(repeats):
        for who in (("ours", "llama") if r % 2 == 0 else ("llama", "ours")):
            clear(out)
            if who == "ours":
                ours_runs.append(measured(ours_cmd(ckpt, out / "ours.gguf", ftype, 0), out))
                print(f"ours run {r + 1}: {ours_runs[-1]['wall_s']:.1f} s", file=sys.stderr)
            else:
                convert, quantize = llama_cmds(tree, ckpt, out / "llama.gguf", ftype, threads)
                a, b = measured(convert, out), measured(quantize, out)
                llama_runs.append({"wall_s": a["wall_s"] + b["wall_s"], "convert_s": a["wall_s"],
                                   "quantize_s": b["wall_s"], "peak_rss_bytes": max(a["peak_rss_bytes"],
                                                                                    b["peak_rss_bytes"]),
                                   "intermediate_bytes": (out / "llama-bf16.gguf").stat().st_size})
                print(f"llama.cpp run {r + 1}: {a['wall_s']:.1f} + {b['wall_s']:.1f} s", file=sys.stderr)
    # the bytes, outside the timed runs: ours against the tool's output of llama.cpp's own bf16 file
    clear(out)
    measured(ours_cmd(ckpt, out / "ours.gguf", ftype, 0), out)
    for cmd in llama_cmds(tree, ckpt, out / "llama.gguf", ftype, threads):
        measured(cmd, out)
    same = tensors_compared(out / "ours.gguf", out / "llama.gguf")
    row = {"threads": threads, "ours": {"wall_s": _median(ours_runs, "wall_s"),
                                        "walls": [r["wall_s"] for r in ours_runs],
                                        "rss_bytes": _median(ours_runs, "peak_rss_bytes")},
           "llama.cpp": {"wall_s": _median(llama_runs, "wall_s"), "walls": [r["wall_s"] for r in llama_runs],
                         "convert_s": _median(llama_runs, "convert_s"),
                         "quantize_s": _median(llama_runs, "quantize_s"),
                         "rss_bytes": _median(llama_runs, "peak_rss_bytes"),
                         "intermediate_bytes": llama_runs[0]["intermediate_bytes"]},
           "output_bytes": (out / "ours.gguf").stat().st_size, "tensors": same}
    row["speedup"] = row["llama.cpp"]["wall_s"] / row["ours"]["wall_s"]
    row["rss_ratio"] = row["ours"]["rss_bytes"] / row["llama.cpp"]["rss_bytes"]
    clear(out)
    return row


def tensors_compared(ours: Path, theirs: Path) -> dict:
    """Tensor by tensor: same type and bytes, and the names that differ."""
    from specconv.runtime.gguf_reader import open_gguf

    a, b = open_gguf(ours), open_gguf(theirs)
    differ = [n for n in a.tensors if n not in b.tensors or a.tensors[n].ggml_type != b.tensors[n].ggml_type
              or bytes(a.tensors[n].raw()) != bytes(b.tensors[n].raw())]
    return {"count": len(a.tensors), "identical": len(a.tensors) - len(differ), "differ": differ,
            "same_order": list(a.tensors) == list(b.tensors)}


def per_core(ckpt: Path, tree: Path, out: Path, ftype: str) -> dict:
    params = n_params(ckpt)
    clear(out)
    ours = measured(ours_cmd(ckpt, out / "ours.gguf", ftype, 1), out)
    convert, quantize = llama_cmds(tree, ckpt, out / "llama.gguf", ftype, 1)
    measured(convert, out)
    theirs = measured(quantize, out)
    clear(out)
    return {"params": params, "ours_s": ours["wall_s"], "llama_quantize_s": theirs["wall_s"],
            "ours_weights_per_s": params / ours["wall_s"], "llama_weights_per_s": params / theirs["wall_s"],
            "ratio": theirs["wall_s"] / ours["wall_s"]}


def encoders(ckpt: Path, n: int = 1 << 24) -> dict:
    """Our native encoder and llama.cpp's ggml_quantize_chunk, one thread, same float32 values."""
    import llama_cpp
    import numpy as np

    from specconv.convert.checkpoint import CheckpointReader
    from specconv.convert.native import kquants_native

    reader = CheckpointReader(ckpt)
    try:
        name = max(reader.tensors, key=lambda k: 0 if len(reader.tensors[k].shape) < 2 else
                   reader.tensors[k].shape[-1] * reader.tensors[k].shape[-2])
        x = np.ascontiguousarray(reader.read_tensor(name).reshape(-1)[:n], dtype=np.float32)
    finally:
        reader.close()
    n = x.size // 256 * 256
    x = x[:n]
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    ours = kquants_native()
    from specconv.convert import _kquants

    result = {"elements": n, "tensor": name, "isa": _kquants.isa(), "types": {}}
    for label, t in TYPE_IDS.items():
        out = np.zeros(n // 256 * {10: 84, 11: 110, 12: 144, 13: 176, 14: 210}[t], np.uint8)
        ref = np.zeros_like(out)
        best_ours = best_ref = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            ours(t, x, out, False)
            best_ours = min(best_ours, time.perf_counter() - t0)
            t0 = time.perf_counter()
            fn(t, x.ctypes.data, ref.ctypes.data, 0, n // 256, 256, None)
            best_ref = min(best_ref, time.perf_counter() - t0)
        result["types"][label] = {"ours_M_per_s": n / best_ours / 1e6, "llama_M_per_s": n / best_ref / 1e6,
                                  "ratio": best_ref / best_ours, "same_bytes": bool(np.array_equal(out, ref))}
    return result


def ladder(ckpt: Path, out: Path, types: list[str], repeats: int) -> dict:
    """One run writing every type against one run per type (their sum), alternating, ours only."""
    one, separate = [], []
    for r in range(repeats):
        for who in (("one", "separate") if r % 2 == 0 else ("separate", "one")):
            clear(out)
            if who == "one":
                one.append(measured(ours_cmd(ckpt, out / "m.gguf", ",".join(types), 0), out))
            else:
                runs = [measured(ours_cmd(ckpt, out / f"m-{t}.gguf", t, 0), out) for t in types]
                separate.append({"wall_s": sum(x["wall_s"] for x in runs),
                                 "peak_rss_bytes": max(x["peak_rss_bytes"] for x in runs)})
            print(f"ladder {who} run {r + 1}: {(one if who == 'one' else separate)[-1]['wall_s']:.1f} s",
                  file=sys.stderr)
    clear(out)
    row = {"types": types, "one_run_s": _median(one, "wall_s"), "separate_s": _median(separate, "wall_s"),
           "one_run_rss": _median(one, "peak_rss_bytes"), "separate_rss": _median(separate, "peak_rss_bytes"),
           "walls_one": [x["wall_s"] for x in one], "walls_separate": [x["wall_s"] for x in separate]}
    row["speedup"] = row["separate_s"] / row["one_run_s"]
    return row


def ladder_report(row: dict) -> str:
    gb = 1e9
    return (f"Ladder `--outtype {','.join(row['types'])}` in one run: {row['one_run_s']:.1f} s "
            f"({', '.join(f'{w:.1f}' for w in row['walls_one'])}), peak RSS {row['one_run_rss'] / gb:.2f} GB, against "
            f"one run per type {row['separate_s']:.1f} s ({', '.join(f'{w:.1f}' for w in row['walls_separate'])}), "
            f"{row['separate_rss'] / gb:.2f} GB: **{row['speedup']:.2f}x**.\n")


def report(result: dict) -> str:
    m, ck, row, core, enc = (result["machine"], result["checkpoint"], result["one_pass"], result["per_core"],
                             result["encoders"])
    gb = 1e9
    lines = [SECTION, "",
             f"`python3 benchmarks/kquants.py` ({result['date']}; {m['cores']} cores, {m['memory_gb']} GB, "
             f"Python {m['python']}; raw results in docs/kquants_benchmark.json). Checkpoint: tools/synth_qwen35.py, "
             f"{ck['params'] / 1e9:.2f} B parameters, {ck['bytes'] / gb:.2f} GB bf16, {ck['layers']} layers + 1 MTP "
             f"layer, hidden {ck['hidden']}. Type {result['type'].upper()}, {row['threads']} threads for both, "
             f"{result['repeats']} alternating runs (median; all runs listed).", "",
             "| | wall | peak RSS | writes |", "|---|---|---|---|",
             f"| specconv, one pass | {row['ours']['wall_s']:.1f} s ({', '.join(f'{w:.1f}' for w in row['ours']['walls'])})"
             f" | {row['ours']['rss_bytes'] / gb:.2f} GB | {row['output_bytes'] / gb:.2f} GB |",
             f"| llama.cpp: convert to bf16 + quantize | {row['llama.cpp']['wall_s']:.1f} s "
             f"({row['llama.cpp']['convert_s']:.1f} + {row['llama.cpp']['quantize_s']:.1f}; all: "
             f"{', '.join(f'{w:.1f}' for w in row['llama.cpp']['walls'])}) | {row['llama.cpp']['rss_bytes'] / gb:.2f} GB"
             f" | {row['llama.cpp']['intermediate_bytes'] / gb:.2f} GB bf16 + {row['output_bytes'] / gb:.2f} GB |",
             "", f"One pass: **{row['speedup']:.1f}x** faster, peak RSS **{row['rss_ratio']:.2f}x**. Tensors equal "
             f"to the tool's output (type and bytes): {row['tensors']['identical']} of {row['tensors']['count']}"
             + (f"; differing: {', '.join(row['tensors']['differ'][:6])}" if row['tensors']['differ'] else "")
             + ".", "",
             f"Per core (a {core['params'] / 1e9:.2f} B-parameter checkpoint of the same shape, one thread): "
             f"our one pass {core['ours_weights_per_s'] / 1e6:.1f} M weights/s ({core['ours_s']:.1f} s, reading and "
             f"writing included) against llama.cpp's quantize of the bf16 file {core['llama_weights_per_s'] / 1e6:.1f} "
             f"M weights/s ({core['llama_quantize_s']:.1f} s): **{core['ratio']:.1f}x**.", "",
             f"Encoders alone, one thread, {enc['elements'] / 1e6:.0f} M float32 values of `{enc['tensor']}` "
             f"(our build: {enc['isa']}), best of 3:", "",
             "| type | ours (M values/s) | llama.cpp ggml_quantize_chunk | ratio | same bytes |", "|---|---|---|---|---|"]
    for label, r in enc["types"].items():
        lines.append(f"| {label} | {r['ours_M_per_s']:.1f} | {r['llama_M_per_s']:.1f} | {r['ratio']:.1f}x | "
                     f"{'yes' if r['same_bytes'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def write_docs(result: dict) -> None:
    (ROOT / "docs" / "kquants_benchmark.json").write_text(json.dumps(result, indent=2) + "\n")
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.exists() else ""
    section = report(result)
    if SECTION in text:  # replace our section only, up to the next section of the same level
        head, _, rest = text.partition(SECTION)
        nxt = rest.find("\n## ")
        text = head + section + (rest[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--size-gb", type=float, default=2.2, help="checkpoint size in GB (default 2.2: ~1.1 B params)")
    ap.add_argument("--core-size-gb", type=float, default=0.3, help="checkpoint for the one-thread comparison")
    ap.add_argument("--repeats", type=int, default=2, help="alternating timed runs of each side")
    ap.add_argument("--type", default="q4_k_m", help="K-quant file type")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "specconv" / "bench")
    ap.add_argument("--llama-cpp-src", default=None, help="llama.cpp tree with convert_hf_to_gguf.py")
    ap.add_argument("--no-docs", action="store_true", help="print the section only")
    ap.add_argument("--ladder-only", default="", metavar="TYPES",
                    help="only measure this ladder (e.g. q8_0,q6_k,q4_k_m) against one run per type, and print it")
    args = ap.parse_args()

    tree = llama_tree(args.llama_cpp_src)
    if tree is None:
        raise SystemExit("llama.cpp's converter not found: pass --llama-cpp-src or run tests/run.sh once")
    ckpt = write_checkpoint(args.workdir / f"qwen35-{args.size_gb:g}gb", int(args.size_gb * 1e9))
    small = write_checkpoint(args.workdir / f"qwen35-{args.core_size_gb:g}gb", int(args.core_size_gb * 1e9))
    for folder in (ckpt, small):  # into the page cache: every run reads from memory
        for p in sorted(folder.glob("*.safetensors")):
            with open(p, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass
    if args.ladder_only:
        with tempfile.TemporaryDirectory(dir=args.workdir, prefix="kq-") as tmp:
            print(ladder_report(ladder(ckpt, Path(tmp), args.ladder_only.split(","), args.repeats)))
        return
    config = json.loads((ckpt / "config.json").read_text())["text_config"]
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "type": args.type,
              "repeats": args.repeats,
              "checkpoint": {"bytes": sum(p.stat().st_size for p in ckpt.glob("*.safetensors")),
                             "params": n_params(ckpt), "layers": config["num_hidden_layers"],
                             "hidden": config["hidden_size"]}}
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="kq-") as tmp:
        out = Path(tmp)
        result["encoders"] = encoders(small)
        result["per_core"] = per_core(small, tree, out, args.type)
        result["one_pass"] = one_pass_vs_two_steps(ckpt, tree, out, args.type, args.repeats)
    print(report(result))
    if not args.no_docs:
        write_docs(result)


if __name__ == "__main__":
    main()
