"""Fuzz every command that opens GGUF files with mutated copies of valid files of every family.

    python3 tools/fuzz_gguf.py --seeds fuzz-seeds --cases 100000 --json fuzz.json   # long run
    python3 tools/fuzz_gguf.py --seeds DIR --families qwen35-embed --cases 200     # a quick look

Each case mutates one file of a seed (tools/fuzz_seeds.py: the model, or the head of a pair) with
tools/fuzz_mutate.py and runs it in a child process forked from a parent that imported everything
once (a `Worker`: it serves cases one after another and is replaced after any case that is not ok
or clear), under a memory cap (RLIMIT_AS) and a per-case time limit:
* the runtime pipeline, what `specconv generate` / `verify` do: open (GGUFModelFile) -> hparams
  (`validate.read_hparams`) -> load (`load_model`, which validates; for a pair the head is loaded
  next to the target) -> tokenizer (build, encode, decode) -> decode (2 tokens, plain or speculative
  with the seed's drafter);
* the tools: `inspect`'s summary, `mtp extract` (or `merge` for a sidecar pair) planned and
  written, `upload --dry-run`'s plan, the hub re-split written; none may leave a temporary file.
Outcomes: ok (ran), clear (a one-line SpecconvError), internal (any other exception, or the
child died), hang (killed at the time limit), memory (MemoryError / allocator failure). The report
counts them per family and lists each distinct internal error with a case that reproduces it
(`--case N` reruns one and prints its traceback).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
if str(ROOT) not in sys.path:  # tests.fixtures; appended, so an installed specconv is the one imported
    sys.path.append(str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUTCOMES = ("ok", "clear", "internal", "hang", "memory")
PROMPT = "def f(x):\n    return x + 1"


def _classify(exc: BaseException, names: list[str]) -> tuple[str, str]:
    from specconv.archs.errors import SpecconvError

    msg = str(exc)
    if isinstance(exc, MemoryError) or ("allocate" in msg and isinstance(exc, RuntimeError)):
        return "memory", f"{type(exc).__name__}: {msg[:200]}"
    if isinstance(exc, SpecconvError):
        if "\n" in msg or not msg:
            return "internal", f"multi-line SpecconvError: {msg[:200]!r}"
        if "internal" in msg:  # the project's own "internal: ..." consistency errors
            return "internal", f"SpecconvError: {msg[:200]}"
        return "clear", msg
    tb = traceback.extract_tb(exc.__traceback__)
    where = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb[-3:]))
    return "internal", f"{type(exc).__name__}: {msg.splitlines()[0][:160] if msg else ''} [{where}]"


def _pipeline(kind: str, paths: list[Path]) -> None:
    from specconv.runtime import validate
    from specconv.runtime.generate import generate
    from specconv.runtime.gguf_file import GGUFModelFile
    from specconv.runtime.graphs import graph_for
    from specconv.runtime.model import load_model
    from specconv.runtime.speculative import SpecConfig, build_drafter, speculative_generate

    for p in paths:
        f = GGUFModelFile(p)
        validate.read_hparams(f, graph_for(f.arch))
    target = load_model(paths[0], device="cpu")
    tok = target.tokenizer
    ids = tok.encode(PROMPT) or [0]
    tok.decode(ids)
    ids = [i for i in ids if i < target.vocab_size] or [0]
    if kind == "plain":
        generate(target, ids, 2)
        return
    head = paths[1] if len(paths) > 1 else None
    drafter_kind = {"mtp": "mtp", "eagle3": "eagle3", "dflash": "dflash", "assistant": "draft"}[kind]
    drafter = build_drafter(drafter_kind, target, len(ids) + 8, 2, mtp_path=head if kind == "mtp" else None,
                            draft_path=head if kind != "mtp" else None)
    speculative_generate(target, drafter, ids, 2, SpecConfig(draft_max=2))


def _tools(kind: str, paths: list[Path], out_dir: Path) -> None:
    """inspect, mtp extract / merge, upload's plan and re-split; a failure must leave no temporary."""
    try:
        _run_tools(kind, paths, out_dir)
    finally:
        left = [p.name for p in out_dir.rglob("*") if ".partial" in p.name]
        if left:
            raise RuntimeError(f"temporary files left behind: {left[:3]}")


def _run_tools(kind: str, paths: list[Path], out_dir: Path) -> None:
    from specconv.runtime.gguf_reader import open_gguf
    from specconv.convert.gguf_summary import summarize
    from specconv.convert.mtp_graft import plan_extract, plan_merge, write_plan
    from specconv.errors import SpecconvError
    from specconv.hub.plan import build_plan

    for p in paths:
        summarize(p)
    files = [open_gguf(p) for p in paths]
    try:
        if kind == "mtp" and len(files) == 2:
            plan = plan_merge(files[0], files[1])
        else:
            plan = plan_extract(files[-1])
        write_plan(plan, out_dir / "out" / "written.gguf", inputs=files)
    except SpecconvError as exc:
        if "no MTP" not in str(exc) and "MTP" not in str(exc):
            raise
    build_plan(paths[-1].parent, repo_id="fuzz/fuzz", max_file_size=256 << 10)
    from specconv.hub.split import plan_split, write_split

    layout = plan_split([paths[-1]], 300_000)
    write_split(layout, [out_dir / "split" / f"s-{i + 1:05d}-of-{layout.count:05d}.gguf" for i in range(layout.count)])


