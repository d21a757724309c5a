"""Every Triton kernel specialization the CUDA backend launches, compiled for the GPU on the CPU.

    python3 tools/triton_aot.py                 # record, compile for sm_90 and sm_80, report failures
    python3 tools/triton_aot.py --check --cost  # and the tests' checks on everything; the cost report
    python3 tools/triton_aot.py --quick --widths 4 --arch 90 --json   # a small run, one JSON object
    python3 tools/triton_aot.py --release       # the wrappers at released models' shapes: resources, int32

The specializations come from benchmarks/triton_launches.py (forwards on the `meta` device with the
CUDA backend; each launch turned into what Triton's JIT would compile). Each distinct one is
compiled ahead of time by `triton.compile` for a GPUTarget (Triton's bundled ptxas: no GPU, no
driver) in worker processes without TRITON_INTERPRET (under the interpreter @triton.jit gives
functions the compiler cannot take), in parallel. A failure is reported with the kernel, its
specialization and Triton's message. Each compiled kernel is summarised for the checks of
tests/runtime/test_triton_compile.py (`Compiled`):

* `reduce_forms`: for every tt.reduce of the TTGIR, a digest of what decides its bits: its axis,
  its operand's shape and layout (aliases resolved: the lowering of a reduction, hence the order of
  its additions, follows from these), its combining operations, and the float operations feeding it
  (post-order over the operands back to loads and loop-carried values, which are leaves alike: a
  launch of one token, `n` = 1, compiles without its loop over tokens, its state a load where the
  loop's is carried; each operation with its element type and float constants; integer address
  arithmetic and layout conversions are left out, they move no float bits). A row's sums are the
  same in two compiled kernels when its reductions' digests are;
* `narrowing`: the PTX conversions from float32 to bfloat16 / float16 (`cvt.rn.*` rounds to nearest
  even; `.rz` truncates);
* `reassociating`: whether the LLVM IR lets the backend reorder float operations (`reassoc` / `fast`);
* `sass`: SASS opcode counts (`cuobjdump -sass`), for the contraction check (FFMA, FMUL);
* `loop`: the main loop's instructions in SASS (the longest backward branch), for `--cost`;
* `shared`, `num_warps`, `registers`: what a launch needs of a multiprocessor; a kernel whose shared
  memory passes the device's per-block limit (tools/triton_release.py) compiles but does not launch;
* `overflows`: with the launches' integer arguments and grids (`--release`:
  benchmarks/release_launches.py, the wrappers at the shapes of released checkpoints), the int32
  operations of the TTIR that wrap at one of them (tools/int_ranges.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ARCHS = (90, 80)  # H100 / H200, A100
FLOAT_TYPES = ("f64", "f32", "bf16", "f16")


@dataclass
class Compiled:
    """What the checks need from one specialization compiled for one architecture."""

    spec: dict  # Specialization.to_json()
    arch: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    reduce_forms: dict = field(default_factory=dict)  # digest -> count
    reduce_layouts: list = field(default_factory=list)  # distinct (axis, operand type) of the reductions
    narrowing: dict = field(default_factory=dict)  # PTX cvt to 16-bit floats -> count
    reassociating: bool = False
    fp_fusion: bool = True  # the options it was compiled with
    sass: dict = field(default_factory=dict)  # opcode -> count
    loop: dict = field(default_factory=dict)  # main loop: instructions, opcode counts, global loads
    shared: int = 0  # bytes of shared memory a program needs (the launch fails past the device's limit)
    num_warps: int = 0
    registers: int = 0  # per thread (cuobjdump -res-usage; 0 without the SASS step)
    overflows: list = field(default_factory=list)  # int32 operations that wrap at the launches given (int_ranges)


# ------------------------------------------------------------------ TTGIR

_OP = re.compile(r'^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*"?([\w.]+)"?(.*)$')
_VALUE = re.compile(r"%[\w.$-]+")
_LOC = re.compile(r"\s*loc\(.*$")
_ELEMENT = re.compile(r"(?:x|\b)(f64|f32|bf16|f16|i64|i32|i16|i8|i1)\b(?=[,>\s]|$)")


def resolve_aliases(ttgir: str) -> tuple[str, Callable[[str], str]]:
    """The module text without its `#name = attribute` lines, and a function that writes every alias
    in a text out in full (aliases name aliases: a slice of a blocked layout)."""
    aliases, body = {}, []
    for line in ttgir.splitlines():
        m = re.match(r"^(#[\w.]+)\s*=\s*(.*)$", line)
        if m:
            aliases[m.group(1)] = m.group(2)
        else:
            body.append(line)
    if not aliases:
        return "\n".join(body), lambda text: text
    pattern = re.compile("|".join(re.escape(a) for a in sorted(aliases, key=len, reverse=True)) + r"(?![\w.])")

    def expand(text: str) -> str:
        while True:
            new = pattern.sub(lambda m: aliases[m.group(0)], text)
            if new == text:
                return new
            text = new
    return "\n".join(body), expand


def _result_type(rest: str) -> str:
    """The type an operation's text ends with: after the last `->`, else after the last ` : `."""
    rest = _LOC.sub("", rest)
    if "->" in rest:
        return rest.rsplit("->", 1)[1].strip()
    return rest.rsplit(" : ", 1)[1].strip() if " : " in rest else ""


