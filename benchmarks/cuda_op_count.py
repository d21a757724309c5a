"""Device operations of one decode step with the CUDA backend's choices, counted on the CPU.

    python3 benchmarks/cuda_op_count.py                       # the tiny Qwen3.5 fixture, bf16, k = 3
    python3 benchmarks/cuda_op_count.py --model FILE.gguf     # any file (its weights are never read)
    python3 benchmarks/cuda_op_count.py --family llama-release --family gemma4-release
                                                              # family snapshot fixtures (FAMILIES)

The model is loaded on the `meta` device (tensors without values: nothing is computed, nothing needs
a GPU) with runtime/backend_cuda.py's CudaBackend as the device's backend, so the forward takes the
CUDA backend's branches. Its Triton wrappers (runtime/kernels_triton) run as they are, validating
and allocating; only the launch itself is recorded instead of made (`meta_launches`), with the grid
a GPU of `--sms` multiprocessors would get (the second launch of a product cut along its inner
dimension included). Every aten operation the step dispatches is seen by a TorchDispatchMode:

* a launch: an aten operation that computes (add, mul, copy, cat, index_select, ...) or one Triton
  launch: what a GPU runs as one kernel;
* free: views, `empty` and the like (no kernel on a GPU);
* uploads: copies of host tensors to the device (token ids, positions, a batch's ring slots), counted
  apart: a GPU's copy engine does them, and a captured step takes them from its static buffer;
* host: operations on host tensors only (the token ids' range check): the CPU's work, counted apart.

Counts are per block, outside the blocks (embedding, rope tables, output norm and head) and per
step, for one decode step and one verification batch of k + 1 tokens, and by operation. A block
is what decoder.forward_trunk runs as block i (every graph built by runtime/graphs/trunk.py), or,
for a graph with a forward of its own (gemma4), its module's `_block(w, hp, i, ...)`. torch may run
a few composite operations as one kernel on a GPU where the meta device shows their parts
(F.rms_norm on CUDA in recent torch); the counts are those of the operations the runtime asks for.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUTSIDE = "outside blocks"
H200_SMS = 132  # the card of docs/benchmarks.md's measurements
# aten operations that launch no kernel on a GPU (beyond views, which torch marks itself)
FREE = frozenset({"empty", "empty_strided", "empty_like", "detach", "detach_", "alias", "lift_fresh",
                  "_local_scalar_dense", "resize_", "set_", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
                  "is_same_size"})


def is_upload(func, args, kwargs) -> bool:
    """Whether an aten operation copies a host tensor to the device (token ids, positions, a batch's
    slots): a copy on a GPU, not a kernel."""
    if func is not torch.ops.aten._to_copy.default:
        return False
    device = kwargs.get("device")
    return args[0].device.type == "cpu" and device is not None and torch.device(device).type != "cpu"


def on_host(args, kwargs) -> bool:
    """Whether an aten operation reads only host tensors (the token ids' range check, a batch's
    slots built on the CPU): the host's work, no kernel on the device."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def is_launch(func) -> bool:
    """Whether an aten operation runs a kernel on a GPU: not a view, not an allocation."""
    return not (func.is_view or func._schema.name.split("::")[-1] in FREE)