class Worker:
    """A child forked once from the prepared parent that runs cases one after the other, under the
    memory cap; the parent gives each case a time limit. After a case that is not ok / clear (and
    every `recycle` cases) the child is replaced, so no case runs in a disturbed process."""

    def __init__(self, mem_bytes: int, recycle: int = 500):
        self.mem_bytes, self.recycle = mem_bytes, recycle
        self.pid = None

    def _start(self) -> None:
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(to_child), os.close(from_child)
                os.setpgid(0, 0)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1), os.dup2(devnull, 2)
                resource.setrlimit(resource.RLIMIT_AS, (self.mem_bytes, self.mem_bytes))
                _serve(os.fdopen(from_parent, "rb"), to_parent)
            finally:
                os._exit(0)
        os.close(from_parent), os.close(to_parent)
        self.pid, self.send, self.recv, self.done, self.buf = pid, os.fdopen(to_child, "wb"), from_child, 0, b""

    def stop(self) -> None:
        if self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            status = os.waitpid(self.pid, 0)[1]
            self.send.close(), os.close(self.recv)
            self.pid = None
            return status
        return 0

    def run(self, stage: str, args: list, names: list[str], time_limit: float) -> tuple[str, str]:
        if self.pid is None or self.done >= self.recycle:
            self.stop()
            self._start()
        self.done += 1
        try:
            self.send.write((json.dumps([stage, args, names]) + "\n").encode())
            self.send.flush()
        except BrokenPipeError:
            pass
        deadline = time.monotonic() + time_limit
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                return "hang", f"over {time_limit:g} s"
            if select.select([self.recv], [], [], left)[0]:
                chunk = os.read(self.recv, 65536)
                if not chunk:  # the child died in the case
                    status = self.stop()
                    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
                    return "internal", f"child killed by signal {sig}" if sig else "child died without a result"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        outcome, message = json.loads(line)
        if outcome not in ("ok", "clear"):
            self.stop()
        return outcome, message


STAGES = {"runtime": lambda kind, paths: _pipeline(kind, [Path(p) for p in paths]),
          "tools": lambda kind, paths, work: _tools(kind, [Path(p) for p in paths], Path(work))}


def _serve(inp, out_fd: int) -> None:
    for line in inp:
        stage, args, names = json.loads(line)
        try:
            STAGES[stage](*args)
            outcome = ("ok", "")
        except BaseException as exc:  # noqa: BLE001 - classification is the point
            outcome = _classify(exc, names)
        os.write(out_fd, (json.dumps(outcome) + "\n").encode())


def _prepare_imports() -> None:
    import torch

    torch.set_num_threads(1)
    import specconv.convert.gguf_summary  # noqa: F401
    import specconv.convert.mtp_graft  # noqa: F401
    import specconv.hub.plan  # noqa: F401
    import specconv.runtime.drafters  # noqa: F401
    import specconv.runtime.generate  # noqa: F401
    import specconv.runtime.model  # noqa: F401
    import specconv.runtime.speculative  # noqa: F401
    from specconv.runtime import graphs

    for arch in graphs.supported_archs():
        graphs.graph_module(arch)
    wire_validation()


def wire_validation() -> None:
    """Until Model.__init__ calls validate_model itself, call it where it will: on the needed tensors."""
    import inspect

    from specconv.runtime import model, validate

    if "validate_model" in inspect.getsource(model) or getattr(model.Model._needed, "validates", False):
        return
    original = model.Model._needed

    def _needed(self):
        needed = original(self)
        validate.validate_model(self.file, self.graph, self.hparams, needed)
        return needed

    _needed.validates = True
    model.Model._needed = _needed


def case_plan(seeds: dict, families: list[str], base_seed: int, i: int):
    """(family, kind, index of the mutated file, rng) of case i."""
    rng = random.Random(base_seed * 1_000_003 + i)
    family = families[i % len(families)]
    kind, paths = seeds[family]
    which = len(paths) - 1 if len(paths) > 1 and rng.random() < 0.7 else 0
    return family, kind, paths, which, rng


