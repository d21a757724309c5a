"""Device operations of one decode step with the CUDA backend's choices, counted on the CPU.

    python3 benchmarks/cuda_op_count.py                       # the tiny Qwen3.5 fixture, bf16, k = 3
    python3 benchmarks/cuda_op_count.py --model FILE.gguf     # any file (its weights are never read)

The model is loaded on the `meta` device (tensors without values: nothing is computed, nothing needs
a GPU) with runtime/backend_cuda.py's CudaBackend as the device's backend, so the forward takes the
CUDA backend's branches. Its Triton wrappers (runtime/kernels_triton) run as they are, validating
and allocating; only the launch itself is recorded instead of made (`meta_launches`), with the grid
a GPU of `--sms` multiprocessors would get (the second launch of a product cut along its inner
dimension included). Every aten operation the step dispatches is seen by a TorchDispatchMode:

* a launch: an aten operation that computes (add, mul, copy, cat, index_select, ...) or one Triton
  launch: what a GPU runs as one kernel;
* free: views, `empty` and the like (no kernel on a GPU).

Counts are per block (the graph's block function, attributed by name), outside the blocks
(embedding, rope tables, output norm and head) and per step, for one decode step and one
verification batch of k + 1 tokens, and by operation. torch may run a few composite operations as
one kernel on a GPU where the meta device shows their parts (F.rms_norm on CUDA in recent torch);
the counts are those of the operations the runtime asks for.
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


def is_launch(func) -> bool:
    """Whether an aten operation runs a kernel on a GPU: not a view, not an allocation."""
    return not (func.is_view or func._schema.name.split("::")[-1] in FREE)


@dataclass
class Tally:
    """Launches by label (block or OUTSIDE) and by operation name (aten ones and `triton.<kernel>`)."""

    by_label: Counter = field(default_factory=Counter)
    by_op: Counter = field(default_factory=Counter)
    free: int = 0

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
        if is_launch(func):
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


def active_counters() -> list[OpCounter]:
    """The counters counting now, outermost first."""
    return list(_active)


class _Launcher:
    """`jit.<kernel>[grid](...)`: records one launch with the active counter, runs nothing."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for counter in _active:
                counter.launch(self.name)
        return launch


class _JitModule:
    def __getattr__(self, name: str) -> _Launcher:
        return _Launcher(name)


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
    _common.jit_module = lambda name: _JitModule()
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


@contextlib.contextmanager
def counting(graph_module=None) -> Iterator[OpCounter]:
    """An OpCounter over the ops dispatched inside; with `graph_module` (a runtime/graphs module whose
    forward calls its `_block(w, hp, i, ...)`), each block's ops labelled `block i`."""
    counter = OpCounter()
    real_block = None if graph_module is None else graph_module._block

    def block(w, hp, i, *args, **kwargs):
        with counter.labelled(f"block {i}"):
            return real_block(w, hp, i, *args, **kwargs)

    if graph_module is not None:
        graph_module._block = block
    _active.append(counter)
    try:
        with counter:
            yield counter
    finally:
        _active.remove(counter)
        if graph_module is not None:
            graph_module._block = real_block


@dataclass
class StepCounts:
    step: Tally  # one decode step (one token)
    verify: Tally  # one verification batch of k + 1 tokens
    recurrent: list[bool]  # per trunk block


def count_steps(path, dtype: str = "bf16", k: int = 3, backend=None, sms: int = H200_SMS) -> StepCounts:
    """Launches of one decode step and one verification batch of k + 1 tokens (after a short prompt)
    of the GGUF at `path`, loaded on `meta` with `backend` (default: the CUDA backend)."""
    from specconv.runtime import Context, GraphType, load_model
    from specconv.runtime.graphs import qwen35

    with meta_launches(sms), cuda_backend_on_meta(backend):
        model = load_model(path, device="meta", dtype=dtype)
        if model.hparams.arch not in qwen35.ARCHES:
            raise SystemExit(f"{path}: the per-block count follows the qwen35 graph, not {model.hparams.arch}")
        ctx = Context(model, GraphType.MAIN, n_ctx=64, n_rs_seq=k)
        ctx.decode(list(range(5, 13)))
        with counting(qwen35) as step:
            ctx.decode([3])
        with counting(qwen35) as verify:
            ctx.decode(list(range(20, 21 + k)))
    return StepCounts(step.tally, verify.tally, list(model.hparams.recurrent))


def block_summary(tally: Tally, recurrent: list[bool]) -> dict[str, tuple[int, int]]:
    """(blocks, launches per block) for the Gated DeltaNet and the attention blocks (equal within a kind)."""
    out = {}
    for kind, want in (("Gated DeltaNet", True), ("attention", False)):
        counts = {tally.by_label[f"block {i}"] for i, r in enumerate(recurrent) if r == want}
        if counts:
            out[kind] = (sum(r == want for r in recurrent), max(counts))
    return out


def report(counts: StepCounts, k: int, top: int = 12) -> str:
    lines = []
    for name, tally in (("decode step (1 token)", counts.step), (f"verification ({k + 1} tokens)", counts.verify)):
        per_block = block_summary(tally, counts.recurrent)
        blocks = ", ".join(f"{kind} {n} × {each}" for kind, (n, each) in per_block.items())
        lines.append(f"{name}: {tally.total} launches ({blocks}, {OUTSIDE} {tally.by_label[OUTSIDE]}); "
                     f"{tally.free} free ops (views, allocations)")
    lines.append("decode step, launches by operation: " +
                 ", ".join(f"{op} {n}" for op, n in counts.step.by_op.most_common(top)))
    return "\n".join(lines)


def tiny_fixture(root: Path, outtype: str = "q8_0", moe: bool = False) -> Path:
    """The tiny Qwen3.5 of tests/fixtures/tiny_qwen35.py, converted by `specconv convert`."""
    from tests.fixtures.gguf_files import convert_gguf
    from tests.fixtures.tiny_qwen35 import build_qwen35

    return convert_gguf(build_qwen35(root / "hf", moe=moe), root / "model.gguf", outtype=outtype)


def main(argv=None) -> StepCounts:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a qwen35 GGUF (default: the tiny test fixture)")
    p.add_argument("--outtype", default="q8_0", help="the tiny fixture's type (without --model)")
    p.add_argument("--moe", action="store_true", help="the tiny fixture's MoE sibling (without --model)")
    p.add_argument("--dtype", default="bf16", help="compute dtype (bf16: the CUDA default)")
    p.add_argument("-k", type=int, default=3, help="drafts per verification batch")
    p.add_argument("--sms", type=int, default=H200_SMS, help="multiprocessors of the GPU the launches are planned for")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tiny_fixture(Path(tmp), args.outtype, args.moe)
        counts = count_steps(path, args.dtype, args.k, sms=args.sms)
    print(report(counts, args.k))
    return counts


if __name__ == "__main__":
    main()