@dataclass
class Tally:
    """Launches by label (block or OUTSIDE) and by operation name (aten ones and `triton.<kernel>`)."""

    by_label: Counter = field(default_factory=Counter)
    by_op: Counter = field(default_factory=Counter)
    free: int = 0
    uploads: int = 0  # host-to-device copies (a copy engine's work, not a kernel; outside a captured step)
    host: int = 0  # operations on host tensors only (no device work)

    @property
    def total(self) -> int:
        return sum(self.by_label.values())

    def add(self, label: str, op: str) -> None:
        self.by_label[label] += 1
        self.by_op[op] += 1


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, and the Triton launches recorded by
    `meta_launches`, under the current label (`labelled`)."""

    def __init__(self):
        super().__init__()
        self.tally = Tally()
        self.label = OUTSIDE

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view and func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
            with self:  # `to`, `reshape`, `contiguous`: a view or a copy; their parts say which
                return func.decompose(*args, **kwargs)
        if is_upload(func, args, kwargs):
            self.tally.uploads += 1
        elif on_host(args, kwargs):
            self.tally.host += 1
        elif is_launch(func):
            self.tally.add(self.label, func._schema.name.split("::")[-1])
        else:
            self.tally.free += 1
        return func(*args, **kwargs)

    def launch(self, kernel: str) -> None:
        self.tally.add(self.label, f"triton.{kernel}")

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        outer, self.label = self.label, label
        try:
            yield
        finally:
            self.label = outer


_active: list[OpCounter] = []
# callables observe(module, kernel, grid, args, kwargs) told of every launch `meta_launches` records
# (benchmarks/triton_launches.py: the specialization each launch compiles)
launch_observers: list = []


def active_counters() -> list[OpCounter]:
    """The counters counting now, outermost first."""
    return list(_active)


class _Launcher:
    """`jit.<kernel>[grid](...)`: records one launch with the active counter and the observers, runs
    nothing."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for counter in _active:
                counter.launch(self.name)
            for observe in launch_observers:
                observe(self.module, self.name, grid, args, kwargs)
        return launch


class _JitModule:
    def __init__(self, name: str):
        self.name = name  # the kernel module's name in runtime/kernels_triton

    def __getattr__(self, name: str) -> _Launcher:
        return _Launcher(self.name, name)


@contextlib.contextmanager
def meta_launches(sms: int = H200_SMS) -> Iterator[None]:
    """runtime/kernels_triton's wrappers accept `meta` tensors and record their launches instead of
    making them; the device reports `sms` multiprocessors (the split of a product depends on it)."""
    from specconv.runtime.kernels_triton import _common

    saved = _common.check_device, _common.jit_module, _common.multiprocessors
    real_check = _common.check_device

    def check_device(op, *tensors):
        if tensors[0].device.type == "meta":
            if any(t.device != tensors[0].device for t in tensors[1:]):
                return real_check(op, *tensors)  # its one-line error
            return tensors[0].device
        return real_check(op, *tensors)

    _common.check_device = check_device
    _common.jit_module = _JitModule
    _common.multiprocessors = lambda device: sms
    try:
        yield
    finally:
        _common.check_device, _common.jit_module, _common.multiprocessors = saved


@contextlib.contextmanager
def cuda_backend_on_meta(backend=None) -> Iterator[object]:
    """The `meta` device's backend is `backend` (default: the CUDA backend with runtime/kernels_triton,
    its launches recorded: meta_launches) while inside."""
    from specconv.runtime import backend as backend_module, kernels_triton
    from specconv.runtime.backend_cuda import CudaBackend

    chosen = CudaBackend(kernels_triton, device_types=("meta",)) if backend is None else backend
    real = backend_module._backend
    backend_module._backend = lambda kind: chosen if kind == "meta" else real(kind)
    try:
        yield chosen
    finally:
        backend_module._backend = real


def _block_hooks(counter: OpCounter, graph) -> list[tuple[object, str, object]]:
    """(module, name, replacement) that label each trunk block's ops `block i` while counting: the
    block function decoder.forward_trunk is handed (trunk.Trunk graphs), and the `_block(w, hp, i, ...)`
    of a graph module whose forward_main is its own."""
    from specconv.runtime.graphs import trunk

    real_trunk = trunk.forward_trunk

    def labelled(block):
        def each(i, h, rope):
            with counter.labelled(f"block {i}"):
                return block(i, h, rope)
        return each

    def forward_trunk(*args):  # forward_trunk(w, ..., make_rope, block), all positional (trunk.Trunk)
        return real_trunk(*args[:-1], labelled(args[-1]))

    hooks = [(trunk, "forward_trunk", forward_trunk)]
    module = sys.modules[graph.forward_main.__module__]
    if module is not trunk and "_block" in vars(module):
        real_block = module._block

        def block(w, hp, i, *args, **kwargs):
            with counter.labelled(f"block {i}"):
                return real_block(w, hp, i, *args, **kwargs)
        hooks.append((module, "_block", block))
    return hooks


