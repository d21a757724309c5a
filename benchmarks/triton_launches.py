"""The Triton kernel specializations the CUDA backend launches, recorded on the CPU.

    python3 benchmarks/triton_launches.py            # every workload: kernels and their specializations
    python3 benchmarks/triton_launches.py --quick    # the tiny Qwen3.5 only

A forward runs on the `meta` device with the CUDA backend's choices (benchmarks/cuda_op_count.py
`meta_launches`: the Triton wrappers validate and allocate as on a GPU, each launch is recorded
instead of made). Each recorded launch becomes the specialization Triton's JIT would compile for
it, computed by Triton's own code for an sm_90 target without a driver: the argument binder
`create_function_from_signature` builds for a JITFunction (pointer element types, i32 / i64 by
value, integers equal to 1 turned into constants, multiples of 16 marked divisible, as the
kernel's do_not_specialize lists allow) and `JITFunction._pack_args`. New kernels are picked up
as they are launched: nothing here lists them.

A pointer's divisibility by 16 comes from `data_ptr()`; a meta tensor's is its storage offset in
bytes (base 0), which is the GPU's alignment for every tensor in an allocation aligned to 16
bytes: the CUDA caching allocator's are (512 bytes), and a view keeps its offset.

Workloads (`workloads`): the tiny Qwen3.5 (tests/fixtures/tiny_qwen35.py) and its MoE sibling,
the tiny Qwen3.5 in every kernel weight type (the product kernel compiles per type), and each
family fixture of cuda_op_count.FAMILIES, in bf16 and f32 compute; in each, a prompt of PROMPT
tokens (more than FUSED_MAX_ROWS: the dequantize-and-multiply path) and then a batch of every
width 1..WIDTHS (the decode step, the verification of k = 1..WIDTHS - 1 drafts). `--products` adds
quant_matmul and grouped_matmul by a PRODUCT_SHAPE matrix of every kernel weight type (the tiny
fixtures' rows are too short for K-quant blocks) at the same widths.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import cuda_op_count  # noqa: E402

KERNELS = "specconv.runtime.kernels_triton"
TARGET_ARCH = 90  # the specialization is the JIT's on an H100 / H200 (sm_90)
PROMPT = 20  # prompt tokens: more than FUSED_MAX_ROWS (16)
WIDTHS = 16  # batch widths 1..16: every row count of the one-pass product kernel
# the tiny Qwen3.5 in each weight type the kernels read (outtypes of `specconv convert`)
QWEN35_OUTTYPES = ("q8_0", "q4_k_m", "q5_k_m", "q6_k", "bf16", "f16", "f32")
DTYPES = ("bf16", "f32")
PRODUCT_SHAPE = (2048, 2048)  # the synthetic products' matrices (rows of whole K-quant super-blocks)


@dataclass(frozen=True)
class Specialization:
    """One kernel as Triton's JIT compiles it: its parameters' types, which integer and pointer
    parameters are multiples of 16, the constants (constexpr parameters and arguments specialized
    to a value) and the launch's options (num_warps, enable_fp_fusion, ...)."""

    module: str  # the kernel module in runtime/kernels_triton (`_quant_jit`)
    kernel: str
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type or "constexpr"), in order
    divisible: tuple[str, ...]  # parameters marked tt.divisibility = 16
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.kernel}"

    def constant(self, name: str):
        return dict(self.constexprs)[name]

    def describe(self) -> str:
        """One line: the kernel, its non-constant parameters' types (`/16`: divisible), constants
        and options."""
        consts = dict(self.constexprs)
        args = [f"{p}:{t}{'/16' if p in self.divisible else ''}" for p, t in self.signature if p not in consts]
        values = [f"{p}={v}" for p, v in self.constexprs]
        opts = [f"{k}={v}" for k, v in self.options]
        return f"{self.name}({', '.join(args)}; {', '.join(values)}; {', '.join(opts)})"

    def to_json(self) -> dict:
        return {"module": self.module, "kernel": self.kernel, "signature": [list(p) for p in self.signature],
                "divisible": list(self.divisible), "constexprs": [list(c) for c in self.constexprs],
                "options": [list(o) for o in self.options]}

    @classmethod
    def from_json(cls, d: dict) -> "Specialization":
        return cls(d["module"], d["kernel"], tuple(map(tuple, d["signature"])), tuple(d["divisible"]),
                   tuple(map(tuple, d["constexprs"])), tuple(map(tuple, d["options"])))


