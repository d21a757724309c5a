"""How many threads torch runs a model on (`verify`, `generate`: --threads 0, the default)."""

from __future__ import annotations

import math

THREADS_HELP = ("Compute threads (0: as many as the model's matrices can use: each thread gets at least the "
                "runtime's minimum share of a typical matrix, so a tiny model runs on one thread, a large one on "
                "every core).")
_DEFAULT: list[int] = []  # torch's count when first asked, before any command lowered it


def set_threads(model, requested: int = 0) -> int:
    """Set torch's thread count for running `model` and return it. `requested` 0 picks it by the runtime's own
    rule for splitting a call (runtime/dequant_native.py: MIN_THREAD_ELEMENTS values per thread), applied to
    the model's typical matrix: the size-weighted median of its 2-D tensors, where most of a forward's time
    goes. Small matrices split over threads cost more in waking them than they save: on a busy 2-core
    machine the bundled 2.9 M-parameter model ran `verify --hf` in 82 s on two threads, 6 s on one."""
    import torch

    from specconv.runtime.dequant_native import MIN_THREAD_ELEMENTS

    if not _DEFAULT:
        _DEFAULT.append(torch.get_num_threads())
    if requested:
        torch.set_num_threads(requested)
        return requested
    sizes = sorted(int(math.prod(t.shape)) for t in model.file.tensors.values() if len(t.shape) >= 2)
    typical, seen = 0, 0
    for size in sizes:
        seen += size
        if 2 * seen >= sum(sizes):
            typical = size
            break
    threads = max(1, min(_DEFAULT[0], typical // MIN_THREAD_ELEMENTS))
    torch.set_num_threads(threads)
    return threads