def _element(type_text: str) -> str:
    found = _ELEMENT.findall(type_text)
    return found[-1] if found else ""


@dataclass
class _Op:
    name: str
    operands: list
    element: str
    detail: str  # what else decides its bits (a reduction's axis, operand type and body; a float constant)
    line: int = 0  # where it stands in the module's text


class _Defs(dict):
    """SSA name -> the ops defining it, in text order. Sibling regions (two loops' bodies) may reuse a
    name: a use means the last definition above it (a name visible at the use is never reused by a
    region nested below its definition, so no other definition stands between)."""

    def before(self, name: str, line: int) -> _Op | None:
        ops = [o for o in self.get(name, ()) if o.line < line]
        return ops[-1] if ops else None


def parse_ops(ttgir: str) -> tuple[_Defs, list[_Op]]:
    """(defining ops of each SSA value, the tt.reduce ops in program order) of a TTGIR module."""
    text, expand = resolve_aliases(ttgir)
    lines = text.splitlines()
    defs, reduces, i = _Defs(), [], 0
    while i < len(lines):
        m = _OP.match(lines[i])
        at = i
        i += 1
        if not m:
            continue
        value, name, rest = m.groups()
        if name in ("tt.reduce", "tt.scan"):  # the combining region, then `}) : (operand types) -> result`
            axis = re.search(r"axis = (\d+)", rest)
            body = []
            while i < len(lines) and not lines[i].lstrip().startswith("})"):
                inner = _OP.match(lines[i])
                if inner:
                    body.append(inner.group(2))
                i += 1
            tail = _LOC.sub("", lines[i]) if i < len(lines) else ""
            i += 1
            operand_type = tail.split("(", 1)[1].rsplit(") ->", 1)[0] if "(" in tail else ""
            operand_type = expand(operand_type)
            detail = f"axis={axis.group(1) if axis else '?'} operand={operand_type} body={','.join(body)}"
            op = _Op(name, _VALUE.findall(rest.split(")", 1)[0]), _element(tail.rsplit("->", 1)[-1]), detail, at)
            reduces.append(op)
        else:
            args = _LOC.sub("", rest)
            result = _result_type(rest)
            detail = ""
            if name == "arith.constant" and _element(result) in FLOAT_TYPES:
                detail = args.split(" : ")[0].strip()
            op = _Op(name, _VALUE.findall(args.split(" : ")[0]), _element(result), detail, at)
        defs.setdefault(value, []).append(op)
    return defs, reduces


def reduce_form(op: _Op, defs: _Defs) -> str:
    """The float operations a reduction computes and is fed by, in post-order over its operands (see
    the module doc); loads are leaves (their `other` for masked lanes is the source's constant)."""
    seen, out = set(), []
    stack = [(op, False)]
    while stack:  # iterative: a chain may be deeper than Python's recursion limit
        o, done = stack.pop()
        if done or o.name == "tt.load":
            if o.element in FLOAT_TYPES and o.name not in ("ttg.convert_layout", "tt.load"):
                out.append(f"{o.name}:{o.element}{'[' + o.detail + ']' if o.detail else ''}")
            continue
        stack.append((o, True))
        for v in reversed(o.operands):
            source = defs.before(v, o.line)
            if source is not None and id(source) not in seen:
                seen.add(id(source))
                stack.append((source, False))
    return "\n".join(out)


def digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def reduce_summary(ttgir: str) -> tuple[dict[str, int], list[str]]:
    """(digest of each reduction's form -> count, the distinct reduction layouts) of a TTGIR module."""
    defs, reduces = parse_ops(ttgir)
    forms = Counter(digest(reduce_form(op, defs)) for op in reduces)
    return dict(forms), sorted({op.detail for op in reduces})


# ------------------------------------------------------------------ PTX, LLVM IR, SASS

_NARROW = re.compile(r"\bcvt(?:\.\w+)*\.(?:bf16|f16)(?:x2)?\.f32\b")


def narrowing(ptx: str) -> dict[str, int]:
    """PTX conversions from float32 to a 16-bit float, by instruction (with their rounding suffix)."""
    return dict(Counter(m.group(0) for m in _NARROW.finditer(ptx)))


def reassociating(llir: str) -> bool:
    """Whether any LLVM float instruction carries a flag that allows reordering (`reassoc`, `fast`)."""
    return re.search(r"\b(fadd|fsub|fmul|fdiv|call)\b[^\n]*\b(reassoc|fast)\b", llir) is not None


def sass_ops(sass: str) -> list[tuple[str, str]]:
    """(opcode with modifiers, operands) of each SASS instruction of a listing as triton.tools.disasm
    prints it (`ctrl<TAB>[@P] OPCODE operands;`), and ("LABEL", name) where a label stands."""
    out = []
    for line in sass.splitlines():
        label = re.match(r"^(\w+):$", line.strip())
        if label:
            out.append(("LABEL", label.group(1)))
            continue
        m = re.match(r"^\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", line)
        if m:
            out.append((m.group(1), m.group(2).strip()))
    return out


def main_loop(ops: list[tuple[str, str]]) -> dict:
    """The longest loop of a SASS listing (a branch back to a label above it): its instruction
    count, opcode counts and global loads by width."""
    labels = {name: i for i, (opcode, name) in enumerate(ops) if opcode == "LABEL"}
    best: list = []
    for i, (opcode, operands) in enumerate(ops):
        if opcode.startswith("BRA") and labels.get(operands.split()[-1] if operands else "", i) < i:
            body = [o for o in ops[labels[operands.split()[-1]]:i + 1] if o[0] != "LABEL"]
            best = body if len(body) > len(best) else best
    if not best:
        return {}
    return {"instructions": len(best), "opcodes": dict(Counter(o[0] for o in best).most_common()),
            "global_loads": dict(Counter(o[0] for o in best if o[0].startswith("LDG")))}


# ------------------------------------------------------------------ compiling

def _worker_init() -> None:
    """A compile worker: the kernel modules imported as compiled kernels, not interpreted ones."""
    os.environ.pop("TRITON_INTERPRET", None)
    warnings.simplefilter("ignore")