@contextlib.contextmanager
def counting(graph=None) -> Iterator[OpCounter]:
    """An OpCounter over the ops dispatched inside; with `graph` (the runtime Graph the forward runs),
    each trunk block's ops labelled `block i` (_block_hooks)."""
    counter = OpCounter()
    hooks = [] if graph is None else _block_hooks(counter, graph)
    saved = [(module, name, getattr(module, name)) for module, name, _ in hooks]
    for module, name, replacement in hooks:
        setattr(module, name, replacement)
    _active.append(counter)
    try:
        with counter:
            yield counter
    finally:
        _active.remove(counter)
        for module, name, real in saved:
            setattr(module, name, real)


@dataclass
class StepCounts:
    step: Tally  # one decode step (one token)
    verify: Tally  # one verification batch of k + 1 tokens
    recurrent: list[bool]  # per trunk block (all False in a graph without Gated DeltaNet blocks)
    arch: str = ""


def count_steps(path, dtype: str = "bf16", k: int = 3, backend=None, sms: int = H200_SMS) -> StepCounts:
    """Launches of one decode step and one verification batch of k + 1 tokens (after a short prompt)
    of the GGUF at `path`, loaded on `meta` with `backend` (default: the CUDA backend)."""
    from specconv.archs.qwen35_hparams import Qwen35HParams
    from specconv.runtime import Context, GraphType, load_model

    with meta_launches(sms), cuda_backend_on_meta(backend):
        model = load_model(path, device="meta", dtype=dtype)
        hp = model.hparams
        ctx = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=k)
        ctx.decode(list(range(5, 13)))
        with counting(model.graph) as step:
            ctx.decode([3])
        with counting(model.graph) as verify:
            ctx.decode(list(range(20, 21 + k)))
    # Qwen3.5 and Qwen3-Next (whose hparams extend Qwen3.5's) mix Gated DeltaNet and attention blocks
    recurrent = list(hp.recurrent) if isinstance(hp, Qwen35HParams) else [False] * hp.num_hidden_layers
    return StepCounts(step.tally, verify.tally, recurrent, hp.arch)


def block_summary(tally: Tally, recurrent: list[bool]) -> dict[str, tuple[int, int]]:
    """(blocks, launches per block) for the Gated DeltaNet and the attention blocks (equal within a kind)."""
    out = {}
    for kind, want in (("Gated DeltaNet", True), ("attention", False)):
        counts = {tally.by_label[f"block {i}"] for i, r in enumerate(recurrent) if r == want}
        if counts:
            out[kind] = (sum(r == want for r in recurrent), max(counts))
    return out


def block_counts(tally: Tally, n_blocks: int) -> list[tuple[int, int]]:
    """(blocks, launches per block) for each distinct per-block count, in block order of first use:
    a family's blocks of one shape (dense, MoE, sliding, full, ...) share a count."""
    per_block = Counter(tally.by_label[f"block {i}"] for i in range(n_blocks))
    return [(n, each) for each, n in per_block.items()]


def report(counts: StepCounts, k: int, top: int = 12) -> str:
    lines = [f"{counts.arch}:"] if counts.arch else []
    for name, tally in (("decode step (1 token)", counts.step), (f"verification ({k + 1} tokens)", counts.verify)):
        if any(counts.recurrent):
            per_block = block_summary(tally, counts.recurrent)
            blocks = ", ".join(f"{kind} {n} × {each}" for kind, (n, each) in per_block.items())
        else:
            blocks = "blocks " + ", ".join(f"{n} × {each}" for n, each in block_counts(tally, len(counts.recurrent)))
        lines.append(f"{name}: {tally.total} launches ({blocks}, {OUTSIDE} {tally.by_label[OUTSIDE]}); "
                     f"{tally.free} free ops (views, allocations), {tally.uploads} host-to-device copies, "
                     f"{tally.host} host operations")
    lines.append("decode step, launches by operation: " +
                 ", ".join(f"{op} {n}" for op, n in counts.step.by_op.most_common(top)))
    return "\n".join(lines)


