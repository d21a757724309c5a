"""The runtime at size: specconv's stored-weight runtime vs its dequantize-everything path vs llama.cpp.

    python3 benchmarks/runtime.py --workdir /big/disk/bench            # all models, 3 repeats
    python3 benchmarks/runtime.py --workdir W --models dense1b --repeats 1 --json out.json

1. generates Qwen3.5-shaped random checkpoints (tools/synth_qwen35.py): dense ~1 B and ~3 B
   parameters, and a MoE one;
2. converts each with `specconv convert` to bf16 and q8_0, and makes a Q4_K_M from the bf16 file with
   llama.cpp's quantize (llama-cpp-python's `llama_model_quantize`), as published files are made;
3. runs, each in its own process under tools/peak_rss.py (peak RSS and peak anonymous memory of
   the process), interleaved over the repeats: `specconv generate --json` with weights stored (the
   default), with `--weights dense` (every tensor dequantized to float32 at load: the path this
   runtime had before), with `--offload` on the MoE model (stored bytes read per token), and
   llama.cpp on the same file with the same thread count (this script's `--llama-worker` mode);
4. prints medians and the ratios (dense / stored, stored / llama.cpp) and writes the JSON.

Files are read once before timing so loads are measured with the file in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {  # name -> synth_qwen35 arguments
    "dense1b": {"target_bytes": 2_300_000_000},
    "dense3b": {"target_bytes": 6_400_000_000},
    "moe": {"target_bytes": 3_000_000_000, "experts": 32, "experts_used": 4},
}
PROMPT = [3 + (i * 7919) % 2000 for i in range(64)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, required=False, default=Path("bench-runtime"),
                   help="where checkpoints and GGUF files are written (several GB)")
    p.add_argument("--models", default="dense1b,dense3b,moe", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--types", default="bf16,q8_0,Q4_K_M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("-n", "--n-predict", type=int, default=8, help="decoded tokens per run")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--dense-max-gb", type=float, default=14.0,
                   help="skip the dense path where parameters x 4 bytes exceed this")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--llama-worker", nargs=3, metavar=("FILE", "PROMPT_TOKENS", "N"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- files ----------------------------------------------------------------------------------------

def build_files(workdir: Path, model: str, types: list[str]) -> dict[str, Path]:
    sys.path.insert(0, str(REPO / "tools"))
    from synth_qwen35 import write_checkpoint

    spec = dict(MODELS[model])
    src = write_checkpoint(workdir / f"{model}-hf", spec.pop("target_bytes"), **spec)
    files = {}
    for t in ("bf16", "q8_0"):
        out = workdir / f"{model}-{t}.gguf"
        if not out.is_file():
            subprocess.run([sys.executable, "-m", "specconv", "convert", str(src), "-o", str(out), "--outtype", t,
                            "--mtp", "none"], check=True, stdout=subprocess.DEVNULL)
        files[t] = out
    if "Q4_K_M" in types:
        out = workdir / f"{model}-Q4_K_M.gguf"
        if not out.is_file():
            import llama_cpp

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
            params.nthread = os.cpu_count() or 1
            tmp = out.with_suffix(".part")
            if llama_cpp.llama_model_quantize(str(files["bf16"]).encode(), str(tmp).encode(), params) != 0:
                raise RuntimeError("llama_model_quantize failed")
            tmp.rename(out)
        files["Q4_K_M"] = out
    return {t: files[t] for t in types}


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


# ---- one run ----------------------------------------------------------------------------------------

def run_measured(cmd: list[str], env: dict, workdir: Path) -> dict:
    rss = workdir / "rss.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "peak_rss.py"), str(rss), "--", *cmd],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    mem = json.loads(rss.read_text())
    out.update(peak_rss_bytes=mem["peak_rss_bytes"], peak_anon_bytes=mem["peak_anon_sampled_bytes"])
    return out


def specconv_run(path: Path, mode: str, args, env: dict) -> dict:
    tokens = ",".join(map(str, PROMPT[:args.prompt_tokens]))
    cmd = [sys.executable, "-m", "specconv", "generate", str(path), "--tokens", tokens, "-n", str(args.n_predict),
           "--device", "cpu", "--json"]
    cmd += {"stored": [], "dense": ["--weights", "dense"], "offload": ["--offload"]}[mode]
    out = run_measured(cmd, env, args.workdir)
    if "error" in out:
        return out
    per_forward = out.get("weight_bytes_read", 0) / max(1, out["target_evaluations"])
    return {"load_s": out["load_seconds"], "prompt_tok_s": out["prompt_tokens_per_second"],
            "decode_tok_s": out["decode_tokens_per_second"], "peak_rss_bytes": out["peak_rss_bytes"],
            "peak_anon_bytes": out["peak_anon_bytes"], "weight_bytes_per_forward": per_forward,
            "tokens": out["tokens"]}


def llama_run(path: Path, args, env: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--llama-worker", str(path), str(args.prompt_tokens),
           str(args.n_predict), "--threads", str(args.threads)]
    out = run_measured(cmd, env, args.workdir)
    return out


def llama_worker(path: str, prompt_tokens: int, n: int, threads: int) -> None:
    """Load, evaluate the prompt, decode n tokens greedily; print one JSON line."""
    import ctypes

    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    start = time.perf_counter()
    mp = llama_cpp.llama_model_default_params()
    # Plain CPU buffers: llama.cpp 0c1e570's AMX / repack buffer types crash in llama_decode on AMX
    # CPUs (tests/fixtures/peers.py); without them it runs its usual quantized dot products.
    mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    load = time.perf_counter() - start
    vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def decode(ids, pos0):
        batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if i == len(ids) - 1 else 0
        batch.n_tokens = len(ids)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        llama_cpp.llama_batch_free(batch)
        row = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (vocab_size,))))

    prompt = PROMPT[:prompt_tokens]
    t0 = time.perf_counter()
    tokens = [decode(prompt, 0)]
    t1 = time.perf_counter()
    while len(tokens) < n:
        tokens.append(decode([tokens[-1]], len(prompt) + len(tokens) - 1))
    t2 = time.perf_counter()
    print(json.dumps({"load_s": load, "prompt_tok_s": len(prompt) / (t1 - t0),
                      "decode_tok_s": (n - 1) / (t2 - t1) if n > 1 else None, "tokens": tokens}))


# ---- the benchmark -------------------------------------------------------------------------------

def median(rows: list[dict], key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.llama_worker:
        llama_worker(args.llama_worker[0], int(args.llama_worker[1]), int(args.llama_worker[2]), args.threads)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    types = args.types.split(",")
    plan = []  # (model, type, runner, path)
    for model in args.models.split(","):
        files = build_files(args.workdir, model, types)
        params = files["q8_0"].stat().st_size / (34 / 32) if "q8_0" in files else None
        for t, path in files.items():
            runners = ["stored", "llama.cpp"]
            if params is None or params * 4 / 1e9 <= args.dense_max_gb:
                runners.insert(1, "dense")
            if model == "moe":
                runners.append("offload")
            plan += [(model, t, r, path) for r in runners]
    results: dict[tuple, list] = {key[:3]: [] for key in plan}
    for rep in range(args.repeats):
        for model, t, runner, path in plan:
            warm(path)
            out = llama_run(path, args, env) if runner == "llama.cpp" else specconv_run(path, runner, args, env)
            out["file_bytes"] = path.stat().st_size
            results[(model, t, runner)].append(out)
            print(f"[{rep + 1}/{args.repeats}] {model} {t} {runner}: "
                  f"{ {k: v for k, v in out.items() if k != 'tokens'} }", flush=True)
    summary = summarize(results)
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "prompt_tokens": args.prompt_tokens,
                                         "n_predict": args.n_predict, "repeats": args.repeats,
                                         "summary": summary}, indent=1))


def summarize(results: dict) -> list[dict]:
    rows = []
    for (model, t, runner), runs in results.items():
        errors = [r["error"] for r in runs if "error" in r]
        ok = [r for r in runs if "error" not in r]
        row = {"model": model, "type": t, "runner": runner, "runs": len(ok), "errors": errors,
               "file_gb": runs[0]["file_bytes"] / 1e9}
        for key in ("load_s", "prompt_tok_s", "decode_tok_s", "peak_rss_bytes", "peak_anon_bytes",
                    "weight_bytes_per_forward"):
            row[key] = median(ok, key)
        if ok:
            row["tokens"] = ok[0].get("tokens")
        rows.append(row)
    by_key = {(r["model"], r["type"], r["runner"]): r for r in rows}
    for r in rows:
        if r["runner"] == "stored":
            for other in ("dense", "llama.cpp"):
                o = by_key.get((r["model"], r["type"], other))
                if o and o.get("decode_tok_s") and r.get("decode_tok_s"):
                    r[f"decode_vs_{other}"] = r["decode_tok_s"] / o["decode_tok_s"]
                if o and o.get("tokens") is not None and r.get("tokens") is not None:
                    r[f"same_tokens_as_{other}"] = o["tokens"] == r["tokens"]
        if r.get("peak_rss_bytes"):
            r["rss_over_file"] = r["peak_rss_bytes"] / (r["file_gb"] * 1e9)
    return rows


def print_table(rows: list[dict]) -> None:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    print(f"\n{'model':8} {'type':7} {'runner':9} {'file GB':>7} {'load s':>7} {'prompt t/s':>10} "
          f"{'decode t/s':>10} {'peak RSS GB':>11} {'RSS/file':>8} {'anon GB':>7}")
    for r in rows:
        print(f"{r['model']:8} {r['type']:7} {r['runner']:9} {r['file_gb']:7.2f} {f(r['load_s'], '7.2f')} "
              f"{f(r['prompt_tok_s'], '10.2f')} {f(r['decode_tok_s'], '10.3f')} "
              f"{f(r['peak_rss_bytes'] and r['peak_rss_bytes'] / 1e9, '11.2f')} {f(r.get('rss_over_file'), '8.2f')} "
              f"{f(r['peak_anon_bytes'] and r['peak_anon_bytes'] / 1e9, '7.2f')}"
              + (f"  errors: {r['errors']}" if r["errors"] else ""))
    for r in rows:
        if r["runner"] == "stored":
            print(f"{r['model']} {r['type']}: stored decode = {f(r.get('decode_vs_dense'), '.2f')}x dense, "
                  f"{f(r.get('decode_vs_llama.cpp'), '.2f')}x llama.cpp; same greedy tokens as dense: "
                  f"{r.get('same_tokens_as_dense')}")


if __name__ == "__main__":
    main()