def run(args) -> dict:
    from fuzz_mutate import Doc, mutate
    from fuzz_seeds import SEEDS, build_seeds

    families = args.families.split(",") if args.families else list(SEEDS)
    seeds = build_seeds(args.seeds, families)
    _prepare_imports()
    docs = {p: Doc.parse(p) for _, paths in seeds.values() for p in paths}
    counts = {stage: {f: collections.Counter() for f in families} for stage in ("runtime", "tools")}
    internal: dict[str, dict] = {}
    unnamed: collections.Counter = collections.Counter()
    root = Path(tempfile.mkdtemp(prefix="specconv-fuzz-"))
    worker = Worker(args.mem_mb << 20)
    start = time.monotonic()
    cases = [args.case] if args.case is not None else range(args.start, args.start + args.cases)
    done = 0
    try:
        for n, i in enumerate(cases):
            if STOP:
                raise KeyboardInterrupt
            family, kind, paths, which, rng = case_plan(seeds, families, args.seed, i)
            shutil.rmtree(root / f"case-{i - 1}", ignore_errors=True)
            work = root / f"case-{i}"  # a fresh folder per case: nothing is cached by an old path
            work.mkdir()
            data, note = mutate(docs[paths[which]], rng)
            local = []
            for j, p in enumerate(paths):
                dst = work / p.name
                dst.write_bytes(data) if j == which else os.link(p, dst)
                local.append(dst)
            names = [p.name for p in local]
            if args.case is not None:
                _debug(kind, local, work)
            for stage, fargs in (("runtime", [kind, [str(p) for p in local]]),
                                 ("tools", [kind, [str(p) for p in local], str(work)])):
                if stage == "tools" and i % args.tools_every:
                    continue
                outcome, message = worker.run(stage, fargs, names, args.time_limit)
                counts[stage][family][outcome] += 1
                if outcome == "clear" and not any(name in message for name in names):
                    counts[stage][family]["unnamed"] += 1  # clear, but the file is not named
                    unnamed[f"{stage}: {message[:120]}"] += 1
                if outcome not in ("ok", "clear"):
                    key = f"{stage}: {outcome}: {message}"
                    entry = internal.setdefault(key, {"count": 0, "case": i, "family": family, "mutation": note})
                    entry["count"] += 1
                    if args.progress and entry["count"] == 1:
                        print(f"new problem at case {i} ({family}, {note[:80]}): {key}", flush=True)
                    if args.keep and entry["count"] == 1:
                        shutil.copytree(work, Path(args.keep) / f"case-{i}", dirs_exist_ok=True)
            done = n + 1
            if args.progress and (n + 1) % args.progress == 0:
                print(f"{n + 1} cases, {time.monotonic() - start:.0f} s: {_totals(counts)}", flush=True)
    except KeyboardInterrupt:  # stopped early (Ctrl-C, SIGTERM): report the cases that completed
        print(f"stopped after {done} cases", flush=True)
    finally:
        worker.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"cases": done, "first_case": args.start, "seconds": round(time.monotonic() - start, 1), "seed": args.seed,
            "time_limit_s": args.time_limit, "memory_cap_mb": args.mem_mb, "totals": _totals(counts),
            "by_family": {s: {f: dict(c) for f, c in per.items()} for s, per in counts.items()},
            "problems": dict(sorted(internal.items(), key=lambda kv: -kv[1]["count"])),
            "clear_without_file_name": dict(unnamed.most_common(40))}


def _totals(counts) -> dict:
    out = {}
    for stage, per in counts.items():
        total = collections.Counter()
        for c in per.values():
            total.update(c)
        out[stage] = {o: total.get(o, 0) for o in OUTCOMES + ("unnamed",)}
    return out


def _debug(kind, paths, work) -> None:
    """--case N: run in-process and print the traceback."""
    for fn, fargs in ((_pipeline, (kind, paths)), (_tools, (kind, paths, work))):
        try:
            fn(*fargs)
            print(fn.__name__, "ok")
        except Exception:  # noqa: BLE001
            traceback.print_exc()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default=str(ROOT / "fuzz-seeds"), help="folder of seed files (built when missing)")
    ap.add_argument("--families", default=None, help="comma-separated seed names (default: all)")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0, help="first case number (to continue a run)")
    ap.add_argument("--case", type=int, default=None, help="rerun one case in-process with its traceback")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per case and stage")
    ap.add_argument("--mem-mb", type=int, default=4096, help="address-space cap of each case (RLIMIT_AS)")
    ap.add_argument("--tools-every", type=int, default=1, help="run the tool stage on every k-th case")
    ap.add_argument("--keep", default=None, help="copy the files of each distinct problem here")
    ap.add_argument("--progress", type=int, default=0, help="print totals every N cases")
    ap.add_argument("--json", default=None, help="write the report here")
    return ap


STOP = []


def _stop(signum, frame) -> None:
    STOP.append(signum)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # kill PID: finish the case, stop and still write the report
    report = run(args)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(json.dumps({"cases": report["cases"], "seconds": report["seconds"], "totals": report["totals"]}))
    for key, entry in list(report["problems"].items())[:30]:
        print(f"{entry['count']:6d}  case {entry['case']} ({entry['family']}, {entry['mutation'][:80]}): {key}")
    for key, n in list(report["clear_without_file_name"].items())[:10]:
        print(f"{n:6d}  file not named: {key}")
    bad = sum(v for stage in report["totals"].values() for o, v in stage.items() if o not in ("ok", "clear", "unnamed"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