def jit_function(module: str, kernel: str):
    """The kernel's JITFunction; under TRITON_INTERPRET=1 (where @triton.jit gives an interpreted
    function) one built from the same Python function and decorator arguments: its parameters and
    do_not_specialize lists are what the binder reads."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    fn = getattr(importlib.import_module(f"{KERNELS}.{module}"), kernel)
    return JITFunction(fn.fn, **fn.kwargs) if isinstance(fn, InterpretedFunction) else fn


@functools.cache
def _binder(module: str, kernel: str):
    """(JITFunction, backend, binder): the binder Triton's JIT builds for the kernel, for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = jit_function(module, kernel)
    backend = make_backend(GPUTarget("cuda", TARGET_ARCH, 32))
    return fn, backend, create_function_from_signature(fn.signature, fn.params, backend)


def _plain(value, what: str):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{what}: a constant of type {type(value).__name__} cannot be recorded")


def specialize(module: str, kernel: str, args: tuple, kwargs: dict) -> Specialization:
    """The specialization a launch `module.kernel[grid](*args, **kwargs)` compiles (as JITFunction.run
    computes it)."""
    fn, backend, binder = _binder(module, kernel)
    bound, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    names = list(signature)
    option_names = set(type(backend.parse_options({})).__dataclass_fields__)
    return Specialization(
        module, kernel, tuple(signature.items()),
        tuple(names[path[0]] for path, attr in attrs.items() if ["tt.divisibility", 16] in attr),
        tuple((names[path[0]], _plain(v, f"{kernel}.{names[path[0]]}")) for path, v in sorted(constexprs.items())),
        tuple(sorted((k, _plain(v, f"{kernel} option {k}")) for k, v in kwargs.items() if k in option_names)))


