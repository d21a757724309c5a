"""Conversion throughput and memory: `specconv convert` against llama.cpp's converter and a disk floor.

    python3 benchmarks/convert.py [--size-gb 2.2] [--repeats 3] [--outtypes bf16,q8_0]

On one generated Qwen3.5-shaped bf16 checkpoint (tools/synth_qwen35.py: sharded, random, written
once and reused), for each output type, interleaved over the repeats:

* ours: `python -m specconv convert CKPT -o OUT --outtype T` (MTP embedded, the default);
* llama.cpp: its `convert_hf_to_gguf.py` from the llama-cpp-python 0.3.36 source distribution
  (tools/llamacpp_convert.py; the tree is found as tests/run.sh leaves it);
* floor: a plain Python process that reads every shard and writes as many bytes as our GGUF for
  that type has, through one 2 MB buffer (no compute: the cost of the bytes alone; for q8_0 it still
  reads the whole checkpoint, as a conversion must, and writes fewer bytes).

Each command runs under tools/peak_rss.py (wall time; peak RSS of the process tree from the OS).
Before each run the page cache is flushed to disk (`sync`) and the previous output deleted, so every
run starts from the same state: the checkpoint in the page cache, nothing dirty. Medians are
reported with min/max and the ratios. Outside the timed runs, the tensor data of ours and
llama.cpp's file are compared tensor by tensor. The table goes into docs/benchmarks.md (its own
section) and the raw results into docs/convert_benchmark.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import convert_report  # noqa: E402
from tools.synth_qwen35 import write_checkpoint  # noqa: E402

SDIST_TREE = "llama_cpp_python-0.3.36/vendor/llama.cpp"

FLOOR = """
import sys
out, size, shards = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
buf = bytearray(2 << 20)  # the fastest plain copy measured here (it stays in the CPU cache); 16 MB was slower
view = memoryview(buf)
left = size
with open(out, "wb") as w:
    for path in shards:  # every byte of the checkpoint is read, as a conversion must
        with open(path, "rb", buffering=0) as r:
            while n := r.readinto(buf):
                left -= w.write(view[:min(n, left)]) if left > 0 else 0
    while left > 0:  # an output larger than the checkpoint: write the rest again from the buffer
        left -= w.write(view[:min(len(buf), left)])
