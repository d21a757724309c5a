"""Decode and verification on one GPU: cost by batch size, plain and speculative rates, memory, kernels
and host syncs per step, against the bandwidth floor and a dense bf16 chain replayed as one CUDA graph.

    python3 benchmarks/cuda_decode.py --workdir /scratch/bench-cuda --json $OUT/cuda_decode.json
    python3 benchmarks/cuda_decode.py --model FILE.gguf --device cpu --batch-max 2 -n 4   # a smoke run

Files (unless `--model`): the ~1.1 B-param Qwen3.5-shaped checkpoint of tools/synth_qwen35.py
(benchmarks/runtime.py's `dense1b`) converted by `specconv convert` to bf16, q8_0 and Q4_K_M (our
K-quant output is byte-identical to llama.cpp's quantize), and its Qwen3.5-MoE sibling (`moe`) in
Q4_K_M. Per file, one process, one device:
- GPU memory after load (allocated by the load: the difference from before it, after the previous
  file's model was freed and collected) and the peak over the run;
- t(n), n = 1..--batch-max: one target forward of n rows at position 16 of a context, logits for
  every row, rolled back after each (as a verification round); the device synchronised around each
  forward, median of --repeats;
- plain greedy decoding of -n tokens (tokens per second of the decode phase), in a context whose
  graphs an earlier call captured (runtime/context_pool.py);
- the synthetic drafter at A = 0.8, k = 3 (runtime/drafters/synthetic.py): decode speed-up over plain
  and whether its tokens equal plain decoding's (in the default compute dtype); in brackets the
  first calls' speed-up (each capturing its widths' graphs) and the steady state's: runs of 2n
  tokens timed step by step (round by round), their second halves (without the last rounds, which
  the token budget narrows to widths met once);
- torch.profiler over one decode step after two warm-up steps (with CUDA graphs, the default on
  CUDA: a replay): device kernels launched and host<->device copies or syncs;
- host<->device copies or syncs per speculative round, k = 3: the synthetic drafter's, and the MTP
  head's (greedy drafts on the device, read once; the head's steps replayed as graphs; also the
  blocking ones alone: stream, device or event synchronisations) for the file
  types of --mtp-types, whose head is the checkpoint's `mtp.*` layer converted `--mtp only` into a
  sidecar (the measured files themselves carry no head); its drafts are random, so nearly all are
  rejected: the rounds measure syncs and tokens identical to plain, not acceptance;
- the floor: the file read once at the bandwidth of a measured device-to-device copy;
- the same 2-D weight matrices (the token embedding excluded: decoding reads one row of it) as
  plain bf16 `F.linear` on one input row each, eager and replayed as one CUDA graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPT = [3 + (i * 7919) % 2000 for i in range(32)]
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")
# the calls that block the host until the device catches up (a read back, a pageable upload)
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("bench-cuda"), help="checkpoints and GGUF files (≈ 8 GB)")
    p.add_argument("--model", type=Path, action="append", default=None,
                   help="measure this GGUF instead of building the 1 B files (repeatable)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the runtime's for the device)")
    p.add_argument("--batch-max", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--no-moe", action="store_true", help="skip the Qwen3.5-MoE file")
    p.add_argument("--types", default="bf16,q8_0,Q4_K_M", help="dense 1 B file types to build and measure")
    p.add_argument("--mtp-types", default="q8_0",
                   help="dense file types whose MTP head (a --mtp only sidecar) drafts a measured round")
    p.add_argument("--mtp-head", type=Path, default=None,
                   help="with --model: an MTP-head sidecar (--mtp only) of those files, drafting a measured round")
    p.add_argument("--build-only", action="store_true",
                   help="write the checkpoints and GGUF files, measure nothing (run it on the CPU while the GPU works)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def build(args) -> tuple[dict[str, Path], dict[str, Path]]:
    """({name: GGUF file}, {name: its MTP-head sidecar, for the types of --mtp-types})."""
    if args.model:
        return {m.stem: m for m in args.model}, ({m.stem: args.mtp_head for m in args.model} if args.mtp_head else {})
    from benchmarks.runtime import MODELS

    sys.path.insert(0, str(REPO / "tools"))
    from synth_qwen35 import write_checkpoint

    files, heads = {}, {}
    wanted = [("dense1b", t) for t in args.types.split(",") if t] + ([] if args.no_moe else [("moe", "Q4_K_M")])
    with_head = {("dense1b", t) for t in args.mtp_types.split(",") if t}
    for model, qtype in wanted:
        spec = dict(MODELS[model])
        src = write_checkpoint(args.workdir / f"{model}-hf", spec.pop("target_bytes"), **spec)
        for mtp, out in [("none", args.workdir / f"{model}-{qtype}.gguf")] + (
                [("only", args.workdir / f"{model}-{qtype}-mtp.gguf")] if (model, qtype) in with_head else []):
            if not out.is_file():
                subprocess.run([sys.executable, "-m", "specconv", "convert", str(src), "-o", str(out), "--outtype",
                                qtype, "--mtp", mtp], check=True, stdout=subprocess.DEVNULL)
        files[f"{model}-{qtype}"] = args.workdir / f"{model}-{qtype}.gguf"
        if (model, qtype) in with_head:
            heads[f"{model}-{qtype}"] = args.workdir / f"{model}-{qtype}-mtp.gguf"
    return files, heads


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_costs(model, n_max: int, repeats: int) -> list[float]:
    """Median seconds of one forward of n = 1..n_max rows (logits for all), rolled back after each."""
    from specconv.runtime.context import Context
    from specconv.runtime.types import GraphType

    prefix, device = 16, model.device
    ids = [(3 + 7919 * i) % model.vocab_size for i in range(prefix + n_max)]
    ctx = Context(model, GraphType.MAIN, n_ctx=prefix + n_max + 1, n_rs_seq=n_max)
    ctx.decode(ids[:prefix], hidden=(), logits=None)
    runs: dict[int, list[float]] = {n: [] for n in range(1, n_max + 1)}
    for rep in range(repeats + 1):  # the first pass warms every width up
        for n in range(1, n_max + 1):
            synchronize(device)
            t0 = time.perf_counter()
            ctx.decode(ids[prefix:prefix + n], hidden=(), logits="all")
            synchronize(device)
            if rep:
                runs[n].append(time.perf_counter() - t0)
            ctx.seq_rm(0, prefix)
    return [statistics.median(runs[n]) for n in range(1, n_max + 1)]


def profile_step(model) -> dict:
    """Device kernels and host<->device copies or syncs in one decode step (after a warm-up step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specconv.runtime.context import Context
    from specconv.runtime.types import GraphType

    ids = [t % model.vocab_size for t in PROMPT[:11]]
    ctx = Context(model, GraphType.MAIN, n_ctx=len(ids) + 1, n_rs_seq=0)
    ctx.decode(ids[:8], hidden=(), logits=None)
    ctx.decode(ids[8:9], hidden=(), logits="last")  # with graphs: the warm-up, then the capture
    ctx.decode(ids[9:10], hidden=(), logits="last")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        ctx.decode(ids[10:11], hidden=(), logits="last")
    synchronize(model.device)
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    # where the step's time goes: the operators with the most device (else host) time, for the log
    by_time = sorted(prof.key_averages(), key=lambda a: (a.device_time_total, a.cpu_time_total),
                     reverse=True)
    top = [{"name": a.key[:80], "count": a.count, "device_us": round(a.device_time_total, 1),
            "cpu_us": round(a.cpu_time_total, 1)} for a in by_time[:15]]
    return {"kernels": kernels, "syncs": syncs, "graph_replays": ctx.graphs.replays if ctx.graphs else 0, "top": top,
            "sync_sites": sync_sites(events)}


def sync_sites(events) -> dict[str, int]:
    """Host<->device copies and syncs counted by the innermost project frame that asked for them and
    the operator that made the call ("runtime/context.py(88): decode [aten::copy_]"). A CUDA runtime
    call carries no Python stack of its own: it is found on the operators enclosing it."""
    sites: dict[str, int] = {}
    for e in events:
        if e.name in SYNC_CALLS:
            site = _call_site(e)
            sites[site] = sites.get(site, 0) + 1
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def _call_site(event) -> str:
    op, node = None, getattr(event, "cpu_parent", None)
    frames = _project_frames(event)
    while node is not None and not frames:
        op = op or node.name
        frames = _project_frames(node)
        node = getattr(node, "cpu_parent", None)
    where = frames[0] if frames else "(no project frame)"
    return f"{where} [{op}]" if op else where


def _project_frames(event) -> list[str]:
    return [f for f in (getattr(event, "stack", None) or [])
            if "specconv" in f or "/runtime/" in f or "/benchmarks/" in f]


def profile_rounds(model, ref: list[int], prompt: list[int], n: int, head: Path | None = None) -> dict:
    """Host<->device copies and syncs per speculative round, k = 3, after a warm-up run that captures
    every width: the synthetic drafter at A = 0.8, or with `head` the MTP head of that sidecar (also:
    whether its tokens equal the plain greedy `ref`, and the drafts accepted)."""
    from torch.profiler import ProfilerActivity, profile

    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate

    def run():
        drafter = (SyntheticDrafter(ref, model.vocab_size, 0.8, seed=0) if head is None
                   else build_drafter("mtp", model, len(prompt) + n + 5, 3, mtp_path=head))
        return speculative_generate(model, drafter, prompt, n, SpecConfig(draft_max=3))

    run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        res = run()
    events = prof.events()
    rounds = len(res.stats["rounds"])
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    blocking = sum(1 for e in events if e.name in BLOCKING_CALLS)
    out = {"rounds": rounds, "syncs": syncs, "syncs_per_round": syncs / max(1, rounds),
           "host_syncs_per_round": blocking / max(1, rounds), "sync_sites": sync_sites(events)}
    if head is not None:
        spec = res.stats["speculative"]
        out.update(tokens_identical=res.tokens == ref[len(prompt):len(prompt) + len(res.tokens)],
                   accepted=spec["accepted"], drafted=spec["drafted"])
    return out


def copy_floor(file_bytes: int, device) -> float | None:
    """Seconds to read `file_bytes` once at the bandwidth of a device-to-device copy (reads + writes)."""
    import torch

    if device.type != "cuda":
        return None
    n = min(file_bytes, 1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    bandwidth = 2 * n / min(times)
    del src, dst
    return file_bytes / bandwidth


def dense_chain(model) -> dict:
    """The model's 2-D matrices as bf16 `F.linear` on one row each: eager, and one CUDA graph replay."""
    import torch
    import torch.nn.functional as F

    device = model.device
    from specconv.runtime.stored import StoredWeight

    mats = [w.dense(torch.bfloat16) if isinstance(w, StoredWeight) else w.to(torch.bfloat16)
            for name, w in model.weights.items()
            if w.ndim == 2 and not name.startswith("token_embd") and min(w.shape) > 1]
    xs = [torch.randn(1, m.shape[1], dtype=torch.bfloat16, device=device) for m in mats]

    def chain():
        return [F.linear(x, m) for x, m in zip(xs, mats)]

    chain()
    synchronize(device)
    t0 = time.perf_counter()
    chain()
    synchronize(device)
    out = {"matrices": len(mats), "eager_s": time.perf_counter() - t0, "graph_s": None}
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            chain()
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.graph(graph):
            chain()
        graph.replay()
        synchronize(device)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            graph.replay()
            synchronize(device)
            times.append(time.perf_counter() - t0)
        out["graph_s"] = statistics.median(times)
        del graph
    del mats, xs
    return out


def run_file(path: Path, args, head: Path | None = None) -> dict:
    import torch

    from benchmarks.spec_scale import _decode_rate, _one
    from specconv.runtime import load_model
    from specconv.runtime.drafters.synthetic import greedy_reference
    from specconv.runtime.generate import generate

    device = torch.device(args.device)
    base = 0
    if device.type == "cuda":
        gc.collect()  # the previous file's model, and anything that kept it, gone before measuring
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    model = load_model(path, device=args.device, dtype=args.dtype)
    synchronize(device)
    out = {"file": path.name, "file_gb": path.stat().st_size / 1e9, "load_s": time.perf_counter() - t0,
           "dtype": str(model.dtype).replace("torch.", "")}
    if device.type == "cuda":
        out["memory_before_load_gb"] = base / 1e9
        out["memory_after_load_gb"] = (torch.cuda.memory_allocated(device) - base) / 1e9
    out["t_s"] = batch_costs(model, args.batch_max, args.repeats)
    prompt, n = [t % model.vocab_size for t in PROMPT[:16]], args.n_predict
    # first calls: each captures its widths' graphs (plain: 1; speculative: 1..k + 1), then calls
    # that replay them from the model's pooled contexts (runtime/context_pool.py)
    plain_first = generate(model, prompt, n)
    ref = greedy_reference(model, prompt, n)
    synthetic_first = _one(model, ref, prompt, n, 0.8, 3, 0, out["t_s"][0])
    plain = generate(model, prompt, n)
    synthetic = _one(model, ref, prompt, n, 0.8, 3, 1, out["t_s"][0])
    out["plain_tokens_per_s"] = _decode_rate(plain)
    steady = steady_rates(model, prompt, 2 * n)
    out["plain_steady_tokens_per_s"] = steady["plain"]
    out["synthetic"] = {"speedup": synthetic["decode_rate"] / _decode_rate(plain),
                        "first_call_speedup": synthetic_first["decode_rate"] / _decode_rate(plain_first),
                        "steady_speedup": steady["synthetic"] / steady["plain"],
                        "tokens_identical": (synthetic["tokens"] == synthetic_first["tokens"] == plain.tokens
                                             == plain_first.tokens and steady["identical"]),
                        "acceptance": synthetic["acceptance_rate"], "tokens_per_forward": synthetic["tokens_per_forward"]}
    out["profile"] = profile_step(model)
    out["round_profile"] = profile_rounds(model, ref, prompt, min(n, 24))
    if head is not None:
        out["mtp_round_profile"] = profile_rounds(model, ref, prompt, min(n, 24), head)
    if device.type == "cuda":  # the model's own peak: before the copy floor and the dense chain's buffers
        out["memory_peak_gb"] = (torch.cuda.max_memory_allocated(device) - base) / 1e9
    out["floor_s"] = copy_floor(path.stat().st_size, device)
    out["dense_chain"] = dense_chain(model)
    del model
    gc.collect()
    return out


def steady_rates(model, prompt: list[int], n: int) -> dict:
    """Tokens per second of plain greedy decoding and of the synthetic drafter (A = 0.8, k = 3) over the
    second half of an n-token run each, timed step by step (round by round): what a new context pays
    once (each width's first forward eager, then its CUDA graph's capture) falls in the first half.
    "identical": the speculative tokens are plain decoding's."""
    from specconv.runtime.drafters.synthetic import SyntheticDrafter
    from specconv.runtime.generate import generate
    from specconv.runtime.speculative import SpecConfig, speculative_generate

    plain_stamps, spec_stamps = [], []
    plain = generate(model, prompt, n, on_token=lambda _: plain_stamps.append((time.perf_counter(), len(plain_stamps) + 1)))
    made = [0]

    def on_round(ctx, r):
        made[0] += len(r.tokens)
        spec_stamps.append((time.perf_counter(), made[0]))

    k = 3
    drafter = SyntheticDrafter(list(prompt) + plain.tokens, model.vocab_size, 0.8, seed=0)
    spec = speculative_generate(model, drafter, prompt, n, SpecConfig(draft_max=k), on_round=on_round)
    return {"plain": _second_half_rate(plain_stamps),
            "synthetic": _second_half_rate(spec_stamps, full_width_until=n - (k + 1)),
            "identical": spec.tokens == plain.tokens}


def _second_half_rate(stamps: list[tuple[float, int]], full_width_until: int | None = None) -> float:
    """Tokens per second between the first stamp of the second half and the last: (time, tokens so far).
    With `full_width_until`, rounds that began with more tokens made are left out: the token budget
    narrows them to widths the run meets once, whose graphs a first call captures (the H200's
    2026-11-28 run: 0.58x "steady" against 2.21x for calls that replay every width)."""
    if full_width_until is not None:
        stamps = stamps[:1] + [s for before, s in zip(stamps, stamps[1:]) if before[1] <= full_width_until]
    (t0, n0), (t1, n1) = stamps[(len(stamps) - 1) // 2], stamps[-1]
    return (n1 - n0) / (t1 - t0)


def print_table(results: list[dict]) -> None:
    def ms(x):
        return "n/a" if x is None else f"{x * 1e3:.2f}"

    print("| file | dtype | t(1) ms | t(4)/t(1) | t(8)/t(1) | plain tok/s (steady) | A=0.8 k=3 (first call / steady) | identical | "
          "kernels | syncs | syncs/round | MTP blocking (all) syncs/round | replayed | floor ms | bf16 chain eager / graph ms | "
          "GB after load / file / peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t = r["t_s"]
        ratio = [f"{t[i] / t[0]:.2f}" if len(t) > i else "n/a" for i in (3, 7)]
        mem = (f"{r['memory_after_load_gb']:.2f} / {r['file_gb']:.2f} / {r['memory_peak_gb']:.2f}"
               if "memory_after_load_gb" in r else "n/a")
        mtp = r.get("mtp_round_profile")
        mtp = (f"{mtp['host_syncs_per_round']:.1f} ({mtp['syncs_per_round']:.1f})"
               + ("" if mtp["tokens_identical"] else " ≠ plain") if mtp else "n/a")
        syn = r["synthetic"]
        print(f"| {r['file']} | {r['dtype']} | {ms(t[0])} | {ratio[0]} | {ratio[1]} | {r['plain_tokens_per_s']:.1f} "
              f"({r['plain_steady_tokens_per_s']:.1f}) | {syn['speedup']:.2f}x ({syn['first_call_speedup']:.2f}x / "
              f"{syn['steady_speedup']:.2f}x) | {syn['tokens_identical']} | {r['profile']['kernels']} | "
              f"{r['profile']['syncs']} | {r['round_profile']['syncs_per_round']:.1f} | {mtp} | "
              f"{r['profile']['graph_replays'] > 0} | {ms(r['floor_s'])} | {ms(r['dense_chain']['eager_s'])} / "
              f"{ms(r['dense_chain']['graph_s'])} | {mem} |")


def main(argv=None) -> list[dict]:
    import torch

    args = parse_args(argv)
    files, heads = build(args)
    if args.build_only:
        print("\n".join(f"{name}: {path} ({path.stat().st_size / 1e9:.2f} GB)" for name, path in files.items()))
        return []
    meta = {"device": args.device, "torch": torch.__version__,
            "card": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    print(f"device {meta['device']} ({meta['card']}), torch {meta['torch']}", flush=True)
    results = []
    for name, path in files.items():
        print(f"{name}: measuring", flush=True)
        results.append(run_file(path, args, heads.get(name)))
        if args.json:  # written after each file: a run cut short keeps what it measured
            args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print_table(results)
    return results


if __name__ == "__main__":
    main()