class Recorder:
    """Collects the specialization of each launch `meta_launches` records while it is observing: the
    workloads that launch each one, and each batch's launches in order."""

    def __init__(self, widths: Iterable[int] = range(1, WIDTHS + 1)):
        self.widths = tuple(widths)
        self.found: dict[Specialization, list[str]] = {}
        self.sequences: dict[tuple[str, str, str], list[Specialization]] = {}  # (workload, dtype, batch) -> launches
        self.cut_short: list[str] = []  # batches whose forward read values (not runnable on meta)
        self.key = ("", "", "")

    def __call__(self, module: str, kernel: str, grid, args: tuple, kwargs: dict) -> None:
        spec = specialize(module, kernel, args, kwargs)
        labels = self.found.setdefault(spec, [])
        if " ".join(self.key) not in labels:
            labels.append(" ".join(self.key))
        self.sequences.setdefault(self.key, []).append(spec)

    def run(self, path: Path, dtype: str, workload: str) -> None:
        """A prompt, then one batch of each width, of the GGUF at `path` on `meta` with the CUDA backend,
        every launch recorded (batches keyed `prompt N` and `width N`)."""
        from specconv.runtime import Context, GraphType, load_model

        cuda_op_count.launch_observers.append(self)
        try:
            with cuda_op_count.meta_launches(), cuda_op_count.cuda_backend_on_meta():
                self.key = (workload, dtype, "load")
                model = load_model(path, device="meta", dtype=dtype)
                ctx = Context(model, GraphType.MAIN, n_ctx=PROMPT + sum(self.widths) + 8, n_rs_seq=max(self.widths) - 1)
                self.key = (workload, dtype, f"prompt {PROMPT}")
                try:
                    ctx.decode([5 + i % 7 for i in range(PROMPT)])
                except NotImplementedError:  # a meta tensor's values read: routed experts of a prompt
                    self.cut_short.append(" ".join(self.key))  # (by expert, on the host); launches up to there kept
                for width in self.widths:
                    self.key = (workload, dtype, f"width {width}")
                    ctx.decode([3 + i % 5 for i in range(width)])
        finally:
            cuda_op_count.launch_observers.remove(self)


    def run_products(self, dtype: str, n_out: int = PRODUCT_SHAPE[0], n_in: int = PRODUCT_SHAPE[1]) -> None:
        """quant_matmul and a grouped_matmul of three matrices by an [n_out, n_in] matrix of each kernel
        weight type (the tiny fixtures' rows are too short for K-quants), at each width, on `meta`."""
        import torch

        from specconv.runtime import kernels_triton
        from specconv.runtime.kernels_triton.dequant import GEOMETRY

        x_dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
        cuda_op_count.launch_observers.append(self)
        try:
            with cuda_op_count.meta_launches():
                for qtype, (values, size) in sorted(GEOMETRY.items(), key=lambda item: int(item[0])):
                    packed = torch.empty(n_out, n_in // values * size, dtype=torch.uint8, device="meta")
                    for width in self.widths:
                        self.key = (f"products {qtype.name}", dtype, f"width {width}")
                        x = torch.empty(width, n_in, dtype=x_dtype, device="meta")
                        kernels_triton.quant_matmul(x, packed, qtype, n_out, n_in)
                        kernels_triton.grouped_matmul(x, [packed] * 3, qtype, [n_out] * 3, n_in)
        finally:
            cuda_op_count.launch_observers.remove(self)


@dataclass(frozen=True)
class Workload:
    label: str
    build: Callable[[Path], Path]  # writes the GGUF into a fresh folder, returns its path


def workloads(quick: bool = False, also: Iterable[str] = ()) -> list[Workload]:
    """The tiny Qwen3.5 in each weight type, its MoE sibling, the 2304-wide Qwen3.5 (rows normed in
    blocks) and every family fixture cuda_op_count counts; with `quick`, the tiny Qwen3.5 in q8_0, its
    MoE sibling and the workloads labelled in `also`."""
    out = [Workload(f"qwen35 {t}", functools.partial(cuda_op_count.tiny_fixture, outtype=t))
           for t in QWEN35_OUTTYPES]
    out.append(Workload("qwen35-moe q8_0", functools.partial(cuda_op_count.tiny_fixture, moe=True)))
    out.append(Workload("qwen35-wide q8_0", cuda_op_count.wide_fixture))
    out += [Workload(f"{name} q8_0", functools.partial(_family, name=name)) for name in cuda_op_count.FAMILIES]
    if not quick:
        return out
    also = set(also)
    unknown = also - {w.label for w in out}
    if unknown:
        raise SystemExit(f"no workload {', '.join(sorted(unknown))}; one of {', '.join(w.label for w in out)}")
    return [w for w in out if w.label in ("qwen35 q8_0", "qwen35-moe q8_0") or w.label in also]


def _family(root: Path, name: str) -> Path:
    return cuda_op_count.family_fixture(root, name)


def record(chosen: Iterable[Workload], dtypes: Iterable[str] = DTYPES, widths: Iterable[int] = range(1, WIDTHS + 1),
           products: bool = False, progress: Callable[[str], None] | None = None) -> Recorder:
    """A Recorder that ran every workload in each compute dtype (and with `products`, the synthetic
    products of every kernel weight type): its `found` holds every distinct specialization with the
    batches that launch it."""
    recorder = Recorder(widths)
    dtypes = tuple(dtypes)
    with tempfile.TemporaryDirectory() as tmp:
        for i, workload in enumerate(chosen):
            path = workload.build(Path(tmp) / str(i))
            for dtype in dtypes:
                recorder.run(path, dtype, workload.label)
            if progress:
                progress(f"{workload.label}: {len(recorder.found)} specializations so far")
    if products:
        for dtype in dtypes:
            recorder.run_products(dtype)
        if progress:
            progress(f"products: {len(recorder.found)} specializations so far")
    return recorder


def main(argv=None) -> Recorder:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny Qwen3.5 (q8_0) and its MoE sibling only")
    p.add_argument("--also", action="append", default=[], metavar="LABEL",
                   help="with --quick, also this workload (repeatable; e.g. 'qwen35-wide q8_0', 'gemma4-release q8_0')")
    p.add_argument("--products", action="store_true", help="also products by a matrix of each kernel weight type")
    p.add_argument("-v", "--verbose", action="store_true", help="every specialization, one per line")
    args = p.parse_args(argv)
    recorder = record(workloads(args.quick, args.also), products=args.products,
                      progress=lambda line: print(line, file=sys.stderr))
    found = recorder.found
    kernels: dict[str, int] = {}
    for spec in found:
        kernels[spec.name] = kernels.get(spec.name, 0) + 1
    print(f"{len(found)} specializations of {len(kernels)} kernels")
    for name, n in sorted(kernels.items()):
        print(f"  {name}: {n}")
    if args.verbose:
        for spec, labels in found.items():
            print(f"{spec.describe()}  [{labels[0]}{' ...' if len(labels) > 1 else ''}]")
    return recorder


if __name__ == "__main__":
    main()