"""


def llama_tree(arg: str | None) -> Path | None:
    candidates = [arg, os.environ.get("SPECCONV_LLAMA_CPP_SRC"),
                  str(Path(os.environ.get("SPECCONV_CACHE", Path.home() / ".cache" / "specconv")) / SDIST_TREE)]
    for c in candidates:
        if c and (Path(c) / "convert_hf_to_gguf.py").is_file():
            return Path(c)
    return None


def measured(cmd: list[str], scratch: Path) -> dict:
    """One run under tools/peak_rss.py, from a clean page-cache state."""
    os.sync()
    result = scratch / "rss.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "peak_rss.py"), str(result), "--", *cmd],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def commands(ckpt: Path, outtype: str, out: Path, tree: Path | None, threads: int, extra: list[str],
             size: int) -> dict[str, list[str]]:
    cmds = {"ours": [sys.executable, "-m", "specconv", "convert", str(ckpt), "-o", str(out / "ours.gguf"),
                     "--outtype", outtype, "--force", "--threads", str(threads), "--json", *extra]}
    if tree is not None:
        cmds["llama.cpp"] = [sys.executable, str(ROOT / "tools" / "llamacpp_convert.py"), str(tree), "qwen35",
                             str(ckpt), "--outtype", outtype, "--outfile", str(out / "llama.gguf")]
    shards = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    cmds["floor"] = [sys.executable, "-c", FLOOR, str(out / "floor.bin"), str(size), *shards]
    return cmds


def compare_tensors(ours: Path, theirs: Path) -> dict:
    """Tensor data of two GGUF files: how many tensors of the same name and type have the same bytes."""
    from specconv.runtime.gguf_reader import open_gguf

    a, b = open_gguf(ours), open_gguf(theirs)
    same_type = [n for n in a.tensors if n in b.tensors and a.tensors[n].ggml_type == b.tensors[n].ggml_type]
    identical = sum(bytes(a.tensors[n].raw()) == bytes(b.tensors[n].raw()) for n in same_type)
    return {"ours": len(a.tensors), "llama.cpp": len(b.tensors), "same_type": len(same_type),
            "identical": identical, "same_order": list(a.tensors) == list(b.tensors)}


def summary(runs: list[dict]) -> dict:
    walls, rss = [r["wall_s"] for r in runs], [r["peak_rss_bytes"] for r in runs]
    return {"wall_s": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls),
            "rss_bytes": statistics.median(rss), "runs": runs}


def ratios(row: dict) -> dict:
    ours, llama, floor = row.get("ours"), row.get("llama.cpp"), row.get("floor")
    out = {}
    if ours and llama:
        out["speedup_vs_llama"] = llama["wall_s"] / ours["wall_s"]
        out["rss_vs_llama"] = ours["rss_bytes"] / llama["rss_bytes"]
    if ours and floor:
        out["time_vs_floor"] = ours["wall_s"] / floor["wall_s"]
    return out


def machine() -> dict:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cores": os.cpu_count(), "memory_gb": round(mem / 1e9, 1), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--size-gb", type=float, default=2.2, help="checkpoint size in GB (default 2.2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per command and type (median)")
    ap.add_argument("--outtypes", default="bf16,q8_0", help="comma-separated output types")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "specconv" / "bench",
                    help="where the checkpoint is generated and kept")
    ap.add_argument("--llama-cpp-src", default=None, help="llama.cpp tree with convert_hf_to_gguf.py")
    ap.add_argument("--skip-llama", action="store_true", help="do not run llama.cpp's converter")
    ap.add_argument("--threads", type=int, default=0, help="--threads for specconv (0: all cores)")
    ap.add_argument("--ours-extra-args", default="", help="more arguments for specconv convert")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()

    tree = None if args.skip_llama else llama_tree(args.llama_cpp_src)
    if tree is None and not args.skip_llama:
        raise SystemExit("llama.cpp's converter not found: pass --llama-cpp-src, set SPECCONV_LLAMA_CPP_SRC, "
                         "run tests/run.sh once (it downloads the sdist), or use --skip-llama")
    ckpt = write_checkpoint(args.workdir / f"qwen35-{args.size_gb:g}gb", int(args.size_gb * 1e9))
    shards = sorted(ckpt.glob("*.safetensors"))
    ckpt_bytes = sum(p.stat().st_size for p in shards)
    for p in shards:  # into the page cache: every run reads from memory
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    config = json.loads((ckpt / "config.json").read_text())["text_config"]
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "repeats": args.repeats,
              "checkpoint": {"bytes": ckpt_bytes, "shards": len(shards), "layers": config["num_hidden_layers"],
                             "hidden": config["hidden_size"], "vocab": config["vocab_size"], "mtp_layers": 1},
              "threads": args.threads, "rows": {}}
    extra = args.ours_extra_args.split()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="out-") as tmp:
        out = Path(tmp)
        for outtype in args.outtypes.split(","):
            # One untimed run of each converter: the output size for the floor, and the data comparison.
            probe = commands(ckpt, outtype, out, tree, args.threads, extra, 0)
            measured(probe["ours"], out)
            size = (out / "ours.gguf").stat().st_size
            row = {"output_bytes": size}
            if tree is not None:
                measured(probe["llama.cpp"], out)
                row["tensors"] = compare_tensors(out / "ours.gguf", out / "llama.gguf")
            cmds = commands(ckpt, outtype, out, tree, args.threads, extra, size)
            runs: dict[str, list[dict]] = {name: [] for name in cmds}
            for r in range(args.repeats):
                order = list(cmds)[r % len(cmds):] + list(cmds)[:r % len(cmds)]  # rotate who goes first
                for name in order:
                    for f in out.iterdir():
                        f.unlink()
                    runs[name].append(measured(cmds[name], out))
                    print(f"{outtype} {name} run {r + 1}: {runs[name][-1]['wall_s']:.2f} s, "
                          f"{runs[name][-1]['peak_rss_bytes'] / 1e9:.2f} GB", file=sys.stderr)
            for f in out.iterdir():
                f.unlink()
            row.update({name: summary(rs) for name, rs in runs.items()})
            row["ratios"] = ratios(row)
            result["rows"][outtype] = row
    print(convert_report.table(result))
    if args.json:
        print(json.dumps(result, indent=2))
    if not args.no_docs:
        convert_report.write(result, ROOT / "docs")


if __name__ == "__main__":
    main()