def compile_kernel(spec_json: dict, arch: int):
    """(Triton's compiled kernel, its options): one specialization compiled for sm_`arch` (in a process
    without TRITON_INTERPRET); raises Triton's error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from benchmarks.triton_launches import KERNELS, Specialization

    spec = Specialization.from_json(spec_json)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    names = [p for p, _ in spec.signature]
    fn = getattr(importlib.import_module(f"{KERNELS}.{spec.module}"), spec.kernel)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError(f"{spec.name} is a {type(fn).__name__}, not a JITFunction (TRITON_INTERPRET set?)")
    options = backend.parse_options({"debug": fn.debug or False, **dict(spec.options)})
    src = ASTSource(fn, dict(spec.signature), {(names.index(k),): v for k, v in spec.constexprs},
                    {(names.index(k),): [["tt.divisibility", 16]] for k in spec.divisible})
    return triton.compile(src, target=target, options=options.__dict__), options


def ptx(spec_json: dict, arch: int) -> str:
    """The PTX of one specialization compiled for sm_`arch` (in a worker of `_worker_init`)."""
    return compile_kernel(spec_json, arch)[0].asm["ptx"]


def registers(cubin: bytes) -> int:
    """Registers per thread of a compiled kernel (`cuobjdump -res-usage`'s REG), 0 where not given."""
    import subprocess
    import tempfile

    from triton.tools.disasm import path_to_cuobjdump

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([path_to_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"\bREG:(\d+)", out)
    return int(m.group(1)) if m else 0


def compile_spec(spec_json: dict, arch: int, sass: bool = True, launches=None) -> Compiled:
    """Compile one specialization for sm_`arch` (in a process without TRITON_INTERPRET) and summarise it;
    with `launches` ((integer arguments, grid) of each launch: benchmarks/release_launches.py), the
    int32 operations of its TTIR that wrap at any of them (tools/int_ranges.py)."""
    start = time.perf_counter()
    try:
        kernel, options = compile_kernel(spec_json, arch)
    except Exception as e:  # Triton's message is the report
        message = " ".join(str(e).split())
        return Compiled(spec_json, arch, False, f"{type(e).__name__}: {message[:2000]}", time.perf_counter() - start)
    out = Compiled(spec_json, arch, True, seconds=time.perf_counter() - start, fp_fusion=options.enable_fp_fusion,
                   shared=kernel.metadata.shared, num_warps=kernel.metadata.num_warps)
    if launches:
        from tools.int_ranges import overflows

        out.overflows = overflows(kernel.asm["ttir"], launches)
    out.reduce_forms, out.reduce_layouts = reduce_summary(kernel.asm["ttgir"])
    out.narrowing = narrowing(kernel.asm["ptx"])
    out.reassociating = reassociating(kernel.asm["llir"])
    if sass:
        from triton.tools.disasm import get_sass

        ops = sass_ops(get_sass(kernel.asm["cubin"]))
        out.sass = dict(Counter(o[0] for o in ops if o[0] != "LABEL"))
        out.loop = main_loop(ops)
        out.registers = registers(kernel.asm["cubin"])
    return out


def compile_all(specs: list[dict], archs=ARCHS, jobs: int | None = None, sass: bool = True,
                progress=None, launches: list | None = None) -> list[Compiled]:
    """compile_spec for every specialization and architecture, in `jobs` worker processes (`launches`:
    each specialization's launches, in the order of `specs`, for the int32 check)."""
    jobs = jobs or os.cpu_count() or 1
    tasks = [(s, a, launches[i] if launches else None) for a in archs for i, s in enumerate(specs)]
    # the heaviest first (the product kernels with many rows), so that the workers finish together
    tasks.sort(key=lambda t: -dict(map(tuple, t[0]["constexprs"])).get("ROWS", 0))
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=_worker_init) as pool:
        futures = [pool.submit(compile_spec, s, a, sass, ls) for s, a, ls in tasks]
        out = []
        for n, f in enumerate(futures, 1):
            out.append(f.result())
            if progress and (n % 50 == 0 or n == len(futures)):
                progress(f"compiled {n}/{len(futures)}")
    return out


# ------------------------------------------------------------------ checks and reports

def failures(results: list[Compiled]) -> list[str]:
    """One line per specialization that did not compile: the kernel, its specialization and Triton's message."""
    from benchmarks.triton_launches import Specialization

    return [f"sm_{r.arch}: {Specialization.from_json(r.spec).describe()}: {r.error}" for r in results if not r.ok]


def rounding_problems(compiled: dict) -> tuple[list[str], Counter]:
    """(a line per float32 -> 16-bit conversion that does not round to nearest even, or per kernel whose
    LLVM IR allows reassociation; the conversions found, by instruction) over {spec: Compiled}."""
    problems, found = [], Counter()
    for spec, r in compiled.items():
        if not r.ok:
            continue
        for instruction, n in r.narrowing.items():
            found[instruction] += n
            if ".rn." not in instruction + ".":
                problems.append(f"{spec.describe()}: {instruction} does not round to nearest even")
        if r.reassociating:
            problems.append(f"{spec.describe()}: its LLVM IR allows reassociating float operations")
    return problems, found


def launch_sites(recorder) -> dict[tuple, list]:
    """(workload, dtype, kernel, k) -> the specialization of that workload's k-th launch of the kernel
    at each recorded batch width (a Recorder's `width N` batches)."""
    sites: dict[tuple, list] = {}
    for (workload, dtype, batch), launches in recorder.sequences.items():
        if batch.startswith("width "):
            seen: Counter = Counter()
            for spec in launches:
                sites.setdefault((workload, dtype, spec.name, seen[spec.name]), []).append(spec)
                seen[spec.name] += 1
    return sites


def rows_per_program(spec) -> int:
    """Activation rows one program sums (the constexpr ROWS where the kernel takes it, else one)."""
    return dict(spec.constexprs).get("ROWS", 1)


def invariance_problems(recorder, compiled: dict) -> tuple[list[str], Counter]:
    """(a line per launch site whose compiled code may give a row different bits at another batch
    width, the launch sites checked by kernel): across the widths, each specialization's reductions
    (layouts, and digests per row: ROWS rows run ROWS times the one-row chains) must be those of the
    others, and where FMA contraction is on, its SASS FFMA and FMUL counts in one ratio at the same
    ROWS (a loop over tokens is unrolled at some widths and absent at width 1, which scales both) and
    a + b·ROWS across ROWS (fitted on the two smallest): a product contracted at some widths and not
    others breaks either."""
    problems, checked = [], Counter()
    for site, specs in launch_sites(recorder).items():
        distinct = list(dict.fromkeys(specs))
        results = [compiled[s] for s in distinct]
        if len(distinct) < 2 or not all(r.ok for r in results):
            continue  # nothing depends on the width, or a failure reported by `failures`
        checked[site[2]] += 1
        first, rows0 = results[0], rows_per_program(distinct[0])
        one_row = {d: n / rows0 for d, n in first.reduce_forms.items()}
        for spec, r in zip(distinct[1:], results[1:]):
            what = f"{' '.join(map(str, site))}: {spec.describe()} against {distinct[0].describe()}"
            if r.reduce_layouts != first.reduce_layouts:
                problems.append(f"{what}: the reductions' layouts differ")
            elif {d: n / rows_per_program(spec) for d, n in r.reduce_forms.items()} != one_row:
                problems.append(f"{what}: a row's reductions or the float operations feeding them differ")
        contracted = {}  # ROWS -> the distinct (FFMA, FMUL) counts of the specializations with ROWS rows
        for s, r in zip(distinct, results):
            if r.fp_fusion:
                contracted.setdefault(rows_per_program(s), set()).add((r.sass.get("FFMA", 0), r.sass.get("FMUL", 0)))
        for rows, counts in contracted.items():  # a loop unrolled at some widths repeats its body: the
            (f0, m0) = min(counts)                # counts scale, their ratio stays unless contraction differs
            if any(f * m0 != f0 * m for f, m in counts):
                problems.append(f"{' '.join(map(str, site))}: (FFMA, FMUL) counts {sorted(counts)} at ROWS={rows} "
                                f"are not in one ratio: contraction depends on the width")
        fused = sorted({rows_per_program(s): r for s, r in zip(distinct, results) if r.fp_fusion}.items())
        if len(fused) >= 3:
            (r1, c1), (r2, c2) = fused[:2]
            for opcode in ("FFMA", "FMUL"):
                base, step = c1.sass.get(opcode, 0), (c2.sass.get(opcode, 0) - c1.sass.get(opcode, 0)) / (r2 - r1)
                for rows, c in fused[2:]:
                    if c.sass.get(opcode, 0) != base + step * (rows - r1):
                        problems.append(f"{' '.join(map(str, site))}: {c.sass.get(opcode, 0)} {opcode} at ROWS={rows}, "
                                        f"not {base} + {step}·(ROWS - {r1}): contraction depends on the width")
    return problems, checked


def bytes_per_loop(spec) -> int:
    """Weight bytes one program reads per main-loop iteration of a product kernel (BLOCK_N rows, NB blocks)."""
    return spec.constant("BLOCK_N") * spec.constant("NB") * spec.constant("BYTES")


def cost_report(results: list[Compiled], rows=(1, 4)) -> list[str]:
    """The one-pass product kernel (fused_rows_kernel, whole rows, not cut) per weight type, activation
    dtype and ROWS in `rows`: its main loop's SASS instructions per thread, per weight byte for the
    whole program (4 warps), and its global loads per thread by width."""
    from benchmarks.triton_launches import Specialization

    lines, seen = [], set()
    for r in results:
        spec = Specialization.from_json(r.spec)
        if not (r.ok and r.loop and spec.kernel == "fused_rows_kernel" and not spec.constant("PAIRS")
                and spec.constant("ROWS") in rows):
            continue
        key = (r.arch, spec.constant("QTYPE"), spec.constant("ROWS"), spec.signature[0][1])
        if key in seen:
            continue
        seen.add(key)
        warps = dict(spec.options).get("num_warps", 4)
        per_byte = r.loop["instructions"] * warps / bytes_per_loop(spec)
        lines.append(f"sm_{r.arch} QTYPE={spec.constant('QTYPE')} ROWS={spec.constant('ROWS')} "
                     f"x {spec.signature[0][1]}: {r.loop['instructions']} instructions per thread per "
                     f"{bytes_per_loop(spec)} weight bytes = {per_byte:.2f} warp instructions per byte; "
                     f"loads per thread {r.loop['global_loads']}")
    return sorted(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny Qwen3.5 (q8_0) and its MoE sibling only")
    p.add_argument("--also", action="append", default=[], metavar="LABEL",
                   help="with --quick, also this workload (repeatable; e.g. 'qwen35-wide q8_0', 'gemma4-release q8_0')")
    p.add_argument("--widths", type=int, default=None, help="batch widths 1..N (default 16)")
    p.add_argument("--no-products", action="store_true",
                   help="without the products by a matrix of each kernel weight type (benchmarks/triton_launches.py)")
    p.add_argument("--arch", type=int, action="append", help=f"compute capability (repeatable; default {ARCHS})")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: the CPUs)")
    p.add_argument("--no-sass", action="store_true", help="skip the SASS listing (cuobjdump) of each kernel")
    p.add_argument("--check", action="store_true", help="also check rounding and batch invariance (as the tests)")
    p.add_argument("--cost", action="store_true", help="the product kernel's main loop per weight byte (SASS)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: specializations and results")
    p.add_argument("--release", action="store_true",
                   help="the wrappers at released models' shapes instead (benchmarks/release_launches.py): "
                        "shared memory within the launch limit, no int32 index arithmetic that wraps")
    args = p.parse_args(argv)
    from benchmarks import triton_launches

    say = (lambda line: print(line, file=sys.stderr))
    if args.release:
        from tools import triton_release

        return triton_release.release(tuple(args.arch or ARCHS), args.jobs, not args.no_sass, args.json, say)
    widths = range(1, (args.widths or triton_launches.WIDTHS) + 1)
    recorder = triton_launches.record(triton_launches.workloads(args.quick, args.also), widths=widths,
                                      products=not args.no_products, progress=say)
    specs = list(recorder.found)
    say(f"{len(specs)} distinct specializations")
    results = compile_all([s.to_json() for s in specs], tuple(args.arch or ARCHS), args.jobs, not args.no_sass, say)
    lines = failures(results)
    if args.check:
        for arch in sorted({r.arch for r in results}):
            compiled = {triton_launches.Specialization.from_json(r.spec): r for r in results if r.arch == arch}
            lines += [f"sm_{arch}: {line}" for line in rounding_problems(compiled)[0]]
            lines += [f"sm_{arch}: {line}" for line in invariance_problems(recorder, compiled)[0]]
    if args.json:
        import triton

        json.dump({"triton": triton.__version__,
                   "specializations": [{"spec": s.to_json(), "workloads": w} for s, w in recorder.found.items()],
                   "results": [asdict(r) for r in results], "problems": lines}, sys.stdout)
        print()
    else:
        for arch in sorted({r.arch for r in results}):
            ok = sum(r.ok for r in results if r.arch == arch)
            print(f"sm_{arch}: {ok}/{sum(r.arch == arch for r in results)} compiled")
        print("\n".join(lines + (cost_report(results) if args.cost else [])))
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