def tiny_fixture(root: Path, outtype: str = "q8_0", moe: bool = False) -> Path:
    """The tiny Qwen3.5 of tests/fixtures/tiny_qwen35.py, converted by `specconv convert`."""
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_qwen35 import build_qwen35

    return convert_gguf(build_qwen35(root / "hf", moe=moe), root / "model.gguf", outtype=outtype)


def wide_fixture(root: Path, outtype: str = "q8_0") -> Path:
    """A 4-block Qwen3.5 (tools/synth_qwen35.py) whose hidden size (2304) is wider than a norm block
    (kernels_triton.norm.ROW_CHUNK): rows normed in blocks, alone and in a product's tail. Its FFN is
    320 wide, so that the down product stays in the file's layout and reads the GLU itself (rows of a
    multiple of 256 values take a GLU launch before the tensor-core form)."""
    import torch

    from tests.fixtures.gguf_files import convert_gguf
    from tools import synth_qwen35

    source = synth_qwen35.write_checkpoint(root / "wide", n_layers=4, hidden_size=2304, intermediate_size=320,
                                           vocab_size=8192, seed=int(torch.randint(1 << 30, ())))
    return convert_gguf(source, root / "wide.gguf", outtype=outtype)


def family_fixture(root: Path, name: str, outtype: str = "q8_0") -> Path:
    """The target of family snapshot fixture `name` (tools/family_snapshot.py: the tiny checkpoints of
    tests/fixtures/tiny_*.py in a release layout or the shapes that switch behaviour), converted."""
    from tests.fixtures.gguf_files import convert_gguf
    from tools import family_snapshot

    fixtures = {f.name: f for f in family_snapshot.families()}
    if name not in fixtures:
        raise SystemExit(f"no family fixture {name!r}; one of {', '.join(sorted(fixtures))}")
    return convert_gguf(fixtures[name].build(root / "build").src, root / "model.gguf", outtype=outtype)


# one fixture per trunk graph the launch counts are reported for (docs/benchmarks.md)
FAMILIES = ("llama-release", "qwen3-release", "qwen3moe-release", "glm4moe-release", "deepseek2-shapes",
            "gemma4-release", "gemma4-moe-shapes")


def main(argv=None) -> list[StepCounts]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a GGUF (default: the tiny Qwen3.5 test fixture)")
    p.add_argument("--family", action="append", default=[],
                   help=f"a family snapshot fixture instead (repeatable; 'all': {', '.join(FAMILIES)})")
    p.add_argument("--outtype", default="q8_0", help="the fixtures' type (without --model)")
    p.add_argument("--moe", action="store_true", help="the tiny Qwen3.5's MoE sibling (without --model)")
    p.add_argument("--wide", action="store_true", help="a 2304-wide Qwen3.5, wider than a norm block (without --model)")
    p.add_argument("--dtype", default="bf16", help="compute dtype (bf16: the CUDA default)")
    p.add_argument("-k", type=int, default=3, help="drafts per verification batch")
    p.add_argument("--sms", type=int, default=H200_SMS, help="multiprocessors of the GPU the launches are planned for")
    args = p.parse_args(argv)
    families = [f for name in args.family for f in (FAMILIES if name == "all" else [name])]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model or not families:
            model = args.model or (wide_fixture(Path(tmp), args.outtype) if args.wide
                                   else tiny_fixture(Path(tmp), args.outtype, args.moe))
            out.append(count_steps(model, args.dtype, args.k, sms=args.sms))
            print(report(out[-1], args.k))
        for name in families:
            path = family_fixture(Path(tmp) / name, name, args.outtype)
            out.append(count_steps(path, args.dtype, args.k, sms=args.sms))
            print(f"[{name}] " + report(out[-1], args.k))
    return out


if __name__ == "__main__":
    main()
